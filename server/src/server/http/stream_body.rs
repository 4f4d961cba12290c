//! A response body fed by a channel, for server-sent events: each message
//! is sent to the client as soon as it is written. When the client goes
//! away hyper drops the body, the channel closes, and the writer learns it
//! at its next send (the request is then cancelled).
use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

use hyper::body::{Bytes, Frame, SizeHint};
use tokio::sync::mpsc;

pub struct ChannelBody {
    rx: mpsc::Receiver<Bytes>,
}

impl ChannelBody {
    /// A body and the sender that writes it; `capacity` messages may wait.
    pub fn new(capacity: usize) -> (mpsc::Sender<Bytes>, ChannelBody) {
        let (tx, rx) = mpsc::channel(capacity);
        (tx, ChannelBody { rx })
    }
}

impl hyper::body::Body for ChannelBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.rx.poll_recv(cx).map(|m| m.map(|bytes| Ok(Frame::data(bytes))))
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}
