//! Sessions: they outlive their socket for a TTL, own their requests, and
//! keep every frame those requests produce in a bounded replay ring.
//!
//! The ring is the single path from requests to the client: a request's
//! forwarding task [`Session::push`]es its frames into it, and the writer of
//! the attached connection [`Session::pull`]s them out in order through a
//! cursor. That makes resume exact: on [`Session::resume`] the frames a client
//! missed are copied from the ring (those before the new cursor) and
//! everything after the cursor streams live, so nothing is lost or sent twice.
//!
//! Bounds: the ring holds at most `replay_frames` frames / `replay_bytes`
//! bytes. While a connection is attached, frames it has already been given are
//! evicted first; frames it has not been given yet make the producer wait
//! (backpressure reaches the engine, which pauses the row), and a client that
//! reads nothing for `stall_timeout` gets its socket closed. While no
//! connection is attached nothing is evicted: when the ring is full the
//! session's running requests are cancelled (freeing their KV cache) and a
//! later resume gets `replay_unavailable` for them.
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::pin::pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use dashmap::DashMap;
use protocol::{ErrorCode, ProtocolError, ServerMessage};
use subtle::ConstantTimeEq;
use tokio::sync::{watch, Notify};

use crate::engine::{EngineHandle, EnginePool, RequestId, Scope};
use crate::tokenizer::PieceEncoding;

/// Why the server closes a connection: an optional `error` frame, then a
/// close frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CloseReason {
    pub code: u16,
    pub reason: String,
    pub error: Option<(ErrorCode, String)>,
}

impl CloseReason {
    /// A fatal protocol error: the `error` frame, then its close code.
    pub fn fatal(code: ErrorCode, message: impl Into<String>) -> CloseReason {
        let message = message.into();
        CloseReason { code: code.close_code().unwrap_or(1011), reason: truncate_reason(&message), error: Some((code, message)) }
    }

    /// A normal closure without an error frame.
    pub fn normal(reason: &str) -> CloseReason {
        CloseReason { code: 1000, reason: reason.into(), error: None }
    }

    fn taken_over() -> CloseReason {
        CloseReason::normal("session resumed on another connection")
    }

    fn too_slow(after: Duration) -> CloseReason {
        CloseReason { code: 1008, reason: format!("client stopped reading for {} ms", after.as_millis()), error: None }
    }
}

/// Close reasons are limited to 123 bytes by the WebSocket spec.
fn truncate_reason(s: &str) -> String {
    let mut end = s.len().min(120);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_string()
}

/// The server's handle on one WebSocket connection, as sessions see it.
pub struct ConnCtl {
    pub id: u64,
    /// Signalled when the attached session has frames for this connection.
    pub wake: Notify,
    close: watch::Sender<Option<CloseReason>>,
}

impl ConnCtl {
    pub fn new(id: u64) -> Arc<ConnCtl> {
        Arc::new(ConnCtl { id, wake: Notify::new(), close: watch::Sender::new(None) })
    }

    /// Asks the connection to close (the first reason wins).
    pub fn close(&self, reason: CloseReason) {
        self.close.send_if_modified(|cur| {
            if cur.is_none() {
                *cur = Some(reason);
                true
            } else {
                false
            }
        });
    }

    pub fn closing(&self) -> watch::Receiver<Option<CloseReason>> {
        self.close.subscribe()
    }

    pub fn is_closing(&self) -> bool {
        self.close.borrow().is_some()
    }
}

/// Per-session bounds.
#[derive(Clone, Copy, Debug)]
pub struct SessionLimits {
    pub max_in_flight: usize,
    pub replay_frames: usize,
    pub replay_bytes: usize,
    pub stall_timeout: Duration,
}

/// One frame a request produced: a `delta` / `done` (with `seq`) or its
/// terminal `error` (no `seq`).
pub struct Frame {
    pub seq: Option<u64>,
    pub json: Arc<str>,
    /// The request's last frame: may exceed the ring's bound a little, so a
    /// request that finishes while its client is away keeps its ending.
    pub terminal: bool,
}

struct Entry {
    key: u64,
    request_id: Arc<str>,
    seq: Option<u64>,
    json: Arc<str>,
}

struct Req {
    key: u64,
    engine_id: Option<RequestId>,
    running: bool,
    /// `cancel` (or `session.close`) asked for it: it ends with `done` cancelled.
    client_cancelled: bool,
    /// The server cancelled it on its own (drain): it ends with error `cancelled`.
    server_cancelled: bool,
    /// Some of its frames could not be kept: no replay, nothing more is sent.
    lost: bool,
    /// Highest seq pushed.
    last_seq: u64,
    /// Highest seq evicted from the ring (0: none).
    evicted_upto: u64,
    terminal_evicted: bool,
    in_ring: usize,
}

struct Attachment {
    conn: Arc<ConnCtl>,
    /// Ring position (absolute) of the next frame to give this connection.
    cursor: u64,
}

struct Inner {
    token: String,
    closed: bool,
    attached: Option<Attachment>,
    detached_at: Option<Instant>,
    requests: HashMap<String, Req>,
    running: usize,
    next_key: u64,
    ring: VecDeque<Entry>,
    /// Absolute position of `ring[0]`.
    ring_base: u64,
    ring_bytes: usize,
}

enum TryPush {
    Pushed,
    Dropped,
    Wait,
    DetachedFull,
}

impl Inner {
    fn req(&mut self, key: u64, request_id: &str) -> Option<&mut Req> {
        self.requests.get_mut(request_id).filter(|r| r.key == key)
    }

    fn evict_front(&mut self) {
        let Some(e) = self.ring.pop_front() else { return };
        self.ring_base += 1;
        self.ring_bytes -= e.json.len();
        if let Some(r) = self.req(e.key, &e.request_id) {
            r.in_ring -= 1;
            match e.seq {
                Some(s) => r.evicted_upto = s,
                None => r.terminal_evicted = true,
            }
            if !r.running && r.in_ring == 0 {
                self.requests.remove(&*e.request_id);
            }
        }
    }

    fn try_push(&mut self, key: u64, request_id: &str, frame: &Frame, limits: &SessionLimits) -> TryPush {
        if self.closed {
            return TryPush::Dropped;
        }
        match self.req(key, request_id) {
            Some(r) if !r.lost => {}
            _ => return TryPush::Dropped,
        }
        let size = frame.json.len();
        loop {
            let fits = self.ring.len() < limits.replay_frames && self.ring_bytes + size <= limits.replay_bytes;
            let overflow_ok = frame.terminal && self.ring.len() < limits.replay_frames + limits.max_in_flight;
            if fits || overflow_ok || self.ring.is_empty() {
                break;
            }
            match &self.attached {
                Some(a) if self.ring_base < a.cursor => self.evict_front(),
                Some(_) => return TryPush::Wait,
                None => return TryPush::DetachedFull,
            }
        }
        let id: Arc<str> = Arc::from(request_id);
        let r = self.req(key, request_id).expect("checked above");
        r.in_ring += 1;
        if let Some(s) = frame.seq {
            r.last_seq = s;
        }
        self.ring_bytes += size;
        self.ring.push_back(Entry { key, request_id: id, seq: frame.seq, json: frame.json.clone() });
        if let Some(a) = &self.attached {
            a.conn.wake.notify_one();
        }
        TryPush::Pushed
    }

    /// Marks every running request lost and returns their engine ids to cancel.
    fn lose_running(&mut self) -> Vec<RequestId> {
        let mut ids = Vec::new();
        for r in self.requests.values_mut().filter(|r| r.running && !r.lost) {
            r.lost = true;
            ids.extend(r.engine_id);
        }
        ids
    }
}

/// What a successful resume hands to the connection.
pub struct Resumed {
    /// The new resume token.
    pub token: String,
    /// Frames to send right after `session.ready`: `replay_unavailable`
    /// errors, then the replayed frames in their original order.
    pub initial: Vec<Arc<str>>,
    pub replayed: usize,
    /// How many of the listed requests got `replay_unavailable`.
    pub unavailable: usize,
}

pub struct Session {
    pub id: String,
    inner: Mutex<Inner>,
    /// Producers waiting for ring space.
    space: Notify,
    engine: EngineHandle,
    limits: SessionLimits,
    /// The last prompt's encoding, in pieces: the next prompt, which usually
    /// extends it, re-encodes only its new part (`tokenizer/extend.rs`).
    last_prompt: Mutex<Option<Arc<PieceEncoding>>>,
}

impl Session {
    /// The encoding of this session's last prompt (see `last_prompt`).
    pub fn last_prompt(&self) -> Option<Arc<PieceEncoding>> {
        self.last_prompt.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub fn set_last_prompt(&self, encoding: PieceEncoding) {
        *self.last_prompt.lock().unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(encoding));
    }

    /// The engine worker this session is pinned to.
    pub fn engine(&self) -> &EngineHandle {
        &self.engine
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Tells the engine whether a socket holds this session, so its
    /// prefix-cache entries outrank (attached) or yield to (detached) others'.
    /// Called under the session lock, so the engine sees the transitions in
    /// the order they happened.
    fn tell_engine_live(&self, live: bool) {
        self.engine.set_scope_live(Scope::Session(self.id.clone()), live);
    }

    fn cancel_in_engine(&self, ids: Vec<RequestId>) {
        for id in ids {
            self.engine.cancel(id);
        }
    }

    /// Requests still running (generating or queued).
    pub fn running(&self) -> usize {
        self.lock().running
    }

    /// Checks the token and takes the session over for `conn`: the old
    /// connection (if any) is closed, missed frames of the requests in
    /// `last_seq` are collected for replay, and a new token is issued.
    pub fn resume(&self, conn: Arc<ConnCtl>, token: &str, last_seq: &BTreeMap<String, u64>) -> Result<Resumed, ProtocolError> {
        let mut to_cancel = Vec::new();
        let mut g = self.lock();
        if g.closed {
            return Err(ProtocolError::new(ErrorCode::SessionExpired, format!("session {} has expired or was closed", self.id)));
        }
        if !bool::from(g.token.as_bytes().ct_eq(token.as_bytes())) {
            return Err(ProtocolError::new(ErrorCode::InvalidResumeToken, "resume_token does not match the session"));
        }
        let was_detached = g.attached.is_none();
        if let Some(old) = g.attached.take() {
            old.conn.close(CloseReason::taken_over());
        }
        let mut initial: Vec<Arc<str>> = Vec::new();
        let mut replay: HashMap<&str, (u64, u64)> = HashMap::new();
        for (rid, &last) in last_seq {
            let problem = match g.requests.get_mut(rid.as_str()) {
                None => Some("the request is unknown (never started, or its frames were discarded)".to_string()),
                Some(r) if r.lost => Some("its frames were dropped: the session's replay buffer was full while disconnected".to_string()),
                Some(r) if last < r.evicted_upto || r.terminal_evicted => {
                    if r.running {
                        r.lost = true;
                        to_cancel.extend(r.engine_id);
                    }
                    Some(format!("frames after seq {last} are no longer buffered (the oldest kept is {})", r.evicted_upto + 1))
                }
                Some(r) if last > r.last_seq => {
                    if r.running {
                        r.lost = true;
                        to_cancel.extend(r.engine_id);
                    }
                    Some(format!("last_seq {last} is beyond the last frame sent ({})", r.last_seq))
                }
                Some(r) => {
                    replay.insert(rid.as_str(), (r.key, last));
                    None
                }
            };
            if let Some(why) = problem {
                let msg = ServerMessage::error(
                    ErrorCode::ReplayUnavailable,
                    format!("cannot replay request {rid}: {why}; resubmit it under a new request_id"),
                    Some(rid.clone()),
                );
                initial.push(Arc::from(msg.to_json()));
            }
        }
        let unavailable = initial.len();
        let mut replayed = 0;
        for e in &g.ring {
            if let Some(&(key, last)) = replay.get(&*e.request_id) {
                if e.key == key && !matches!(e.seq, Some(s) if s <= last) {
                    initial.push(e.json.clone());
                    replayed += 1;
                }
            }
        }
        drop(replay);
        let cursor = g.ring_base + g.ring.len() as u64;
        g.attached = Some(Attachment { conn, cursor });
        g.detached_at = None;
        if was_detached {
            self.tell_engine_live(true);
        }
        let token = new_secret("rt_");
        g.token = token.clone();
        drop(g);
        self.cancel_in_engine(to_cancel);
        self.space.notify_waiters();
        Ok(Resumed { token, initial, replayed, unavailable })
    }

    /// The connection is gone: the session waits for a resume (TTL).
    pub fn detach(&self, conn_id: u64) {
        let mut g = self.lock();
        if g.attached.as_ref().is_some_and(|a| a.conn.id == conn_id) {
            g.attached = None;
            g.detached_at = Some(Instant::now());
            self.tell_engine_live(false);
        }
        drop(g);
        self.space.notify_waiters();
    }

    /// Reserves `request_id` for a new request from connection `conn_id`.
    pub fn register(&self, conn_id: u64, request_id: &str) -> Result<u64, ProtocolError> {
        let mut g = self.lock();
        let err = |code, msg: String| Err(ProtocolError::new(code, msg).with_request_id(request_id));
        if g.closed || !matches!(&g.attached, Some(a) if a.conn.id == conn_id) {
            return err(ErrorCode::NoSession, "this connection no longer holds the session".into());
        }
        if let Some(r) = g.requests.get(request_id) {
            let what = if r.running { "in flight" } else { "kept for replay" };
            return err(ErrorCode::DuplicateRequest, format!("request_id {request_id:?} is already used in this session ({what})"));
        }
        if g.running >= self.limits.max_in_flight {
            return err(ErrorCode::TooManyRequests, format!("{} requests are already in flight; the limit is {}", g.running, self.limits.max_in_flight));
        }
        let key = g.next_key;
        g.next_key += 1;
        g.running += 1;
        g.requests.insert(
            request_id.to_string(),
            Req {
                key,
                engine_id: None,
                running: true,
                client_cancelled: false,
                server_cancelled: false,
                lost: false,
                last_seq: 0,
                evicted_upto: 0,
                terminal_evicted: false,
                in_ring: 0,
            },
        );
        Ok(key)
    }

    /// Records the engine id of a registered request. Returns false if the
    /// request was cancelled meanwhile (the caller cancels it in the engine).
    pub fn set_engine_id(&self, key: u64, request_id: &str, id: RequestId) -> bool {
        let mut g = self.lock();
        let closed = g.closed;
        match g.req(key, request_id) {
            Some(r) if !closed => {
                r.engine_id = Some(id);
                !(r.client_cancelled || r.server_cancelled || r.lost)
            }
            _ => false,
        }
    }

    /// Forgets a registered request that never reached the engine.
    pub fn unregister(&self, key: u64, request_id: &str) {
        let mut g = self.lock();
        if g.req(key, request_id).is_some() {
            let r = g.requests.remove(request_id).expect("present");
            if r.running {
                g.running -= 1;
            }
        }
    }

    /// `cancel`: marks the request cancelled by the client and stops it in
    /// the engine. `unknown_request` if it isn't running.
    pub fn cancel(&self, request_id: &str) -> Result<(), ProtocolError> {
        let mut g = self.lock();
        let id = match g.requests.get_mut(request_id) {
            Some(r) if r.running => {
                r.client_cancelled = true;
                r.engine_id
            }
            Some(_) => {
                return Err(ProtocolError::new(ErrorCode::UnknownRequest, format!("request {request_id:?} has already finished")).with_request_id(request_id))
            }
            None => return Err(ProtocolError::new(ErrorCode::UnknownRequest, format!("no request {request_id:?} in this session")).with_request_id(request_id)),
        };
        drop(g);
        self.cancel_in_engine(id.into_iter().collect());
        Ok(())
    }

    /// How a request the engine reported as cancelled should end: `Some(true)`
    /// for the client's cancel (`done`), `Some(false)` for the server's own
    /// (error `cancelled`), `None` if nobody here asked (e.g. the engine shut down).
    pub fn cancel_origin(&self, key: u64, request_id: &str) -> Option<bool> {
        let mut g = self.lock();
        let r = g.req(key, request_id)?;
        if r.client_cancelled {
            Some(true)
        } else if r.server_cancelled {
            Some(false)
        } else {
            None
        }
    }

    /// Adds a request's frame to the ring, waiting while the attached client
    /// has not yet been given the oldest frames. Returns false when the frame
    /// was dropped (session closed, request lost or forgotten): the caller
    /// stops the request.
    pub async fn push(&self, key: u64, request_id: &str, frame: Frame) -> bool {
        let mut deadline = None;
        loop {
            let mut notified = pin!(self.space.notified());
            notified.as_mut().enable();
            {
                let mut g = self.lock();
                match g.try_push(key, request_id, &frame, &self.limits) {
                    TryPush::Pushed => return true,
                    TryPush::Dropped => return false,
                    TryPush::DetachedFull => {
                        let ids = g.lose_running();
                        drop(g);
                        self.cancel_in_engine(ids);
                        return false;
                    }
                    TryPush::Wait => {}
                }
            }
            let dl = *deadline.get_or_insert_with(|| tokio::time::Instant::now() + self.limits.stall_timeout);
            if tokio::time::timeout_at(dl, notified).await.is_err() {
                // The attached client has not read a frame for the whole
                // stall timeout: drop its socket and treat the session as
                // disconnected (the next try applies the detached bound).
                let mut g = self.lock();
                if let Some(a) = g.attached.take() {
                    a.conn.close(CloseReason::too_slow(self.limits.stall_timeout));
                    g.detached_at = Some(Instant::now());
                    self.tell_engine_live(false);
                }
            }
        }
    }

    /// The request's last frame was pushed (or it was dropped).
    pub fn finish(&self, key: u64, request_id: &str) {
        let mut g = self.lock();
        let Some(r) = g.req(key, request_id) else { return };
        if !r.running {
            return;
        }
        r.running = false;
        let remove = r.in_ring == 0 || r.lost;
        g.running -= 1;
        if remove {
            g.requests.remove(request_id);
        }
    }

    /// The next frames for connection `conn_id` (at most `max`), or `None` if
    /// it no longer holds the session.
    pub fn pull(&self, conn_id: u64, max: usize) -> Option<Vec<Arc<str>>> {
        let mut g = self.lock();
        let inner = &mut *g;
        let a = inner.attached.as_mut().filter(|a| a.conn.id == conn_id)?;
        let start = a.cursor.saturating_sub(inner.ring_base) as usize;
        let out: Vec<Arc<str>> = inner.ring.iter().skip(start).take(max).map(|e| e.json.clone()).collect();
        a.cursor = inner.ring_base + (start + out.len()) as u64;
        drop(g);
        if !out.is_empty() {
            self.space.notify_waiters();
        }
        Some(out)
    }

    /// Ends the session for good: cancels its requests (freeing their KV
    /// state), drops its frames. Returns how many requests were cancelled.
    pub fn close(&self) -> usize {
        let mut g = self.lock();
        g.closed = true;
        let mut ids = Vec::new();
        for r in g.requests.values_mut().filter(|r| r.running) {
            r.client_cancelled = true;
            ids.extend(r.engine_id);
        }
        g.ring.clear();
        g.ring_bytes = 0;
        g.attached = None;
        drop(g);
        let n = ids.len();
        self.cancel_in_engine(ids);
        self.space.notify_waiters();
        n
    }

    /// Cancels every running request on the server's behalf (drain timeout):
    /// they end with error `cancelled`.
    pub fn server_cancel_all(&self) {
        let mut g = self.lock();
        let mut ids = Vec::new();
        for r in g.requests.values_mut().filter(|r| r.running) {
            if !r.client_cancelled {
                r.server_cancelled = true;
            }
            ids.extend(r.engine_id);
        }
        drop(g);
        self.cancel_in_engine(ids);
    }

    /// Closes the session if it has been detached for `ttl`.
    fn expire_if_due(&self, now: Instant, ttl: Duration) -> bool {
        let due = {
            let g = self.lock();
            !g.closed && g.attached.is_none() && g.detached_at.is_some_and(|t| now.duration_since(t) >= ttl)
        };
        if due {
            self.close();
        }
        due
    }
}

/// Why `session.open` with a `session_id` found no session to resume.
pub enum LookupError {
    NotFound,
    Expired,
}

/// All sessions of the server.
pub struct SessionRegistry {
    map: DashMap<String, Arc<Session>>,
    /// Ids of sessions that expired or were closed recently, for `session_expired`.
    tombstones: Mutex<HashMap<String, Instant>>,
    count: AtomicUsize,
    max: usize,
    ttl: Duration,
    limits: SessionLimits,
    /// Told each session id the registry forgets (closed or expired), so the
    /// engine can free that session's prefix-cache entries.
    on_forget: Box<dyn Fn(&str) + Send + Sync>,
}

const MAX_TOMBSTONES: usize = 65_536;

impl SessionRegistry {
    /// Calls `on_forget` with each session id it closes or expires.
    pub fn with_on_forget(mut self, on_forget: impl Fn(&str) + Send + Sync + 'static) -> SessionRegistry {
        self.on_forget = Box::new(on_forget);
        self
    }

    pub fn new(max: usize, ttl: Duration, limits: SessionLimits) -> SessionRegistry {
        SessionRegistry {
            map: DashMap::new(),
            tombstones: Mutex::new(HashMap::new()),
            count: AtomicUsize::new(0),
            max,
            ttl,
            limits,
            on_forget: Box::new(|_| {}),
        }
    }

    pub fn len(&self) -> usize {
        self.count.load(Ordering::Relaxed)
    }

    /// A new session attached to `conn`, or `None` at the session limit.
    /// A new session, pinned to its engine worker for its whole life.
    pub fn create(&self, conn: Arc<ConnCtl>, engines: &EnginePool) -> Option<(Arc<Session>, String)> {
        if self.count.fetch_add(1, Ordering::AcqRel) >= self.max {
            self.count.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        let token = new_secret("rt_");
        let id = new_secret("s_");
        let engine = engines.for_session(&id).clone();
        let session = Arc::new(Session {
            id,
            inner: Mutex::new(Inner {
                token: token.clone(),
                closed: false,
                attached: Some(Attachment { conn, cursor: 0 }),
                detached_at: None,
                requests: HashMap::new(),
                running: 0,
                next_key: 1,
                ring: VecDeque::new(),
                ring_base: 0,
                ring_bytes: 0,
            }),
            space: Notify::new(),
            engine,
            limits: self.limits,
            last_prompt: Mutex::new(None),
        });
        self.map.insert(session.id.clone(), session.clone());
        Some((session, token))
    }

    pub fn get(&self, id: &str) -> Result<Arc<Session>, LookupError> {
        if let Some(s) = self.map.get(id) {
            return Ok(s.clone());
        }
        let tombs = self.tombstones.lock().unwrap_or_else(|e| e.into_inner());
        if tombs.contains_key(id) {
            Err(LookupError::Expired)
        } else {
            Err(LookupError::NotFound)
        }
    }

    /// `session.close`: cancels everything of the session and forgets it.
    pub fn close(&self, session: &Session) -> usize {
        let n = session.close();
        self.forget(&session.id);
        n
    }

    fn forget(&self, id: &str) {
        if self.map.remove(id).is_some() {
            (self.on_forget)(id);
            self.count.fetch_sub(1, Ordering::AcqRel);
            let mut tombs = self.tombstones.lock().unwrap_or_else(|e| e.into_inner());
            if tombs.len() >= MAX_TOMBSTONES {
                tombs.clear();
            }
            tombs.insert(id.to_string(), Instant::now());
        }
    }

    /// Closes sessions detached for longer than the TTL; returns how many.
    pub fn reap(&self) -> usize {
        let now = Instant::now();
        let due: Vec<Arc<Session>> = self.map.iter().map(|e| e.value().clone()).filter(|s| s.expire_if_due(now, self.ttl)).collect();
        for s in &due {
            self.forget(&s.id);
        }
        let keep = (self.ttl * 10).max(Duration::from_secs(600));
        self.tombstones.lock().unwrap_or_else(|e| e.into_inner()).retain(|_, t| now.duration_since(*t) < keep);
        due.len()
    }

    pub fn all(&self) -> Vec<Arc<Session>> {
        self.map.iter().map(|e| e.value().clone()).collect()
    }

    /// Closes every session (shutdown).
    pub fn close_all(&self) {
        for s in self.all() {
            self.close(&s);
        }
    }
}

/// `prefix` + 128 random bits in hex.
pub fn new_secret(prefix: &str) -> String {
    let mut bytes = [0u8; 16];
    getrandom::fill(&mut bytes).expect("the OS random source failed");
    let mut s = String::with_capacity(prefix.len() + 32);
    s.push_str(prefix);
    for b in bytes {
        s.push_str(&format!("{b:02x}"));
    }
    s
}
