//! One WebSocket connection: a reader task (parses and acts on client
//! frames) and a writer task (the only one touching the socket's send half),
//! joined by a bounded channel of connection-level frames. Request frames do
//! not go through that channel: the writer pulls them from the attached
//! session's replay ring (see `session.rs`), in order. Client frames come
//! through the frame reader both WebSockets share (`http/ws_frames.rs`).
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use futures_util::{SinkExt, StreamExt};
use protocol::{parse_client, ClientMessage, ErrorCode, Pong, ProtocolError, ServerMessage, SessionOpen, SessionReady, PROTOCOL_VERSION};
use tokio::sync::{mpsc, watch};
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::tungstenite::Message;

use super::conn::{CloseReason, ConnCtl};
use super::http::ws_frames::{Frame, FrameReader, Ws, WsSink as Sink, WsStream, CLOSE_GRACE};
use super::session::Session;
use super::sessions::LookupError;
use super::{request, ServerState};

/// Frames the writer takes from the ring at once.
const PULL_BATCH: usize = 64;

enum Out {
    /// A connection-level frame (pong, error, ...).
    Frame(String),
    /// Start streaming `session`'s frames, after sending `initial`.
    Attach(Arc<Session>, Vec<Arc<str>>),
}

/// Serves one upgraded WebSocket until it closes.
pub async fn run(state: Arc<ServerState>, ws: Ws) {
    let conn = ConnCtl::new(state.next_conn_id());
    state.metrics.connections.inc();
    let (sink, stream) = ws.split();
    let (tx, rx) = mpsc::channel(state.config.outgoing_queue);
    let writer = tokio::spawn(writer(state.clone(), conn.clone(), sink, rx));
    let mut reader = Reader { state: state.clone(), conn: conn.clone(), tx, closing: conn.closing(), session: None };
    // The reader stops once the connection is closing (the writer turns the
    // server's stop into that, after delivering what the session has).
    let mut frames = FrameReader::new(stream, &state.config, conn.closing(), Option::is_some);
    reader.run(&mut frames).await;
    if let Some(s) = reader.session.take() {
        s.detach(conn.id);
    }
    drop(reader);
    if let Ok(sink) = writer.await {
        frames.drain_unread(sink).await;
    }
    state.metrics.connections.dec();
    state.connection_closed();
}

struct Reader {
    state: Arc<ServerState>,
    conn: Arc<ConnCtl>,
    tx: mpsc::Sender<Out>,
    closing: watch::Receiver<Option<CloseReason>>,
    session: Option<Arc<Session>>,
}

impl Reader {
    /// Reads until the connection ends.
    async fn run(&mut self, frames: &mut FrameReader<WsStream, Option<CloseReason>>) {
        loop {
            match frames.next().await {
                Frame::Text { text, received } => self.on_text(text.as_str(), received).await,
                Frame::Idle if self.session.as_ref().is_some_and(|s| s.running() > 0) => {}
                Frame::Idle => {
                    let idle = self.state.config.idle_timeout;
                    self.fatal(ErrorCode::IdleTimeout, format!("no frame for {} ms; the session can be resumed", idle.as_millis()));
                }
                Frame::TooLarge(message) => self.fatal(ErrorCode::FrameTooLarge, message),
                Frame::RateLimited => self.rate_limited().await,
                Frame::Binary => self.error(ProtocolError::new(ErrorCode::BinaryFrame, "binary frames are not accepted: send JSON text frames")).await,
                Frame::Closed => return,
                // Closing: a fatal error above (seen by the next read), a
                // `session.close`, the server stopping, a stalled client.
                Frame::Stopped => break,
            }
        }
        frames.await_close().await;
    }

    fn fatal(&self, code: ErrorCode, message: impl Into<String>) {
        self.state.metrics.error(code);
        self.conn.close(CloseReason::fatal(code, message));
    }

    /// Queues a connection-level frame; a writer that accepts nothing for
    /// the stall timeout means the client stopped reading: close.
    async fn send(&mut self, msg: Out) {
        let stall = self.state.config.stall_timeout;
        tokio::select! {
            r = tokio::time::timeout(stall, self.tx.send(msg)) => {
                if !matches!(r, Ok(Ok(()))) {
                    self.conn.close(CloseReason { code: 1008, reason: "client stopped reading".into(), error: None });
                }
            }
            _ = self.closing.changed() => {}
        }
    }

    async fn error(&mut self, e: ProtocolError) {
        self.state.metrics.error(e.code);
        self.send(Out::Frame(e.to_message().to_json())).await;
    }

    async fn rate_limited(&mut self) {
        let e =
            ProtocolError::new(ErrorCode::RateLimited, format!("more than {} frames per second; the frame was dropped", self.state.config.rate_limit_per_sec));
        self.error(e).await;
    }

    async fn on_text(&mut self, text: &str, received: Instant) {
        let msg = match parse_client(text) {
            Ok(m) => m,
            Err(e) => return self.error(e).await,
        };
        match msg {
            ClientMessage::Ping(p) => {
                self.send(Out::Frame(ServerMessage::Pong(Pong { id: p.id }).to_json())).await;
            }
            ClientMessage::SessionOpen(open) => self.on_open(open).await,
            ClientMessage::Generate(g) => {
                let Some(session) = self.session.clone() else {
                    return self.error(no_session(&g.request_id)).await;
                };
                if let Err(e) = request::start(&self.state, &session, self.conn.id, g, received).await {
                    self.error(e).await;
                }
            }
            ClientMessage::Cancel(c) => {
                let Some(session) = self.session.clone() else {
                    return self.error(no_session(&c.request_id)).await;
                };
                if let Err(e) = session.cancel(&c.request_id) {
                    self.error(e).await;
                }
            }
            ClientMessage::SessionClose(_) => {
                if let Some(s) = self.session.take() {
                    self.state.sessions.close(&s);
                    self.state.metrics.sessions.set(self.state.sessions.len() as i64);
                }
                self.conn.close(CloseReason::normal("session closed"));
            }
        }
    }

    async fn on_open(&mut self, open: SessionOpen) {
        if let Some(s) = &self.session {
            let e = ProtocolError::new(ErrorCode::SessionAlreadyOpen, format!("this connection already has session {}", s.id));
            return self.error(e).await;
        }
        let (session, token, initial, resumed) = match (&open.session_id, &open.resume_token) {
            (Some(id), Some(token)) => {
                let session = match self.state.sessions.get(id) {
                    Ok(s) => s,
                    Err(LookupError::NotFound) => return self.error(ProtocolError::new(ErrorCode::SessionNotFound, format!("no session {id}"))).await,
                    Err(LookupError::Expired) => {
                        let e = ProtocolError::new(ErrorCode::SessionExpired, format!("session {id} has expired or was closed"));
                        return self.error(e).await;
                    }
                };
                let empty = BTreeMap::new();
                match session.resume(self.conn.clone(), token, open.last_seq.as_ref().unwrap_or(&empty)) {
                    Ok(r) => {
                        self.state.metrics.replayed_frames.inc_by(r.replayed as u64);
                        for _ in 0..r.unavailable {
                            self.state.metrics.error(ErrorCode::ReplayUnavailable);
                        }
                        (session, r.token, r.initial, true)
                    }
                    Err(e) => return self.error(e).await,
                }
            }
            _ => {
                if self.state.is_draining() {
                    return self.fatal(ErrorCode::ShuttingDown, "the server is shutting down");
                }
                match self.state.sessions.create(self.conn.clone(), &self.state.engines) {
                    Some(new) => {
                        self.state.metrics.sessions_evicted.inc_by(new.evicted as u64);
                        (new.session, new.token, Vec::new(), false)
                    }
                    None => {
                        let n = self.state.config.max_sessions;
                        return self.fatal(ErrorCode::ServerBusy, format!("the server is at its limit of {n} sessions; retry later"));
                    }
                }
            }
        };
        self.state.metrics.sessions.set(self.state.sessions.len() as i64);
        let ready = ServerMessage::SessionReady(SessionReady {
            protocol_version: PROTOCOL_VERSION,
            session_id: session.id.clone(),
            resume_token: token,
            resumed,
            model: self.state.model.clone(),
            limits: self.state.limits.clone(),
        });
        let mut frames: Vec<Arc<str>> = Vec::with_capacity(initial.len() + 1);
        frames.push(Arc::from(ready.to_json()));
        frames.extend(initial);
        self.session = Some(session.clone());
        self.send(Out::Attach(session, frames)).await;
    }
}

fn no_session(request_id: &str) -> ProtocolError {
    ProtocolError::new(ErrorCode::NoSession, "send session.open first").with_request_id(request_id)
}

/// Why the writer stopped before the socket closed.
enum Abort {
    /// The socket failed.
    Broken,
    /// Someone asked to close the connection.
    Closing,
}

async fn send(sink: &mut Sink, closing: &mut watch::Receiver<Option<CloseReason>>, text: &str) -> Result<(), Abort> {
    if closing.borrow().is_some() {
        return Err(Abort::Closing);
    }
    tokio::select! {
        r = sink.send(Message::text(text)) => r.map_err(|_| Abort::Broken),
        _ = closing.changed() => Err(Abort::Closing),
    }
}

async fn writer(state: Arc<ServerState>, conn: Arc<ConnCtl>, mut sink: Sink, mut rx: mpsc::Receiver<Out>) -> Sink {
    let mut closing = conn.closing();
    let mut stop = state.stop_signal();
    let mut session: Option<Arc<Session>> = None;
    let reason = 'run: loop {
        if let Some(r) = closing.borrow().clone() {
            break Some(r);
        }
        let step: Result<(), Abort> = tokio::select! {
            biased;
            _ = closing.changed() => continue,
            _ = super::until_true(&mut stop) => {
                // Shutdown: deliver what the session still has, then say goodbye.
                if let Some(s) = &session {
                    let deadline = tokio::time::Instant::now() + CLOSE_GRACE;
                    while let Some(frames) = s.pull(conn.id, PULL_BATCH).filter(|f| !f.is_empty()) {
                        for f in frames {
                            match tokio::time::timeout_at(deadline, send(&mut sink, &mut closing, &f)).await {
                                Ok(Ok(())) => {}
                                _ => break 'run None,
                            }
                        }
                    }
                }
                state.metrics.error(ErrorCode::ShuttingDown);
                break Some(CloseReason::fatal(ErrorCode::ShuttingDown, "the server is shutting down"));
            }
            m = rx.recv() => match m {
                None => break None,
                Some(Out::Frame(text)) => send(&mut sink, &mut closing, &text).await,
                Some(Out::Attach(s, initial)) => {
                    let mut r = Ok(());
                    for f in &initial {
                        r = send(&mut sink, &mut closing, f).await;
                        if r.is_err() {
                            break;
                        }
                    }
                    session = Some(s);
                    conn.wake.notify_one();
                    r
                }
            },
            _ = conn.wake.notified(), if session.is_some() => {
                let s = session.as_ref().expect("guarded");
                match s.pull(conn.id, PULL_BATCH) {
                    // Taken over by another connection, or closed.
                    None => {
                        session = None;
                        Ok(())
                    }
                    Some(frames) => {
                        if frames.len() == PULL_BATCH {
                            conn.wake.notify_one();
                        }
                        let mut r = Ok(());
                        for f in &frames {
                            r = send(&mut sink, &mut closing, f).await;
                            if r.is_err() {
                                break;
                            }
                        }
                        r
                    }
                }
            }
        };
        match step {
            Ok(()) => {}
            Err(Abort::Closing) => continue,
            Err(Abort::Broken) => break None,
        }
    };
    match reason {
        Some(r) => {
            let _ = tokio::time::timeout(CLOSE_GRACE, async {
                if let Some((code, message)) = &r.error {
                    let frame = ServerMessage::error(*code, message.clone(), None).to_json();
                    sink.send(Message::text(frame)).await?;
                }
                let close = CloseFrame { code: CloseCode::from(r.code), reason: r.reason.clone().into() };
                sink.send(Message::Close(Some(close))).await
            })
            .await;
            conn.close(r);
        }
        None => {
            conn.close(CloseReason::normal("connection closed"));
            let _ = tokio::time::timeout(CLOSE_GRACE, sink.close()).await;
        }
    }
    sink
}
