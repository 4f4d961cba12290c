//! The one reader of client frames for both WebSockets, protocol v1's
//! `/v1/ws` and the Responses API's `/v1/responses`: the idle timeout, the
//! endpoint's stop signal, the frame limit, the per-connection flood limit,
//! binary, close and control frames, and a socket that failed. It hands the
//! endpoint a typed [`Frame`]; the endpoint keeps its own decisions (what
//! idle means for it) and its own error shapes (v1's protocol errors,
//! OpenAI-shaped `error` events).
//!
//! It sends nothing: the socket's write half stays the endpoint's.
//!
//! The key decision: one rule for every frame on both sockets. The frame
//! limit comes first: a frame over `--max-frame-bytes` ends the socket after
//! its error, whatever the flood limit says, because a client that sends
//! one is broken and reading on would buffer its next ones. Then every
//! frame, pings and binary ones too, takes a token from the connection's
//! bucket: a flood of pings (each answered with a pong by tungstenite) or of
//! binary frames (each answered with an error) is a flood like any other.
use std::time::{Duration, Instant};

use futures_util::stream::{SplitSink, SplitStream};
use futures_util::{Stream, StreamExt};
use hyper::upgrade::Upgraded;
use hyper_util::rt::TokioIo;
use tokio::io::AsyncReadExt;
use tokio::sync::watch;
use tokio_tungstenite::tungstenite::{Error as WsError, Message, Utf8Bytes};
use tokio_tungstenite::WebSocketStream;

use crate::server::config::ServerConfig;
use crate::server::rate::TokenBucket;

/// An upgraded WebSocket, of either endpoint.
pub type Ws = WebSocketStream<TokioIo<Upgraded>>;
/// Its write half (the endpoint's writer owns it).
pub type WsSink = SplitSink<Ws, Message>;
/// Its read half (the [`FrameReader`] owns it).
pub type WsStream = SplitStream<Ws>;

/// How long each step of closing a socket may take.
pub const CLOSE_GRACE: Duration = Duration::from_secs(2);

/// The next thing that happened on the socket, as the endpoint sees it.
#[derive(Debug, PartialEq)]
pub enum Frame {
    /// A text frame within both limits; `received` is when it arrived
    /// (request latency counts from here).
    Text { text: Utf8Bytes, received: Instant },
    /// No frame for the idle timeout. Pings count as frames.
    Idle,
    /// A frame over the limit (why, in words): the endpoint answers it and
    /// ends the socket.
    TooLarge(String),
    /// A frame past the flood limit; it was dropped.
    RateLimited,
    /// A binary frame within both limits (both sockets speak JSON text).
    Binary,
    /// The peer closed, or the socket failed.
    Closed,
    /// The endpoint's stop signal fired.
    Stopped,
}

/// Reads one socket's client frames; see the module doc.
pub struct FrameReader<St, S> {
    stream: St,
    /// The endpoint's stop signal, stopped once `stopped` holds for it.
    stop: watch::Receiver<S>,
    stopped: fn(&S) -> bool,
    idle: Duration,
    max_frame_bytes: usize,
    bucket: TokenBucket,
    /// A frame was refused from its header: the rest of it is still in the
    /// socket, and the WebSocket stream cannot read past it.
    unread: bool,
}

impl<St, S> FrameReader<St, S>
where
    St: Stream<Item = Result<Message, WsError>> + Unpin,
{
    pub fn new(stream: St, config: &ServerConfig, stop: watch::Receiver<S>, stopped: fn(&S) -> bool) -> Self {
        FrameReader {
            stream,
            stop,
            stopped,
            idle: config.idle_timeout,
            max_frame_bytes: config.max_frame_bytes,
            bucket: TokenBucket::new(config.rate_limit_per_sec, config.rate_limit_burst),
            unread: false,
        }
    }

    /// Waits for the next frame the endpoint must act on (control frames
    /// within the flood limit need nothing from it).
    pub async fn next(&mut self) -> Frame {
        loop {
            let stopped = self.stopped;
            let next = tokio::select! {
                // First, so a stop is seen even while frames keep coming. A
                // dropped signal also stops: nothing could fire it any more.
                biased;
                _ = self.stop.wait_for(stopped) => return Frame::Stopped,
                r = tokio::time::timeout(self.idle, self.stream.next()) => r,
            };
            let msg = match next {
                Err(_) => return Frame::Idle,
                Ok(Some(Ok(m))) => m,
                // tungstenite's own cap (above ours, see `ws_size_cap`)
                // refused it from its header, without reading it.
                Ok(Some(Err(WsError::Capacity(e)))) => {
                    self.unread = true;
                    return Frame::TooLarge(format!("{e}; the limit is {} bytes", self.max_frame_bytes));
                }
                Ok(None | Some(Err(_))) => return Frame::Closed,
            };
            let received = Instant::now();
            let len = match &msg {
                Message::Text(t) => t.len(),
                Message::Binary(b) => b.len(),
                Message::Close(_) => return Frame::Closed,
                Message::Ping(_) | Message::Pong(_) | Message::Frame(_) => 0,
            };
            if len > self.max_frame_bytes {
                return Frame::TooLarge(format!("frame is {len} bytes, the limit is {}", self.max_frame_bytes));
            }
            if !self.bucket.take() {
                return Frame::RateLimited;
            }
            match msg {
                Message::Text(text) => return Frame::Text { text, received },
                Message::Binary(_) => return Frame::Binary,
                // tungstenite answers pings itself.
                _ => {}
            }
        }
    }

    /// The closing handshake once the endpoint has asked to close: reads
    /// (and ignores) frames until the peer's close, so the endpoint's last
    /// frames are not lost to a TCP reset. Skipped when a frame was refused
    /// unread: [`FrameReader::drain_unread`] takes its place.
    pub async fn await_close(&mut self) {
        if self.unread {
            return;
        }
        let _ = tokio::time::timeout(CLOSE_GRACE * 2, async {
            while let Some(Ok(m)) = self.stream.next().await {
                if m.is_close() {
                    break;
                }
            }
        })
        .await;
    }
}

impl<S> FrameReader<WsStream, S> {
    /// Once the writer has sent its last frames: when a frame was refused
    /// unread, swallows its rest (for a moment, at most 16 MiB) so closing
    /// the socket does not reset the connection and destroy the error and
    /// close frames on their way to the client.
    pub async fn drain_unread(self, sink: WsSink) {
        if !self.unread {
            return;
        }
        let Ok(ws) = self.stream.reunite(sink) else { return };
        let mut io = ws.into_inner();
        let _ = tokio::time::timeout(CLOSE_GRACE, async {
            let mut buf = vec![0u8; 64 << 10];
            let mut total = 0usize;
            while total < 16 << 20 {
                match io.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => total += n,
                }
            }
        })
        .await;
    }
}

#[cfg(test)]
mod tests {
    use futures_util::stream;
    use tokio_tungstenite::tungstenite::error::CapacityError;

    use super::*;

    type Frames = stream::Iter<std::vec::IntoIter<Result<Message, WsError>>>;

    fn reader(frames: Vec<Result<Message, WsError>>, burst: f64) -> (FrameReader<Frames, bool>, watch::Sender<bool>) {
        let config = ServerConfig {
            max_frame_bytes: 8,
            idle_timeout: Duration::from_millis(50),
            rate_limit_per_sec: 0.001,
            rate_limit_burst: burst,
            ..ServerConfig::default()
        };
        let (tx, rx) = watch::channel(false);
        (FrameReader::new(stream::iter(frames), &config, rx, |s| *s), tx)
    }

    #[tokio::test]
    async fn yields_text_and_binary_then_closed() {
        let (mut r, _stop) = reader(vec![Ok(Message::text("{}")), Ok(Message::binary(vec![1])), Ok(Message::Close(None)), Ok(Message::text("late"))], 9.0);
        assert!(matches!(r.next().await, Frame::Text { text, .. } if text.as_str() == "{}"));
        assert_eq!(r.next().await, Frame::Binary);
        assert_eq!(r.next().await, Frame::Closed);
    }

    #[tokio::test]
    async fn an_oversized_frame_is_refused_before_the_flood_limit() {
        // Burst 1: the first frame takes the only token; the oversized one
        // after it is still refused for its size, so the socket ends.
        let (mut r, _stop) = reader(vec![Ok(Message::text("ok")), Ok(Message::text("123456789")), Ok(Message::binary(vec![0; 9]))], 1.0);
        assert!(matches!(r.next().await, Frame::Text { .. }));
        assert_eq!(r.next().await, Frame::TooLarge("frame is 9 bytes, the limit is 8".into()));
        assert_eq!(r.next().await, Frame::TooLarge("frame is 9 bytes, the limit is 8".into()));
        assert!(!r.unread);
    }

    #[tokio::test]
    async fn pings_and_binary_frames_take_tokens() {
        let (mut r, _stop) = reader(
            vec![Ok(Message::Ping(Default::default())), Ok(Message::Ping(Default::default())), Ok(Message::binary(vec![1])), Ok(Message::text("x"))],
            1.0,
        );
        // The first ping is within the limit and needs nothing from the endpoint.
        assert_eq!(r.next().await, Frame::RateLimited);
        assert_eq!(r.next().await, Frame::RateLimited);
        assert_eq!(r.next().await, Frame::RateLimited);
    }

    #[tokio::test]
    async fn a_frame_refused_from_its_header_is_left_unread() {
        let too_long = WsError::Capacity(CapacityError::MessageTooLong { size: 100, max_size: 20 });
        let (mut r, _stop) = reader(vec![Err(too_long)], 9.0);
        assert!(matches!(r.next().await, Frame::TooLarge(m) if m.ends_with("; the limit is 8 bytes")));
        assert!(r.unread);
        // The stream is past reading: no closing handshake on it.
        r.await_close().await;
    }

    #[tokio::test]
    async fn idle_then_stopped() {
        let config = ServerConfig { idle_timeout: Duration::from_millis(30), ..ServerConfig::default() };
        let (tx, rx) = watch::channel(None::<&str>);
        let mut r = FrameReader::new(stream::pending::<Result<Message, WsError>>(), &config, rx, Option::is_some);
        assert_eq!(r.next().await, Frame::Idle);
        tx.send_replace(Some("closing"));
        assert_eq!(r.next().await, Frame::Stopped);
        // It stays stopped: the signal is a state, not an event.
        assert_eq!(r.next().await, Frame::Stopped);
    }
}
