//! Static files under `--ui-dir` (the browser playground): `GET`/`HEAD` of a
//! path outside the API routes is looked up inside that one directory.
//!
//! The URL path is percent-decoded and split into segments; a `.`/`..`
//! segment, a hidden name (leading `.`), a backslash or NUL is refused, and
//! the file found must still lie under the directory after resolving
//! symlinks. A path ending in `/` serves that folder's `index.html`; a folder
//! named without the slash redirects to it. Everything else is a 404.
use std::path::{Path, PathBuf};

use hyper::header::{self, HeaderValue};
use hyper::{Method, Response, StatusCode};

use super::Body;
use crate::server::openai::ApiError;

/// Files larger than this are not served (the playground's are a few KiB).
const MAX_FILE_BYTES: u64 = 16 << 20;

enum Found {
    File(Vec<u8>, &'static str),
    /// A folder asked for without its trailing slash.
    Folder,
    Missing,
}

/// The response for `uri_path` under `root` (an absolute, canonical folder).
pub async fn serve(root: &Path, uri_path: &str) -> Response<Body> {
    let Some(rel) = relative_path(uri_path) else {
        return super::edge::unknown_path::<ApiError>(&Method::GET, uri_path);
    };
    let root = root.to_path_buf();
    let found = tokio::task::spawn_blocking(move || lookup(&root, &rel)).await.unwrap_or(Found::Missing);
    match found {
        Found::File(bytes, content_type) => {
            let mut r = Response::new(super::full(bytes));
            let h = r.headers_mut();
            h.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
            h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
            h.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
            r
        }
        Found::Folder => match HeaderValue::from_str(&format!("{uri_path}/")) {
            Ok(location) => {
                let mut r = Response::new(super::empty());
                *r.status_mut() = StatusCode::PERMANENT_REDIRECT;
                r.headers_mut().insert(header::LOCATION, location);
                r
            }
            Err(_) => super::edge::unknown_path::<ApiError>(&Method::GET, uri_path),
        },
        Found::Missing => super::edge::unknown_path::<ApiError>(&Method::GET, uri_path),
    }
}

/// The decoded, checked relative file path of a URL path (`index.html` for a
/// trailing slash); `None` when it names anything outside the folder.
fn relative_path(uri_path: &str) -> Option<PathBuf> {
    let decoded = percent_decode_path(uri_path.strip_prefix('/')?)?;
    let mut rel = PathBuf::new();
    let mut segments = decoded.split('/').peekable();
    while let Some(seg) = segments.next() {
        let last = segments.peek().is_none();
        if seg.is_empty() && last {
            rel.push("index.html");
            break;
        }
        if seg.is_empty() || seg.starts_with('.') || seg.contains(['\\', '\0']) {
            return None;
        }
        rel.push(seg);
    }
    Some(rel)
}

/// `%XX` decoding of a URL path (`+` stays a plus sign in paths).
fn percent_decode_path(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            out.push(u8::from_str_radix(s.get(i + 1..i + 3)?, 16).ok()?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

fn lookup(root: &Path, rel: &Path) -> Found {
    let Ok(path) = root.join(rel).canonicalize() else { return Found::Missing };
    if !path.starts_with(root) {
        return Found::Missing;
    }
    let Ok(meta) = std::fs::metadata(&path) else { return Found::Missing };
    if meta.is_dir() {
        return Found::Folder;
    }
    if !meta.is_file() || meta.len() > MAX_FILE_BYTES {
        return Found::Missing;
    }
    match std::fs::read(&path) {
        Ok(bytes) => Found::File(bytes, content_type(&path)),
        Err(_) => Found::Missing,
    }
}

fn content_type(path: &Path) -> &'static str {
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("").to_ascii_lowercase();
    match ext.as_str() {
        "html" | "htm" => "text/html; charset=utf-8",
        "js" | "mjs" => "text/javascript; charset=utf-8",
        "css" => "text/css; charset=utf-8",
        "json" | "map" => "application/json",
        "svg" => "image/svg+xml",
        "png" => "image/png",
        "ico" => "image/x-icon",
        "txt" | "ts" => "text/plain; charset=utf-8",
        "wasm" => "application/wasm",
        _ => "application/octet-stream",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_stay_inside_the_folder() {
        assert_eq!(relative_path("/"), Some(PathBuf::from("index.html")));
        assert_eq!(relative_path("/app.js"), Some(PathBuf::from("app.js")));
        assert_eq!(relative_path("/lib/index.js"), Some(PathBuf::from("lib/index.js")));
        assert_eq!(relative_path("/lib/"), Some(PathBuf::from("lib/index.html")));
        assert_eq!(relative_path("/a%20b.js"), Some(PathBuf::from("a b.js")));
        for bad in ["/../etc/passwd", "/lib/../../x", "/%2e%2e/x", "/.git/config", "//etc/passwd", "/a%5c..%5cb", "/a%00", "/%zz"] {
            assert_eq!(relative_path(bad), None, "{bad}");
        }
    }
}
