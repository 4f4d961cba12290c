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
use std::collections::{BTreeMap, HashMap};
use std::pin::pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use protocol::{ErrorCode, ProtocolError, ServerMessage};
use subtle::ConstantTimeEq;
use tokio::sync::Notify;

use super::conn::{CloseReason, ConnCtl};
use super::replay::{Entry, ReplayRing};
use crate::engine::{EngineHandle, Scope, StopHandle, StopReason};
use crate::tokenizer::PieceEncoding;

/// Which registration of a client's `request_id` a frame or handle belongs
/// to: a request id may be used again once its frames left the ring, and
/// a late frame or handle of the earlier request must not touch the new one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RegistrationKey(u64);

impl RegistrationKey {
    pub const FIRST: RegistrationKey = RegistrationKey(1);
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

struct Req {
    key: RegistrationKey,
    /// Ends it in the engine, once it was submitted there.
    stop: Option<StopHandle>,
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
    next_key: RegistrationKey,
    ring: ReplayRing,
}

enum TryPush {
    Pushed,
    Dropped,
    Wait,
    DetachedFull,
}

impl Inner {
    fn req(&mut self, key: RegistrationKey, request_id: &str) -> Option<&mut Req> {
        self.requests.get_mut(request_id).filter(|r| r.key == key)
    }

    fn evict_front(&mut self) {
        let Some(e) = self.ring.pop_front() else { return };
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

    fn try_push(&mut self, key: RegistrationKey, request_id: &str, frame: &Frame, limits: &SessionLimits) -> TryPush {
        if self.closed {
            return TryPush::Dropped;
        }
        match self.req(key, request_id) {
            Some(r) if !r.lost => {}
            _ => return TryPush::Dropped,
        }
        let size = frame.json.len();
        loop {
            let fits = self.ring.len() < limits.replay_frames && self.ring.bytes() + size <= limits.replay_bytes;
            let overflow_ok = frame.terminal && self.ring.len() < limits.replay_frames + limits.max_in_flight;
            if fits || overflow_ok || self.ring.is_empty() {
                break;
            }
            match &self.attached {
                Some(a) if self.ring.start() < a.cursor => self.evict_front(),
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
        self.ring.push(Entry { key, request_id: id, seq: frame.seq, json: frame.json.clone() });
        if let Some(a) = &self.attached {
            a.conn.wake.notify_one();
        }
        TryPush::Pushed
    }

    /// Marks every running request lost and returns their handles to cancel.
    fn lose_running(&mut self) -> Vec<StopHandle> {
        let mut stops = Vec::new();
        for r in self.requests.values_mut().filter(|r| r.running && !r.lost) {
            r.lost = true;
            stops.extend(r.stop.clone());
        }
        stops
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
    /// A new session attached to `conn`, running on `engine`.
    pub(super) fn new(id: String, token: String, conn: Arc<ConnCtl>, engine: EngineHandle, limits: SessionLimits) -> Session {
        Session {
            id,
            inner: Mutex::new(Inner {
                token,
                closed: false,
                attached: Some(Attachment { conn, cursor: 0 }),
                detached_at: None,
                requests: HashMap::new(),
                running: 0,
                next_key: RegistrationKey::FIRST,
                ring: ReplayRing::default(),
            }),
            space: Notify::new(),
            engine,
            limits,
            last_prompt: Mutex::new(None),
        }
    }

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

    fn cancel_in_engine(&self, stops: Vec<StopHandle>) {
        for stop in stops {
            stop.stop(StopReason::Cancel);
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
        let mut replay: HashMap<&str, (RegistrationKey, u64)> = HashMap::new();
        for (rid, &last) in last_seq {
            let problem = match g.requests.get_mut(rid.as_str()) {
                None => Some("the request is unknown (never started, or its frames were discarded)".to_string()),
                Some(r) if r.lost => Some("its frames were dropped: the session's replay buffer was full while disconnected".to_string()),
                Some(r) if last < r.evicted_upto || r.terminal_evicted => {
                    if r.running {
                        r.lost = true;
                        to_cancel.extend(r.stop.clone());
                    }
                    Some(format!("frames after seq {last} are no longer buffered (the oldest kept is {})", r.evicted_upto + 1))
                }
                Some(r) if last > r.last_seq => {
                    if r.running {
                        r.lost = true;
                        to_cancel.extend(r.stop.clone());
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
        for e in g.ring.iter() {
            if let Some(&(key, last)) = replay.get(&*e.request_id) {
                if e.key == key && !matches!(e.seq, Some(s) if s <= last) {
                    initial.push(e.json.clone());
                    replayed += 1;
                }
            }
        }
        drop(replay);
        let cursor = g.ring.end();
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
    /// The request counts as running in this session until the returned
    /// guard is dropped, on whatever path that happens.
    pub fn register(self: &Arc<Self>, conn_id: u64, request_id: &str) -> Result<Registration, ProtocolError> {
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
        g.next_key = RegistrationKey(key.0 + 1);
        g.running += 1;
        g.requests.insert(
            request_id.to_string(),
            Req {
                key,
                stop: None,
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
        drop(g);
        Ok(Registration { session: self.clone(), key, request_id: request_id.to_string() })
    }

    /// Records how to stop a registered request in the engine; stops it at
    /// once if it was cancelled meanwhile.
    fn set_stop(&self, key: RegistrationKey, request_id: &str, stop: StopHandle) {
        let mut g = self.lock();
        let closed = g.closed;
        let cancelled = match g.req(key, request_id) {
            Some(r) => {
                r.stop = Some(stop.clone());
                closed || r.client_cancelled || r.server_cancelled || r.lost
            }
            None => true,
        };
        if cancelled {
            stop.stop(StopReason::Cancel);
        }
    }

    /// `cancel`: marks the request cancelled by the client and stops it in
    /// the engine. `unknown_request` if it isn't running.
    pub fn cancel(&self, request_id: &str) -> Result<(), ProtocolError> {
        let mut g = self.lock();
        let id = match g.requests.get_mut(request_id) {
            Some(r) if r.running => {
                r.client_cancelled = true;
                r.stop.clone()
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
    fn cancel_origin(&self, key: RegistrationKey, request_id: &str) -> Option<bool> {
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
    async fn push(&self, key: RegistrationKey, request_id: &str, frame: Frame) -> bool {
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

    /// The request ended (its guard was dropped): its frames stay in the
    /// ring for replay; with none there it is forgotten.
    fn finish(&self, key: RegistrationKey, request_id: &str) {
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
        let (out, next) = inner.ring.read_from(a.cursor, max);
        a.cursor = next;
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
            ids.extend(r.stop.clone());
        }
        g.ring.clear();
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
            ids.extend(r.stop.clone());
        }
        drop(g);
        self.cancel_in_engine(ids);
    }

    /// Since when no socket holds it, if it is alive and detached.
    pub(super) fn detached_since(&self) -> Option<Instant> {
        let g = self.lock();
        g.detached_at.filter(|_| !g.closed && g.attached.is_none())
    }

    /// Closes the session if it has been detached for `ttl`.
    pub(super) fn expire_if_due(&self, now: Instant, ttl: Duration) -> bool {
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

/// A request's registration in its session, held for the request's whole
/// life. Dropping it (after the last frame, or on any error path before the
/// engine saw the request) ends the registration: nothing undoes it by hand.
pub struct Registration {
    session: Arc<Session>,
    key: RegistrationKey,
    request_id: String,
}

impl Registration {
    /// Records how to stop the request in the engine (see [`Session::set_stop`]).
    pub fn set_stop(&self, stop: StopHandle) {
        self.session.set_stop(self.key, &self.request_id, stop);
    }

    /// Adds one of the request's frames to the ring (see [`Session::push`]).
    pub async fn push(&self, frame: Frame) -> bool {
        self.session.push(self.key, &self.request_id, frame).await
    }

    /// How a request the engine reported as cancelled should end (see
    /// [`Session::cancel_origin`]).
    pub fn cancel_origin(&self) -> Option<bool> {
        self.session.cancel_origin(self.key, &self.request_id)
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.session.finish(self.key, &self.request_id);
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

#[cfg(test)]
mod tests;
