//! Request and session lifecycles against the engine's own accounting:
//! cancel, disconnect then TTL, the detached replay bound, session.close,
//! resume with replay, takeover, a reader that stalls, graceful shutdown.
//! Tests here measure engine-wide stats, so they run one at a time.
mod ws_harness;

use std::time::{Duration, Instant};

use protocol::{ErrorCode, FinishReason, ServerMessage};
use serde_json::json;
use tether::engine::EngineStats;
use tether::server::ServerConfig;
use tokio::sync::{Mutex, OnceCell};
use ws_harness::*;

const COUNT: &str = "1, 2, 3, 4,";
const CAPITAL: &str = "The capital of France is";
const STORY: &str = "Once upon a time, in a small village by the sea,";

/// MLX active memory may differ by allocator rounding between two idle points.
const MEMORY_TOLERANCE: usize = 1 << 20;

static SERIAL: Mutex<()> = Mutex::const_new(());

fn harness() -> &'static Harness {
    harness_for(MODEL, &[(COUNT, 24), (CAPITAL, 4)])
}

async fn server() -> &'static TestServer {
    static S: OnceCell<TestServer> = OnceCell::const_new();
    S.get_or_init(|| harness().start(ServerConfig::default())).await
}

/// Only catches a hang: what the tests wait for takes well under a second
/// on an idle machine, but these tests share two cores with builds.
const HANG: Duration = Duration::from_secs(60);

/// Polls the engine until `done` holds (or [`HANG`] passes).
async fn wait_for(h: &Harness, what: &str, done: impl Fn(&EngineStats) -> bool) -> EngineStats {
    let deadline = Instant::now() + HANG;
    loop {
        let s = h.stats().await;
        if done(&s) {
            return s;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}: {s:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Requests of `srv` that ended with `finish_reason` (from its /metrics text).
fn finished_as(srv: &TestServer, finish_reason: &str) -> u64 {
    let line = format!("tether_requests_total{{finish_reason=\"{finish_reason}\"}} ");
    let text = srv.state.metrics.render(None);
    text.lines().find_map(|l| l.strip_prefix(line.as_str())).map_or(0, |n| n.parse().unwrap())
}

fn assert_freed(base: &EngineStats, after: &EngineStats) {
    assert_eq!(after.running, 0);
    assert_eq!(after.kv_bytes, base.kv_bytes, "KV cache back to the baseline");
    assert!(after.active_memory <= base.active_memory + MEMORY_TOLERANCE, "MLX active memory {} vs baseline {}", after.active_memory, base.active_memory);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_stops_generation_and_frees_the_kv_cache() {
    let _serial = SERIAL.lock().await;
    let h = harness();
    let base = h.wait_idle().await;
    let mut c = server().await.client().await;
    c.open().await;
    c.generate("long", json!({"prompt": STORY, "max_tokens": 500})).await;
    c.deltas("long", 3).await;
    let during = h.stats().await;
    assert_eq!(during.running, 1);
    assert!(during.kv_bytes > base.kv_bytes);

    c.send(&json!({"type": "cancel", "request_id": "long"})).await;
    let out = c.collect("long").await;
    let done = out.done();
    // Cancelled, not run to its end. How many tokens ran between the cancel
    // and its effect depends on the machine's load, so no time or tighter
    // count is asserted: the harness's frame timeout catches a hang.
    assert_eq!(done.finish_reason, FinishReason::Cancelled);
    assert!(done.usage.completion_tokens < 500);
    assert_eq!(done.seq, out.deltas.len() as u64 + 4);
    // The engine frees the row before reporting it finished.
    let after = h.stats().await;
    assert_freed(&base, &after);
    c.send(&json!({"type": "cancel", "request_id": "long"})).await;
    assert_eq!(c.expect_error().await.code, ErrorCode::UnknownRequest);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_socket_keeps_its_requests_until_the_ttl_then_frees_them() {
    let _serial = SERIAL.lock().await;
    let h = harness();
    // Long enough that a busy machine still sees the request run on after
    // the drop; the request (and the replay ring) outlast it on any device.
    let ttl = Duration::from_secs(3);
    let srv = h.start(ServerConfig { session_ttl: ttl, replay_frames: 1 << 14, ..ServerConfig::default() }).await;
    let base = h.wait_idle().await;
    let mut c = srv.client().await;
    let ready = c.open().await;
    c.generate("long", json!({"prompt": STORY, "max_tokens": 4000})).await;
    c.deltas("long", 3).await;
    let during = h.stats().await;
    assert!(during.kv_bytes > base.kv_bytes && during.active_memory > base.active_memory);
    let dropped = Instant::now();
    c.drop_connection();

    // Once the server has seen the socket go (the session detaches before
    // the connection is counted closed), the request goes on into the
    // replay buffer: the engine generates past that point...
    let deadline = Instant::now() + HANG;
    while srv.state.connection_count() > 0 {
        assert!(Instant::now() < deadline, "the server never saw the socket close");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let detached = h.stats().await;
    let mid = wait_for(h, "tokens generated while detached", |s| s.generated_tokens > detached.generated_tokens || s.running == 0).await;
    assert_eq!(mid.running, 1, "the request outlives its socket within the TTL");
    assert_eq!(srv.state.session_count(), 1, "the detached session waits for a resume");
    // ...after it, the session is gone and its request cancelled and freed.
    let after = wait_for(h, "the expired session's request to be freed", |s| s.running == 0).await;
    assert!(dropped.elapsed() >= ttl, "freed after {:?}, before the TTL", dropped.elapsed());
    assert_freed(&base, &after);
    assert_eq!(srv.state.session_count(), 0);
    assert_eq!(finished_as(&srv, "cancelled"), 1, "the TTL cancelled the request; it did not run to its end");
    let mut c = srv.client().await;
    c.send(&json!({"type": "session.open", "session_id": ready.session_id, "resume_token": ready.resume_token, "last_seq": {"long": 3}})).await;
    assert_eq!(c.expect_error().await.code, ErrorCode::SessionExpired);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_replay_buffer_while_detached_cancels_and_frees() {
    let _serial = SERIAL.lock().await;
    let h = harness();
    let srv = h.start(ServerConfig { replay_frames: 8, ..ServerConfig::default() }).await;
    let base = h.wait_idle().await;
    let mut c = srv.client().await;
    let ready = c.open().await;
    c.generate("long", json!({"prompt": STORY, "max_tokens": 500})).await;
    // Attached, delivered frames make room: far more than 8 frames stream fine.
    c.deltas("long", 12).await;
    c.drop_connection();
    // Detached, the 8-frame buffer fills within a few tokens: long before the 60 s TTL.
    let after = wait_for(h, "the request to be cancelled by the replay bound", |s| s.running == 0).await;
    assert_freed(&base, &after);
    let mut c = srv.client().await;
    let r = c.resume(&ready.session_id, &ready.resume_token, json!({"long": 12})).await;
    assert!(r.resumed);
    let e = c.collect("long").await;
    assert_eq!(e.error().code, ErrorCode::ReplayUnavailable);
    assert!(e.deltas.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_close_cancels_everything_at_once() {
    let _serial = SERIAL.lock().await;
    let h = harness();
    let base = h.wait_idle().await;
    let mut c = server().await.client().await;
    let ready = c.open().await;
    c.generate("a", json!({"prompt": STORY, "max_tokens": 500})).await;
    c.generate("b", json!({"prompt": COUNT, "speculation": {"source": "off"}, "max_tokens": 500})).await;
    c.deltas("a", 2).await;
    c.deltas("b", 2).await;
    assert_eq!(h.stats().await.running, 2);
    c.send(&json!({"type": "session.close"})).await;
    assert_eq!(c.expect_close().await.map(|f| u16::from(f.code)), Some(1000));
    let after = wait_for(h, "both requests to be freed", |s| s.running == 0).await;
    assert_freed(&base, &after);
    let mut c = server().await.client().await;
    c.send(&json!({"type": "session.open", "session_id": ready.session_id, "resume_token": ready.resume_token})).await;
    assert_eq!(c.expect_error().await.code, ErrorCode::SessionExpired);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resume_replays_exactly_what_was_missed() {
    let _serial = SERIAL.lock().await;
    let h = harness();
    let srv = server().await;
    let mut c = srv.client().await;
    let ready = c.open().await;
    c.generate("r", json!({"prompt": COUNT, "speculation": {"source": "off"}, "max_tokens": 24})).await;
    c.generate("quick", json!({"prompt": CAPITAL, "max_tokens": 4})).await;
    let first = c.deltas("r", 5).await;
    c.drop_connection();
    // Both requests run on while nobody listens, until quick has finished
    // (its frames wait in the ring).
    wait_for(h, "quick to finish while detached", |s| s.running <= 1).await;

    let mut c = srv.client().await;
    let r = c.resume(&ready.session_id, &ready.resume_token, json!({"r": 5, "quick": 0, "ghost": 2})).await;
    assert!(r.resumed);
    assert_eq!(r.session_id, ready.session_id);
    assert_ne!(r.resume_token, ready.resume_token, "a new token on resume");

    let ghost = c.collect("ghost").await;
    assert_eq!(ghost.error().code, ErrorCode::ReplayUnavailable);
    let quick = c.collect("quick").await;
    quick.assert_contiguous();
    assert_eq!(quick.text(), h.greedy(CAPITAL, 4).1);
    let rest = c.collect("r").await;
    let seqs: Vec<u64> = first.iter().chain(&rest.deltas).map(|d| d.seq).collect();
    assert_eq!(seqs, (1..=24).collect::<Vec<u64>>(), "contiguous, nothing lost or repeated");
    assert_eq!(rest.done().seq, 25);
    let text: String = first.iter().chain(&rest.deltas).map(|d| d.text.as_str()).collect();
    let ids: Vec<u32> = first.iter().chain(&rest.deltas).flat_map(|d| d.token_ids.clone()).collect();
    let (want_ids, want_text) = h.greedy(COUNT, 24);
    assert_eq!(ids, want_ids);
    assert_eq!(text, want_text, "the resumed stream equals the uninterrupted greedy text");

    // The old token is spent; the new one takes the session over from a live connection.
    let mut other = srv.client().await;
    other.send(&json!({"type": "session.open", "session_id": r.session_id, "resume_token": ready.resume_token})).await;
    assert_eq!(other.expect_error().await.code, ErrorCode::InvalidResumeToken);
    let r2 = other.resume(&r.session_id, &r.resume_token, json!({})).await;
    assert!(r2.resumed);
    assert_eq!(c.expect_close().await.map(|f| u16::from(f.code)), Some(1000), "the old connection is closed");
    other.generate("after", json!({"prompt": CAPITAL, "max_tokens": 4})).await;
    assert_eq!(other.collect("after").await.text(), h.greedy(CAPITAL, 4).1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_does_not_read_does_not_stall_another_session() {
    let _serial = SERIAL.lock().await;
    let h = harness();
    let srv = server().await;
    let mut slow = srv.client().await;
    slow.open().await;
    slow.generate("slow", json!({"prompt": STORY, "max_tokens": 64, "logprobs": true, "top_logprobs": 20})).await;
    // `slow` now reads nothing while another session streams at full speed.
    let mut fast = srv.client().await;
    fast.open().await;
    fast.generate("fast", json!({"prompt": COUNT, "speculation": {"source": "off"}, "max_tokens": 24})).await;
    let out = fast.collect("fast").await;
    assert_eq!(out.text(), h.greedy(COUNT, 24).1);
    let s = slow.collect("slow").await;
    s.assert_contiguous();
    assert_eq!(s.done().finish_reason, FinishReason::Length);
    assert_eq!(s.deltas.iter().map(|d| d.logprobs.as_ref().unwrap()[0].top.as_ref().unwrap().len()).min(), Some(20));
    h.wait_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_shutdown_drains_in_flight_requests() {
    let _serial = SERIAL.lock().await;
    let h = harness();
    let srv = h.start(ServerConfig::default()).await;
    let mut c = srv.client().await;
    c.open().await;
    let mut idle = srv.client().await;
    c.generate("r", json!({"prompt": COUNT, "speculation": {"source": "off"}, "max_tokens": 24})).await;
    let first = c.deltas("r", 1).await;
    let shutdown = srv.begin_shutdown(h);
    let deadline = Instant::now() + HANG;
    while !srv.state.is_draining() {
        assert!(Instant::now() < deadline, "the drain never started");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // New work is refused while the drain runs...
    c.generate("late", json!({"prompt": CAPITAL, "max_tokens": 4})).await;
    let late = c.collect("late").await;
    assert_eq!(late.error().code, ErrorCode::ShuttingDown);
    // The listener closes as the accept loop sees the drain (its own task):
    // from then on no connection is taken.
    while tokio_tungstenite::connect_async(srv.url("/v1/ws")).await.is_ok() {
        assert!(Instant::now() < deadline, "new connections are still taken while draining");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // ...but the request in flight streams to its end.
    let rest = c.collect("r").await;
    assert_eq!(first[0].text.clone() + &rest.text(), h.greedy(COUNT, 24).1);
    assert_eq!(rest.done().finish_reason, FinishReason::Length);
    // Then every socket hears shutting_down and is closed (1001).
    for sock in [&mut c, &mut idle] {
        match sock.recv().await {
            ServerMessage::Error(e) => assert_eq!(e.code, ErrorCode::ShuttingDown),
            other => panic!("{other:?}"),
        }
        assert_eq!(sock.expect_close().await.map(|f| u16::from(f.code)), Some(1001));
    }
    tokio::time::timeout(Duration::from_secs(10), shutdown).await.unwrap().unwrap();
    assert_eq!(srv.state.connection_count(), 0);
    h.wait_idle().await;
}
