//! The layering of the code, checked from its `use` lines and paths: data
//! flows edges -> sessions -> engine handle -> engine -> sched / cache /
//! models -> mlx, and nothing imports against that flow. The compiler
//! enforces the crate boundaries (`tether-sched` has no MLX and no tokio in
//! its Cargo.toml); this test enforces the module boundaries inside the
//! server crate, which the compiler does not, and keeps the sched crate's
//! dependencies as they are. A failure names the file and the import.
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// What each top-level module of the server library may import from the
/// others (`crate::<module>`), top of the flow first. A module missing from
/// this table fails the test: a new module must say where it stands.
const MAY_IMPORT: &[(&str, &[&str])] = &[
    // The edges and sessions: HTTP, WebSocket, the OpenAI and llama.cpp wires.
    ("server", &["engine", "grammar", "tools", "tokenizer", "stop", "sample"]),
    // Text to grammars and tool calls, token ids only from there on.
    ("grammar", &["tools", "tokenizer"]),
    ("tools", &["tokenizer"]),
    // One thread owns MLX: it speaks token ids, never text.
    ("engine", &["models", "sample", "loaded"]),
    ("generate", &["models", "sample"]),
    ("loaded", &["models", "registry", "tokenizer"]),
    ("sample", &[]),
    ("models", &[]),
    ("tokenizer", &[]),
    ("stop", &[]),
    ("registry", &[]),
];

/// The modules that may touch MLX (`mlx::`) or tokio. The edges never hold
/// an array; the model code never awaits.
const MAY_USE_MLX: &[&str] = &["engine", "models", "sample", "generate"];
const MAY_USE_TOKIO: &[&str] = &["server", "engine"];

/// The only dependencies of the scheduler crate.
const SCHED_DEPENDENCIES: &[&str] = &["thiserror"];

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("server/ sits in the workspace").to_path_buf()
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("reading {}: {e}", dir.display())) {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// A file's code without its comments (line comments and doc comments,
/// where the flow is often described in words that would match).
fn code_of(path: &Path) -> String {
    without_comments(&std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display())))
}

fn without_comments(text: &str) -> String {
    text.lines().map(|l| l.split("//").next().unwrap_or("")).collect::<Vec<_>>().join("\n")
}

/// Every `word::` path root in `code` (`crate::engine::x` gives `crate`, then
/// the module after it is read by the caller).
fn paths_after<'a>(code: &'a str, root: &str) -> BTreeSet<&'a str> {
    let mut found = BTreeSet::new();
    let needle = format!("{root}::");
    let mut rest = code;
    while let Some(at) = rest.find(&needle) {
        let before = rest[..at].chars().next_back();
        let after = &rest[at + needle.len()..];
        if !before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            let end = after.find(|c: char| !(c.is_alphanumeric() || c == '_')).unwrap_or(after.len());
            if end > 0 {
                found.insert(&after[..end]);
            }
        }
        rest = after;
    }
    found
}

/// Whether `code` names crate `name` as a path root (`name::...`, `use name;`).
fn mentions_crate(code: &str, name: &str) -> bool {
    !paths_after(code, name).is_empty() || code.contains(&format!("use {name};"))
}

#[test]
fn server_modules_import_only_along_the_flow() {
    let src = workspace().join("server/src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut violations = Vec::new();
    for file in &files {
        let relative = file.strip_prefix(&src).expect("under src");
        let first = relative.components().next().expect("a path").as_os_str().to_string_lossy().into_owned();
        let module = first.trim_end_matches(".rs").to_string();
        // The binary's root and commands may use the whole library.
        if module == "main" || module == "lib" || module == "cli" {
            continue;
        }
        let Some((_, allowed)) = MAY_IMPORT.iter().find(|(m, _)| *m == module) else {
            violations.push(format!("{}: module `{module}` is not in MAY_IMPORT: say where it stands in the flow", relative.display()));
            continue;
        };
        let code = code_of(file);
        for imported in paths_after(&code, "crate") {
            if imported != module && !allowed.contains(&imported) {
                violations.push(format!("{}: `{module}` imports `crate::{imported}`, against the flow", relative.display()));
            }
        }
        if !MAY_USE_MLX.contains(&module.as_str()) && mentions_crate(&code, "mlx") {
            violations.push(format!("{}: `{module}` uses MLX; only {MAY_USE_MLX:?} may", relative.display()));
        }
        if !MAY_USE_TOKIO.contains(&module.as_str()) && mentions_crate(&code, "tokio") {
            violations.push(format!("{}: `{module}` uses tokio; only {MAY_USE_TOKIO:?} may", relative.display()));
        }
    }
    assert!(violations.is_empty(), "imports against the flow:\n{}", violations.join("\n"));
}

#[test]
fn the_scheduler_crate_depends_on_neither_mlx_nor_tokio() {
    let sched = workspace().join("sched");
    let manifest = std::fs::read_to_string(sched.join("Cargo.toml")).expect("sched/Cargo.toml");
    let mut section = "";
    let mut dependencies = Vec::new();
    for line in manifest.lines().map(str::trim) {
        if line.starts_with('[') {
            section = line;
        } else if section == "[dependencies]" && !line.is_empty() && !line.starts_with('#') {
            dependencies.push(line.split(['=', ' ', '.']).next().unwrap_or("").to_string());
        }
    }
    assert_eq!(dependencies, SCHED_DEPENDENCIES, "the scheduler stays pure: its dependencies are {SCHED_DEPENDENCIES:?}");
    let mut files = Vec::new();
    rust_files(&sched.join("src"), &mut files);
    for file in files {
        let code = code_of(&file);
        for forbidden in ["mlx", "tokio", "tether", "tether_mlx"] {
            assert!(!mentions_crate(&code, forbidden), "{} names `{forbidden}`: the scheduler sees no tensors and no runtime", file.display());
        }
    }
}

#[test]
fn the_checker_sees_a_backward_import() {
    // The test above must be able to fail: a model file importing the engine
    // is seen, and a mention inside a comment is not.
    let code = "use crate::engine::Row;\n";
    assert_eq!(paths_after(code, "crate").into_iter().collect::<Vec<_>>(), vec!["engine"]);
    assert!(paths_after(&without_comments("// see crate::server::ws\nlet x = 1;"), "crate").is_empty());
    assert!(mentions_crate("let a = mlx::Array::zeros();", "mlx") && !mentions_crate("let a = tether_mlx_like::x();", "mlx"));
}
