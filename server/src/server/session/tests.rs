//! A session driven as its connection and its requests' relays drive it:
//! registrations, frames pushed into the ring and pulled out by the attached
//! connection, detach and resume, cancels, close and expiry. The engine is a
//! channel whose commands the tests read.
use std::collections::BTreeMap;
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::{Duration, Instant};

use protocol::ErrorCode;

use super::{Frame, Registration, Session, SessionLimits};
use crate::engine::{Command, Scope, StopHandle, StopReason};
use crate::server::conn::ConnCtl;

const LIMITS: SessionLimits = SessionLimits { max_in_flight: 4, replay_frames: 64, replay_bytes: 1 << 20, stall_timeout: Duration::from_secs(30) };

fn session(limits: SessionLimits) -> (Arc<Session>, Arc<ConnCtl>, Receiver<Command>) {
    let (engine, commands) = crate::server::testing::engine();
    let conn = ConnCtl::new(1);
    (Arc::new(Session::new("s_test".into(), "rt_first".into(), conn.clone(), engine, limits)), conn, commands)
}

/// The `seq`th delta of `request_id`, as its relay would push it.
fn delta(request_id: &str, seq: u64) -> Frame {
    Frame { seq: Some(seq), json: Arc::from(format!(r#"{{"request_id":"{request_id}","seq":{seq}}}"#)), terminal: false }
}

fn done(request_id: &str, seq: u64) -> Frame {
    Frame { terminal: true, ..delta(request_id, seq) }
}

fn frames(frames: &[Arc<str>]) -> Vec<&str> {
    frames.iter().map(|f| &**f).collect()
}

fn text(request_id: &str, seqs: std::ops::RangeInclusive<u64>) -> Vec<String> {
    seqs.map(|seq| delta(request_id, seq).json.to_string()).collect()
}

/// The registration of a request that runs in the engine with `stop`.
fn running(session: &Arc<Session>, conn: &ConnCtl, request_id: &str) -> (Registration, StopHandle) {
    let registration = session.register(conn.id, request_id).unwrap();
    let stop = StopHandle::default();
    registration.set_stop(stop.clone());
    (registration, stop)
}

fn last_seq(entries: &[(&str, u64)]) -> BTreeMap<String, u64> {
    entries.iter().map(|&(id, seq)| (id.to_string(), seq)).collect()
}

/// The scope-liveness changes the engine was told of, in order.
fn liveness(commands: &Receiver<Command>) -> Vec<bool> {
    commands
        .try_iter()
        .filter_map(|c| match c {
            Command::SetScopeLive { scope: Scope::Session(id), live } if id == "s_test" => Some(live),
            _ => None,
        })
        .collect()
}

#[test]
fn register_refuses_a_used_id_a_full_session_and_another_connection() {
    let (s, conn, _) = session(SessionLimits { max_in_flight: 2, ..LIMITS });
    let a = s.register(conn.id, "a").unwrap();
    let code = |r: Result<Registration, protocol::ProtocolError>| r.err().expect("refused").code;
    assert_eq!(code(s.register(conn.id, "a")), ErrorCode::DuplicateRequest);
    assert_eq!(code(s.register(2, "b")), ErrorCode::NoSession, "only the attached connection registers");
    let _b = s.register(conn.id, "b").unwrap();
    assert_eq!(s.running(), 2);
    assert_eq!(code(s.register(conn.id, "c")), ErrorCode::TooManyRequests);
    drop(a);
    assert_eq!(s.running(), 1, "a dropped registration frees its place");
    s.register(conn.id, "c").unwrap();
}

#[tokio::test]
async fn the_attached_connection_pulls_frames_in_order_once() {
    let (s, conn, _) = session(LIMITS);
    let (a, _) = running(&s, &conn, "a");
    let (b, _) = running(&s, &conn, "b");
    assert!(a.push(delta("a", 1)).await);
    assert!(b.push(delta("b", 1)).await);
    assert!(a.push(delta("a", 2)).await);
    assert_eq!(frames(&s.pull(conn.id, 2).unwrap()), [&*delta("a", 1).json, &*delta("b", 1).json]);
    assert_eq!(frames(&s.pull(conn.id, 10).unwrap()), [&*delta("a", 2).json]);
    assert!(s.pull(conn.id, 10).unwrap().is_empty(), "each frame is given once");
    assert_eq!(s.pull(7, 10), None, "another connection gets nothing");
}

#[tokio::test]
async fn a_resume_replays_exactly_the_frames_missed_and_then_streams_live() {
    let (s, conn, commands) = session(LIMITS);
    let (a, _) = running(&s, &conn, "a");
    for seq in 1..=3 {
        assert!(a.push(delta("a", seq)).await);
    }
    // The client got frames 1 and 2 (3 was on its way when the socket died).
    assert_eq!(s.pull(conn.id, 2).unwrap().len(), 2);
    s.detach(conn.id);
    assert!(s.detached_since().is_some());
    for seq in 4..=5 {
        assert!(a.push(delta("a", seq)).await, "a detached session keeps its requests' frames");
    }

    let again = ConnCtl::new(2);
    assert_eq!(s.resume(again.clone(), "rt_wrong", &last_seq(&[])).err().unwrap().code, ErrorCode::InvalidResumeToken);
    let resumed = s.resume(again.clone(), "rt_first", &last_seq(&[("a", 2), ("ghost", 1)])).unwrap();
    assert_eq!(resumed.unavailable, 1);
    assert!(resumed.initial[0].contains("replay_unavailable") && resumed.initial[0].contains("ghost"), "{}", resumed.initial[0]);
    assert_eq!(resumed.replayed, 3);
    assert_eq!(frames(&resumed.initial[1..]), text("a", 3..=5));
    assert_ne!(resumed.token, "rt_first");
    assert!(s.detached_since().is_none());
    // What follows streams live to the new connection, and the old token is spent.
    assert!(a.push(delta("a", 6)).await);
    assert_eq!(frames(&s.pull(again.id, 10).unwrap()), text("a", 6..=6));
    assert_eq!(s.resume(ConnCtl::new(3), "rt_first", &last_seq(&[])).err().unwrap().code, ErrorCode::InvalidResumeToken);
    // The engine heard the session go idle, then live again, in that order.
    assert_eq!(liveness(&commands), [false, true]);
}

#[tokio::test]
async fn a_resume_takes_the_session_from_a_live_connection() {
    let (s, conn, commands) = session(LIMITS);
    let resumed = s.resume(ConnCtl::new(2), "rt_first", &last_seq(&[])).unwrap();
    assert_eq!(resumed.initial.len(), 0);
    let closed = conn.closing().borrow().clone().expect("the old connection is closed");
    assert_eq!(closed.code, 1000);
    assert_eq!(s.pull(conn.id, 10), None);
    assert_eq!(liveness(&commands), Vec::<bool>::new(), "the session never went idle");
}

#[tokio::test]
async fn asking_for_frames_no_longer_kept_cancels_the_request() {
    let (s, conn, _) = session(SessionLimits { replay_frames: 2, ..LIMITS });
    let (a, stop) = running(&s, &conn, "a");
    for seq in 1..=4 {
        // Attached, frames already given make room for new ones.
        assert!(a.push(delta("a", seq)).await);
        s.pull(conn.id, 1).unwrap();
    }
    s.detach(conn.id);
    let resumed = s.resume(ConnCtl::new(2), "rt_first", &last_seq(&[("a", 1)])).unwrap();
    assert_eq!((resumed.unavailable, resumed.replayed), (1, 0));
    assert!(resumed.initial[0].contains("no longer buffered"), "{}", resumed.initial[0]);
    assert_eq!(stop.requested(), Some(StopReason::Cancel), "a request its client cannot follow is freed");
    assert!(!a.push(delta("a", 5)).await, "and its later frames are dropped");
}

#[tokio::test]
async fn a_full_ring_while_detached_cancels_the_running_requests() {
    let (s, conn, _) = session(SessionLimits { replay_frames: 2, ..LIMITS });
    let (a, stop_a) = running(&s, &conn, "a");
    let (_b, stop_b) = running(&s, &conn, "b");
    s.detach(conn.id);
    assert!(a.push(delta("a", 1)).await);
    assert!(a.push(delta("a", 2)).await);
    assert_eq!(stop_a.requested(), None);
    assert!(!a.push(delta("a", 3)).await, "nothing is evicted while no one has read it");
    assert_eq!((stop_a.requested(), stop_b.requested()), (Some(StopReason::Cancel), Some(StopReason::Cancel)));
    let resumed = s.resume(ConnCtl::new(2), "rt_first", &last_seq(&[("a", 0)])).unwrap();
    assert!(resumed.initial[0].contains("replay buffer was full"), "{}", resumed.initial[0]);
    assert_eq!(resumed.replayed, 0);
}

#[tokio::test]
async fn a_requests_ending_fits_past_a_full_ring() {
    let (s, conn, _) = session(SessionLimits { replay_frames: 2, ..LIMITS });
    let (a, stop) = running(&s, &conn, "a");
    s.detach(conn.id);
    assert!(a.push(delta("a", 1)).await);
    assert!(a.push(delta("a", 2)).await);
    assert!(a.push(done("a", 3)).await, "a request that finishes while its client is away keeps its ending");
    assert_eq!(stop.requested(), None);
    drop(a);
    let resumed = s.resume(ConnCtl::new(2), "rt_first", &last_seq(&[("a", 0)])).unwrap();
    assert_eq!(frames(&resumed.initial), text("a", 1..=3));
}

#[tokio::test]
async fn a_client_that_stops_reading_stalls_its_producer_then_loses_its_socket() {
    let stall_timeout = Duration::from_millis(50);
    let (s, conn, commands) = session(SessionLimits { replay_frames: 1, stall_timeout, ..LIMITS });
    let (a, stop) = running(&s, &conn, "a");
    assert!(a.push(delta("a", 1)).await);
    // The ring is full of a frame the client has not been given: the push waits for it to read...
    let a = Arc::new(a);
    let producer = tokio::spawn({
        let a = a.clone();
        async move { a.push(delta("a", 2)).await }
    });
    tokio::task::yield_now().await;
    assert!(!producer.is_finished());
    assert_eq!(frames(&s.pull(conn.id, 10).unwrap()), text("a", 1..=1));
    assert!(tokio::time::timeout(Duration::from_secs(10), producer).await.unwrap().unwrap(), "reading made room");
    // ...and when it reads nothing for the stall timeout, its socket is closed
    // and the session is detached (whose full ring then cancels the request).
    let started = Instant::now();
    assert!(!tokio::time::timeout(Duration::from_secs(10), a.push(delta("a", 3))).await.unwrap());
    assert!(started.elapsed() >= stall_timeout);
    assert_eq!(conn.closing().borrow().as_ref().map(|c| c.code), Some(1008));
    assert!(s.detached_since().is_some());
    assert_eq!(stop.requested(), Some(StopReason::Cancel));
    assert_eq!(liveness(&commands), [false]);
}

#[tokio::test]
async fn cancels_say_who_asked() {
    let (s, conn, _) = session(LIMITS);
    let (by_client, client_stop) = running(&s, &conn, "a");
    let (by_server, server_stop) = running(&s, &conn, "b");
    let (untouched, _) = running(&s, &conn, "c");
    s.cancel("a").unwrap();
    assert_eq!(client_stop.requested(), Some(StopReason::Cancel));
    s.server_cancel_all();
    assert_eq!(server_stop.requested(), Some(StopReason::Cancel));
    assert_eq!(by_client.cancel_origin(), Some(true), "the client's cancel ends with done");
    assert_eq!(by_server.cancel_origin(), Some(false), "the server's ends with an error");
    assert_eq!(untouched.cancel_origin(), Some(false), "server_cancel_all reaches every running request");
    drop(by_client);
    assert_eq!(s.cancel("a").err().unwrap().code, ErrorCode::UnknownRequest, "finished and forgotten");
    assert_eq!(s.cancel("nope").err().unwrap().code, ErrorCode::UnknownRequest);
}

#[tokio::test]
async fn a_request_cancelled_before_the_engine_took_it_stops_on_arrival() {
    let (s, conn, _) = session(LIMITS);
    let registration = s.register(conn.id, "a").unwrap();
    s.cancel("a").unwrap();
    let stop = StopHandle::default();
    registration.set_stop(stop.clone());
    assert_eq!(stop.requested(), Some(StopReason::Cancel));
}

#[tokio::test]
async fn a_finished_requests_id_is_free_again_once_its_frames_left_the_ring() {
    let (s, conn, _) = session(SessionLimits { replay_frames: 1, ..LIMITS });
    let (a, _) = running(&s, &conn, "a");
    assert!(a.push(done("a", 1)).await);
    drop(a);
    assert_eq!(s.register(conn.id, "a").err().unwrap().code, ErrorCode::DuplicateRequest, "kept for replay");
    s.pull(conn.id, 10).unwrap();
    let (b, _) = running(&s, &conn, "b");
    assert!(b.push(delta("b", 1)).await, "evicts a's frame, which was given");
    let (again, _) = running(&s, &conn, "a");
    s.pull(conn.id, 10).unwrap();
    assert!(again.push(delta("a", 1)).await);
    assert_eq!(frames(&s.pull(conn.id, 10).unwrap()), text("a", 1..=1));
}

#[tokio::test]
async fn close_cancels_everything_and_ends_the_session() {
    let (s, conn, _) = session(LIMITS);
    let (a, stop_a) = running(&s, &conn, "a");
    let (_b, stop_b) = running(&s, &conn, "b");
    assert!(a.push(delta("a", 1)).await);
    assert_eq!(s.close(), 2);
    assert_eq!((stop_a.requested(), stop_b.requested()), (Some(StopReason::Cancel), Some(StopReason::Cancel)));
    assert_eq!(a.cancel_origin(), Some(true), "a closed session's requests end as cancelled by the client");
    assert!(!a.push(delta("a", 2)).await);
    assert_eq!(s.pull(conn.id, 10), None);
    assert_eq!(s.resume(ConnCtl::new(2), "rt_first", &last_seq(&[])).err().unwrap().code, ErrorCode::SessionExpired);
    assert_eq!(s.register(conn.id, "c").err().unwrap().code, ErrorCode::NoSession);
}

#[test]
fn a_session_expires_only_after_its_ttl_detached() {
    let (s, conn, _) = session(LIMITS);
    let ttl = Duration::from_secs(60);
    let later = Instant::now() + 2 * ttl;
    assert!(!s.expire_if_due(later, ttl), "an attached session never expires");
    s.detach(99);
    assert!(s.detached_since().is_none(), "another connection's detach is ignored");
    s.detach(conn.id);
    let since = s.detached_since().unwrap();
    assert!(!s.expire_if_due(since + ttl / 2, ttl));
    assert!(s.expire_if_due(since + ttl, ttl));
    assert!(s.detached_since().is_none(), "closed");
    assert!(!s.expire_if_due(later, ttl), "once");
}
