//! Shared by the `ws_*` integration tests: the real model loaded once per
//! test binary into a real engine, servers started in-process on
//! `127.0.0.1:0` (on a runtime of their own, so they outlive any one test),
//! greedy references computed with `tether::generate::greedy_tokens`, and a
//! small WebSocket client on tokio-tungstenite.
#![allow(dead_code)]
use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use protocol::{Delta, Done, ErrorCode, ErrorFrame, ServerMessage, SessionReady};
use serde_json::{json, Value};
use tether::engine::{EngineConfig, EngineHandle, EngineStats};
use tether::loaded::LoadedModel;
use tether::models::LoadOptions;
use tether::server::{ServerConfig, ServerHandle, ServerState};
use tether::tokenizer::TextTokenizer;
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

pub const MODEL: &str = "smollm2-135m";

/// How long a test waits for any one frame.
pub const FRAME_TIMEOUT: Duration = Duration::from_secs(120);

pub struct Harness {
    pub runtime: tokio::runtime::Runtime,
    pub engine: EngineHandle,
    pub tokenizer: Arc<TextTokenizer>,
    /// (prompt, n) → greedy token ids from a plain single-sequence loop.
    reference: HashMap<(String, usize), Vec<u32>>,
}

fn load_options() -> LoadOptions {
    let device = if mlx::gpu_available() { mlx::Device::Gpu } else { mlx::Device::Cpu };
    mlx::set_default_device(device).unwrap();
    LoadOptions::for_device(device)
}

fn model_path(name: &str) -> std::path::PathBuf {
    tether::registry::resolve(name).unwrap_or_else(|e| panic!("{e} (scripts/test.sh fetches the test models)"))
}

/// Loads `model` once per test binary (a binary may load several models;
/// each gets its own engine). The greedy references for
/// `reference_prompts` are computed first, on this thread, with the same
/// weights and the plain `greedy_tokens` loop; then the engine starts.
/// The first call for a model decides its references.
pub fn harness_for(model: &'static str, reference_prompts: &[(&str, usize)]) -> &'static Harness {
    static LOADED: Mutex<Vec<(&'static str, &'static Harness)>> = Mutex::new(Vec::new());
    // Held while a model loads, so two tests never load the same one twice;
    // a test that panicked while loading leaves the list as it was.
    let mut loaded = LOADED.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some(&(_, harness)) = loaded.iter().find(|(m, _)| *m == model) {
        return harness;
    }
    let harness: &'static Harness = Box::leak(Box::new(load_harness(model, reference_prompts)));
    loaded.push((model, harness));
    harness
}

fn load_harness(model: &'static str, reference_prompts: &[(&str, usize)]) -> Harness {
    let opts = load_options();
    let mut reference = HashMap::new();
    {
        let m = tether::loaded::ModelWithTokenizer::load(model, opts).unwrap();
        for &(prompt, n) in reference_prompts {
            let ids = m.encode_prompt(prompt).unwrap();
            let out = tether::generate::greedy_tokens(&m.transformer, &ids, n).unwrap();
            reference.insert((prompt.to_string(), n), out);
        }
    }
    let engine = EngineHandle::start(EngineConfig::default(), move || {
        let opts = load_options();
        Ok(LoadedModel::load(model, opts)?)
    })
    .unwrap();
    let path = model_path(model);
    let tokenizer = Arc::new(TextTokenizer::from_gguf_path(&path).unwrap());
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    Harness { runtime, engine, tokenizer, reference }
}

impl Harness {
    /// The greedy continuation of `prompt` (registered at load), cut at the
    /// first end-of-generation token, as token ids and as text.
    pub fn greedy(&self, prompt: &str, n: usize) -> (Vec<u32>, String) {
        let ids = self.reference.get(&(prompt.to_string(), n)).unwrap_or_else(|| panic!("no reference for {prompt:?} / {n}"));
        let end = ids.iter().position(|id| self.tokenizer.is_eos(*id)).unwrap_or(ids.len());
        let ids = ids[..end].to_vec();
        let text = self.tokenizer.decode(&ids, true);
        (ids, text)
    }

    /// Starts a server with `config` (port 0) on the harness runtime.
    pub async fn start(&self, config: ServerConfig) -> TestServer {
        self.start_with_engines(config, self.engine.clone().into()).await
    }

    /// Like [`start`](Self::start) with several engine workers.
    pub async fn start_with_engines(&self, mut config: ServerConfig, engines: tether::engine::EnginePool) -> TestServer {
        config.host = "127.0.0.1".into();
        config.port = 0;
        let tok = self.tokenizer.clone();
        let handle = self.runtime.spawn(async move { tether::server::serve(config, engines, tok).await }).await.unwrap().unwrap();
        TestServer { addr: handle.addr(), state: handle.state().clone(), handle: Mutex::new(Some(handle)) }
    }

    /// Another engine worker with the same model.
    pub fn second_engine(&self, model: &'static str) -> EngineHandle {
        EngineHandle::start(EngineConfig::default(), move || Ok(LoadedModel::load(model, load_options())?)).unwrap()
    }

    pub async fn stats(&self) -> EngineStats {
        self.engine.stats().await.expect("engine is running")
    }

    /// Waits until the engine has nothing running or waiting.
    pub async fn wait_idle(&self) -> EngineStats {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            let s = self.stats().await;
            if s.running == 0 && s.waiting == 0 {
                return s;
            }
            assert!(tokio::time::Instant::now() < deadline, "engine still busy: {s:?}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

pub struct TestServer {
    pub addr: SocketAddr,
    pub state: Arc<ServerState>,
    handle: Mutex<Option<ServerHandle>>,
}

impl TestServer {
    pub fn url(&self, path: &str) -> String {
        format!("ws://{}{}", self.addr, path)
    }

    pub async fn client(&self) -> Client {
        Client::connect(&self.url("/v1/ws")).await
    }

    /// Starts a graceful shutdown on the harness runtime; await the handle for its end.
    pub fn begin_shutdown(&self, h: &Harness) -> tokio::task::JoinHandle<()> {
        let handle = self.handle.lock().unwrap().take().expect("not shut down yet");
        h.runtime.spawn(handle.shutdown())
    }

    /// Plain HTTP GET; returns (status, body).
    pub async fn http_get(&self, path: &str) -> (u16, String) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut s = TcpStream::connect(self.addr).await.unwrap();
        let req = format!("GET {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\r\n", self.addr);
        s.write_all(req.as_bytes()).await.unwrap();
        let mut buf = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut buf)).await.unwrap().unwrap();
        let text = String::from_utf8_lossy(&buf).to_string();
        let status: u16 = text.split_whitespace().nth(1).unwrap().parse().unwrap();
        let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
        (status, body)
    }
}

pub type Ws = WebSocketStream<MaybeTlsStream<TcpStream>>;

/// How a request ended.
#[derive(Debug)]
pub enum End {
    Done(Done),
    Error(ErrorFrame),
}

#[derive(Debug)]
pub struct Outcome {
    pub deltas: Vec<Delta>,
    pub end: End,
}

impl Outcome {
    pub fn text(&self) -> String {
        self.deltas.iter().map(|d| d.text.as_str()).collect()
    }

    pub fn token_ids(&self) -> Vec<u32> {
        self.deltas.iter().flat_map(|d| d.token_ids.iter().copied()).collect()
    }

    pub fn done(&self) -> &Done {
        match &self.end {
            End::Done(d) => d,
            End::Error(e) => panic!("request ended with an error: {e:?}"),
        }
    }

    pub fn error(&self) -> &ErrorFrame {
        match &self.end {
            End::Error(e) => e,
            End::Done(d) => panic!("request ended with done, not an error: {d:?}"),
        }
    }

    /// Seqs 1..=n then done at n + 1.
    pub fn assert_contiguous(&self) {
        for (i, d) in self.deltas.iter().enumerate() {
            assert_eq!(d.seq, i as u64 + 1, "delta seqs must be contiguous from 1: {:?}", self.deltas.iter().map(|d| d.seq).collect::<Vec<_>>());
        }
        if let End::Done(d) = &self.end {
            assert_eq!(d.seq, self.deltas.len() as u64 + 1, "done takes the next seq");
        }
    }
}

pub struct Client {
    pub ws: Ws,
    /// Frames read while looking for something else.
    stash: VecDeque<ServerMessage>,
}

impl Client {
    pub async fn connect(url: &str) -> Client {
        let (ws, _) = tokio_tungstenite::connect_async(url).await.unwrap_or_else(|e| panic!("connecting to {url}: {e}"));
        Client { ws, stash: VecDeque::new() }
    }

    /// Connects with extra headers; the HTTP status on refusal.
    pub async fn connect_with(url: &str, headers: &[(&str, &str)]) -> Result<(Client, Option<String>), (u16, String)> {
        let mut req = url.into_client_request().unwrap();
        for (k, v) in headers {
            req.headers_mut().insert(tokio_tungstenite::tungstenite::http::HeaderName::from_bytes(k.as_bytes()).unwrap(), v.parse().unwrap());
        }
        match tokio_tungstenite::connect_async(req).await {
            Ok((ws, resp)) => {
                let proto = resp.headers().get("sec-websocket-protocol").map(|v| v.to_str().unwrap().to_string());
                Ok((Client { ws, stash: VecDeque::new() }, proto))
            }
            Err(tokio_tungstenite::tungstenite::Error::Http(resp)) => {
                let body = resp.body().as_ref().map(|b| String::from_utf8_lossy(b).to_string()).unwrap_or_default();
                Err((resp.status().as_u16(), body))
            }
            Err(e) => panic!("connect failed: {e}"),
        }
    }

    pub async fn send_text(&mut self, text: &str) {
        self.ws.send(Message::text(text)).await.unwrap();
    }

    pub async fn send(&mut self, v: &Value) {
        self.send_text(&v.to_string()).await;
    }

    pub async fn send_raw(&mut self, m: Message) {
        self.ws.send(m).await.unwrap();
    }

    /// The next WebSocket message (text, close...), `None` at the end of the stream.
    pub async fn next_raw(&mut self) -> Option<Message> {
        match tokio::time::timeout(FRAME_TIMEOUT, self.ws.next()).await {
            Ok(Some(Ok(m))) => Some(m),
            Ok(Some(Err(_))) | Ok(None) => None,
            Err(_) => panic!("no frame from the server for {FRAME_TIMEOUT:?}"),
        }
    }

    /// The next protocol frame (stashed ones first). Panics on close.
    pub async fn recv(&mut self) -> ServerMessage {
        if let Some(m) = self.stash.pop_front() {
            return m;
        }
        self.recv_socket().await
    }

    async fn recv_socket(&mut self) -> ServerMessage {
        loop {
            match self.next_raw().await {
                Some(Message::Text(t)) => return ServerMessage::from_json(t.as_str()).unwrap_or_else(|e| panic!("server sent an invalid frame {t}: {e}")),
                Some(Message::Close(c)) => panic!("connection closed while waiting for a frame: {c:?}"),
                Some(Message::Binary(_)) => panic!("server sent a binary frame"),
                Some(_) => continue,
                None => panic!("connection ended while waiting for a frame"),
            }
        }
    }

    /// The next frame that `want` accepts; others are stashed in order.
    pub async fn recv_matching(&mut self, mut want: impl FnMut(&ServerMessage) -> bool) -> ServerMessage {
        if let Some(pos) = self.stash.iter().position(&mut want) {
            return self.stash.remove(pos).unwrap();
        }
        loop {
            let m = self.recv_socket().await;
            if want(&m) {
                return m;
            }
            self.stash.push_back(m);
        }
    }

    /// The next connection-level error frame (no request id).
    pub async fn expect_error(&mut self) -> ErrorFrame {
        match self.recv().await {
            ServerMessage::Error(e) => e,
            other => panic!("expected an error frame, got {other:?}"),
        }
    }

    pub async fn open(&mut self) -> SessionReady {
        self.send(&json!({"type": "session.open"})).await;
        match self.recv().await {
            ServerMessage::SessionReady(r) => r,
            other => panic!("expected session.ready, got {other:?}"),
        }
    }

    pub async fn resume(&mut self, session_id: &str, token: &str, last_seq: Value) -> SessionReady {
        self.send(&json!({"type": "session.open", "session_id": session_id, "resume_token": token, "last_seq": last_seq})).await;
        match self.recv().await {
            ServerMessage::SessionReady(r) => r,
            other => panic!("expected session.ready, got {other:?}"),
        }
    }

    /// Sends a `generate` with `request_id` and the fields of `extra`.
    pub async fn generate(&mut self, request_id: &str, extra: Value) {
        let mut v = json!({"type": "generate", "request_id": request_id});
        v.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        self.send(&v).await;
    }

    /// Reads `request_id`'s frames until its done or error; other frames are stashed.
    pub async fn collect(&mut self, request_id: &str) -> Outcome {
        let mut deltas = Vec::new();
        loop {
            let m = self.recv_matching(|m| m.request_id() == Some(request_id)).await;
            match m {
                ServerMessage::Delta(d) => deltas.push(d),
                ServerMessage::Done(d) => return Outcome { deltas, end: End::Done(d) },
                ServerMessage::Error(e) => return Outcome { deltas, end: End::Error(e) },
                other => panic!("unexpected frame {other:?}"),
            }
        }
    }

    /// Reads deltas of `request_id` until `n` have arrived.
    pub async fn deltas(&mut self, request_id: &str, n: usize) -> Vec<Delta> {
        let mut out = Vec::new();
        while out.len() < n {
            match self.recv_matching(|m| m.request_id() == Some(request_id)).await {
                ServerMessage::Delta(d) => out.push(d),
                other => panic!("expected a delta of {request_id}, got {other:?}"),
            }
        }
        out
    }

    /// Waits for the server's close frame (skipping other frames); returns it.
    pub async fn expect_close(&mut self) -> Option<CloseFrame> {
        loop {
            match self.next_raw().await {
                Some(Message::Close(c)) => return c,
                Some(_) => continue,
                None => return None,
            }
        }
    }

    /// Drops the TCP connection without a closing handshake.
    pub fn drop_connection(self) {
        drop(self.ws);
    }
}

pub fn code_of(e: &ErrorFrame) -> ErrorCode {
    e.code
}
