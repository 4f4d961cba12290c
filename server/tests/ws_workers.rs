//! Two engine workers behind one server: sessions spread over both, each
//! session stays on its worker (its second turn hits that worker's prefix
//! cache), and a failed worker ends only its own sessions' requests.
mod ws_harness;

use protocol::ServerMessage;
use serde_json::json;
use tether::engine::EnginePool;
use tether::server::ServerConfig;
use ws_harness::*;

const COUNT: &str = "1, 2, 3, 4,";
/// Long enough (over 32 tokens) to fill whole prefix-cache blocks.
const LONG: &str = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18,";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_are_pinned_to_one_worker_each() {
    let h = harness_for(MODEL, &[(COUNT, 4)]);
    let second = h.second_engine(MODEL);
    let pool = EnginePool::new(vec![h.engine.clone(), second.clone()]);
    let server = h.start_with_engines(ServerConfig::default(), pool.clone()).await;

    let mut by_worker: [Vec<(Client, String)>; 2] = [Vec::new(), Vec::new()];
    for _ in 0..16 {
        let mut c = server.client().await;
        let ready = c.open().await;
        let w = pool.worker_index(&ready.session_id);
        by_worker[w].push((c, ready.session_id));
    }
    assert!(by_worker.iter().all(|v| !v.is_empty()), "16 sessions all landed on one worker");

    // Each session's second turn finds its first turn in its worker's cache.
    for (w, sessions) in by_worker.iter_mut().enumerate() {
        let (c, id) = &mut sessions[0];
        c.generate("t1", json!({"prompt": LONG, "max_tokens": 4})).await;
        let t1 = c.collect("t1").await;
        let turn2 = format!("{LONG}{} 30, 31,", t1.text());
        c.generate("t2", json!({"prompt": turn2, "max_tokens": 2})).await;
        let t2 = c.collect("t2").await;
        assert!(t2.done().usage.cached_tokens > 0, "session {id} on worker {w} missed its own cache");
    }
    let (a, b) = (h.engine.stats().await.unwrap(), second.stats().await.unwrap());
    assert!(a.prefix.hits >= 1 && b.prefix.hits >= 1, "{:?} / {:?}", a.prefix, b.prefix);

    // Worker 1 fails: its sessions get an error frame, worker 0's still stream.
    second.shutdown_and_join();
    let (c, _) = &mut by_worker[1][0];
    c.generate("after", json!({"prompt": COUNT, "max_tokens": 2})).await;
    match c.recv_matching(|m| m.request_id() == Some("after")).await {
        ServerMessage::Error(e) => assert_eq!(e.request_id.as_deref(), Some("after")),
        other => panic!("expected an error on the failed worker, got {other:?}"),
    }
    let (c, _) = &mut by_worker[0][0];
    c.generate("after", json!({"prompt": COUNT, "max_tokens": 2})).await;
    assert_eq!(c.collect("after").await.done().usage.completion_tokens, 2);
}
