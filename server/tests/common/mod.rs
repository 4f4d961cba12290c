//! Helpers shared by the integration tests: where the real models and the
//! reference fixtures live.
#![allow(dead_code)]
use std::path::PathBuf;

/// A fetched model's path. Tests need the real models; `scripts/test.sh`
/// fetches them first, so a missing file is a setup error, not a skip.
pub fn model_path(name: &str) -> PathBuf {
    match tether::registry::resolve(name) {
        Ok(p) => p,
        Err(e) => panic!("{e} (scripts/test.sh fetches the test models)"),
    }
}

pub fn fixtures_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures")
}

pub fn read_json(rel: &str) -> serde_json::Value {
    let path = fixtures_dir().join(rel);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap()
}

pub fn read_f32(rel: &str) -> Vec<f32> {
    let bytes = std::fs::read(fixtures_dir().join(rel)).unwrap();
    bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()
}

pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

/// ||a - b|| / ||b||
/// `n` greedy tokens of `prompt` from the pipelined decode loop
/// (`tether::generate::generate`), reading the prompt in chunks of `chunk`.
pub fn pipelined_greedy(model: &tether::models::Transformer, prompt: &[u32], n: usize, chunk: usize) -> Vec<u32> {
    let opts = tether::generate::GenerateOptions { max_tokens: n, sampling: tether::sample::SamplingParams::default(), stop_ids: vec![], prefill_chunk: chunk };
    let mut streamed = Vec::new();
    tether::generate::generate(model, prompt, &opts, |id| {
        streamed.push(id);
        std::ops::ControlFlow::Continue(())
    })
    .unwrap();
    streamed
}

pub fn relative_error(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den).sqrt()
}

/// An engine thread serving SmolLM2 on the CPU with `config`.
pub fn start_smollm2_engine(config: tether::engine::EngineConfig) -> tether::engine::EngineHandle {
    start_engine("smollm2-135m", config)
}

/// An engine thread serving the known model `name` on the CPU with `config`.
pub fn start_engine(name: &'static str, config: tether::engine::EngineConfig) -> tether::engine::EngineHandle {
    let path = model_path(name);
    tether::engine::EngineHandle::start(config, move || {
        mlx::set_default_device(mlx::Device::Cpu)?;
        let opts = tether::models::LoadOptions::for_device(mlx::Device::Cpu);
        Ok(tether::loaded::LoadedModel::load_path(name, &path, opts)?)
    })
    .unwrap()
}

/// Where bench/peer/setup.sh puts HF conversions of the test models
/// (`$TETHER_PEER_MODELS`, `$TETHER_CACHE/peer/models`, `~/.cache/tether/peer/models`).
pub fn peer_models_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("TETHER_PEER_MODELS") {
        return PathBuf::from(d);
    }
    let cache = match std::env::var_os("TETHER_CACHE") {
        Some(c) => PathBuf::from(c),
        None => PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/tether"),
    };
    cache.join("peer/models")
}

/// A converted folder; missing means the peer setup has not run.
pub fn peer_dir(name: &str) -> PathBuf {
    let dir = peer_models_dir().join(name);
    for file in ["config.json", "tokenizer.json"] {
        assert!(
            dir.join(file).is_file(),
            "{} not found: run bench/peer/setup.sh (it converts the test models into HF folders; \
             set TETHER_PEER_MODELS to use another folder)",
            dir.join(file).display()
        );
    }
    dir
}

/// Submits `req` and waits for its tokens and final report.
pub async fn run_request(engine: &tether::engine::EngineHandle, req: tether::engine::SubmitRequest) -> (Vec<u32>, tether::engine::FinishInfo) {
    use tether::engine::EngineEvent;
    let mut rx = engine.submit(req).unwrap().events;
    let mut ids = Vec::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            EngineEvent::Tokens { ids: t, .. } => ids.extend(t),
            EngineEvent::Finished(f) => return (ids, f),
            EngineEvent::Failed(e) => panic!("request failed: {e}"),
            EngineEvent::Started { .. } => {}
        }
    }
    panic!("the engine dropped the request without a final event");
}

/// `n` greedy tokens from `logits` (the last position's) on, each fed back
/// through `cache`.
pub fn greedy_from(model: &tether::models::Transformer, cache: &mut tether::models::KvCache, mut logits: mlx::Array, n: usize) -> Vec<u32> {
    let mut out = Vec::new();
    for _ in 0..n {
        let next = logits.argmax(-1, false).unwrap().to_vec_i32().unwrap()[0] as u32;
        out.push(next);
        logits = model.forward(&[next], cache, 1).unwrap();
    }
    out
}

/// The model a reference script in `tests/reference` writes from a seed,
/// and its oracle's expectations: `script.py write MODEL --seed 1` then
/// `script.py expect MODEL expect.json`, run once per test binary by the
/// caller (hold the result in a `OnceLock`). Kept in the temporary folder
/// under a name of the script's contents, so later runs reuse it and a
/// changed script writes a new one; written under a name of this
/// process's and renamed, so concurrent runs never read a half-written file.
pub fn generated_reference(script: &str, model_file: &str) -> (PathBuf, serde_json::Value) {
    use std::path::Path;
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/reference").join(script);
    // The script and the module it shares with the other oracles name the cache.
    let mut source = std::fs::read(&script).unwrap();
    source.extend(std::fs::read(script.with_file_name("oracle_common.py")).unwrap());
    let digest = source.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3));
    let stem = model_file.trim_end_matches(".gguf");
    let dir = std::env::temp_dir().join(format!("tether-{stem}-seed1-{digest:016x}"));
    if !dir.join("expect.json").is_file() {
        let scratch = std::env::temp_dir().join(format!("tether-{stem}-{}", std::process::id()));
        std::fs::create_dir_all(&scratch).unwrap();
        let venv = std::env::var_os("TETHER_REFENV")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/tether/refenv"));
        let python = venv.join("bin/python");
        let run = |args: &[&Path]| {
            let status = std::process::Command::new(&python).arg(&script).args(args).status();
            let ok = status.as_ref().is_ok_and(|s| s.success());
            assert!(ok, "{} {} {args:?}: {status:?} (tests/reference/setup.sh makes the venv)", python.display(), script.display());
        };
        let model = scratch.join(model_file);
        run(&[Path::new("write"), &model, Path::new("--seed"), Path::new("1")]);
        run(&[Path::new("expect"), &model, &scratch.join("expect.json")]);
        // Another run may have got there first: then its copy serves.
        if std::fs::rename(&scratch, &dir).is_err() {
            std::fs::remove_dir_all(&scratch).unwrap();
        }
    }
    let expect = serde_json::from_str(&std::fs::read_to_string(dir.join("expect.json")).unwrap()).unwrap();
    (dir.join(model_file), expect)
}

/// A reference's JSON numbers as float32.
pub fn floats(v: &serde_json::Value) -> Vec<f32> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect()
}

/// The largest absolute difference of two equally long rows.
pub fn max_abs(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// One forward of `model` over a generated reference's prompt (see
/// [`generated_reference`]) against its expectations: the largest error
/// over the first positions' logits and the last's, and the last row it
/// expects.
pub fn whole_prompt_logits_error(model: &tether::models::Transformer, expect: &serde_json::Value) -> (f32, Vec<f32>) {
    let prompt = ids(&expect["prompt_ids"]);
    let mut cache = model.new_cache();
    let logits = model.forward(&prompt, &mut cache, prompt.len()).unwrap();
    let vocab = logits.dim(-1);
    let all: Vec<Vec<f32>> = logits.to_vec_f32().unwrap().chunks(vocab).map(<[f32]>::to_vec).collect();
    let mut worst = 0.0f32;
    for (i, want) in expect["logits_first"].as_array().unwrap().iter().enumerate() {
        worst = worst.max(max_abs(&all[i], &floats(want)));
    }
    let last = floats(&expect["logits_last"]);
    (worst.max(max_abs(all.last().unwrap(), &last)), last)
}

/// `n` greedy tokens of each of `prompts`, read and decoded as rows of the
/// same forwards (each with its own cache).
pub fn greedy_rows_together(model: &tether::models::Transformer, prompts: &[Vec<u32>], n: usize) -> Vec<Vec<u32>> {
    let mut caches: Vec<tether::models::KvCache> = prompts.iter().map(|_| model.new_cache()).collect();
    let mut feed: Vec<Vec<u32>> = prompts.to_vec();
    let mut together: Vec<Vec<u32>> = vec![Vec::new(); prompts.len()];
    for _ in 0..n {
        let mut rows: Vec<tether::models::RowInput<'_>> = feed
            .iter()
            .zip(caches.iter_mut())
            .map(|(ids, cache)| {
                let ids: Vec<i32> = ids.iter().map(|&t| t as i32).collect();
                tether::models::RowInput { ids: mlx::Array::from_i32(&ids, &[1, ids.len()]).unwrap(), cache, n_logits: 1 }
            })
            .collect();
        let logits = model.forward_batch(&mut rows).unwrap();
        for (r, l) in logits.iter().enumerate() {
            let next = l.argmax(-1, false).unwrap().to_vec_i32().unwrap()[0] as u32;
            together[r].push(next);
            feed[r] = vec![next];
        }
    }
    together
}

/// One chat completion over HTTP/1.0 (a close-delimited body) to `model`
/// as the tenant of `bearer`: the reply's text and its cached prompt tokens.
pub async fn chat(addr: std::net::SocketAddr, model: &str, bearer: &str, messages: serde_json::Value, max_tokens: u32) -> (String, u64) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let body = serde_json::json!({"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}).to_string();
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.0\r\nHost: {addr}\r\nAuthorization: Bearer {bearer}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).await.unwrap();
    s.write_all(body.as_bytes()).await.unwrap();
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).await.unwrap();
    let text = String::from_utf8_lossy(&buf).to_string();
    let (_, body) = text.split_once("\r\n\r\n").unwrap();
    let v: serde_json::Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {text}"));
    let content = v["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    (content, v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0))
}

/// A server over `engine` with the GGUF's own tokenizer and chat template
/// (`path`): a chat's second turn (the tenant's own cache consulted)
/// resumes the first's state and gives what another tenant's fresh
/// request with the whole history gives.
pub async fn assert_a_chat_turn_equals_a_fresh_request(engine: tether::engine::EngineHandle, path: &std::path::Path, model: &str) {
    let tokenizer = std::sync::Arc::new(tether::tokenizer::TextTokenizer::from_gguf_path(path).unwrap());
    let config = tether::server::ServerConfig { host: "127.0.0.1".into(), port: 0, ..Default::default() };
    let server = tether::server::serve(config, engine, tokenizer).await.unwrap();
    let addr = server.addr();
    let first = serde_json::json!([{"role": "user", "content": "Write a haiku about the sea."}]);
    let (reply, _) = chat(addr, model, "alice", first.clone(), 8).await;
    let mut history = first.as_array().unwrap().clone();
    history.push(serde_json::json!({"role": "assistant", "content": reply}));
    history.push(serde_json::json!({"role": "user", "content": "And one about the sky."}));
    let (second, resumed) = chat(addr, model, "alice", serde_json::Value::Array(history.clone()), 12).await;
    assert!(resumed > 0, "the second turn resumes the first turn's state");
    let (fresh, cached) = chat(addr, model, "bob", serde_json::Value::Array(history), 12).await;
    assert_eq!(cached, 0, "another tenant shares nothing");
    assert_eq!(second, fresh, "a session's next turn must equal a fresh request");
}
