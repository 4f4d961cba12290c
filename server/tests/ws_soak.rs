//! A burst of varied traffic, then idle: the process's resident memory must
//! come back near where it started. MLX's own accounting returning to its
//! baseline is not enough: memory freed into the C heap stays resident
//! unless something hands it back (a burst of ~7,000 frames once left a
//! server at 1.2 GB from 335 MB with MLX back at its baseline).
//!
//! Prints the resident set before, at its peak, and after the burst.
mod ws_harness;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use tether::server::ServerConfig;
use ws_harness::*;

/// Resident set size of this process (the test and the server in it).
fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .expect("VmRSS in /proc/self/status");
    kib * 1024
}

fn mb(bytes: u64) -> f64 {
    bytes as f64 / (1 << 20) as f64
}

/// A prompt of about `words` words, different for every (client, turn).
fn prompt(client: usize, turn: usize, words: usize) -> String {
    (0..words).map(|w| format!("w{}", (client * 7919 + turn * 104_729 + w * 31) % 997)).collect::<Vec<_>>().join(" ")
}

/// One client's share of the burst: turns of varied shapes; some end on a
/// stop string, some ask for logprobs, some are cancelled, and the client
/// either closes its session or drops its socket at the end.
async fn client_burst(srv: &TestServer, client: usize, turns: usize) {
    let mut c = srv.client().await;
    c.open().await;
    for turn in 0..turns {
        let id = format!("c{client}-t{turn}");
        let words = 20 + (client * 13 + turn * 29) % 80;
        let mut body = json!({"prompt": prompt(client, turn, words), "max_tokens": 8 + (client + turn) % 24});
        match (client + turn) % 4 {
            0 => body["stop"] = json!(["w1", "\n"]),
            1 => {
                body["logprobs"] = json!(true);
                body["top_logprobs"] = json!(5);
            }
            2 => body["speculation"] = json!({"source": "echo"}),
            _ => {}
        }
        c.generate(&id, body).await;
        if turn % 5 == 4 {
            c.send(&json!({"type": "cancel", "request_id": id})).await;
        }
        c.collect(&id).await;
    }
    if client.is_multiple_of(2) {
        c.send(&json!({"type": "session.close"})).await;
        c.expect_close().await;
    } else {
        c.drop_connection();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resident_memory_returns_after_a_burst() {
    let h = harness_for(MODEL, &[]);
    // A short TTL, so dropped sockets' sessions (and their cached state)
    // end soon after the burst.
    let srv = Arc::new(h.start(ServerConfig { session_ttl: Duration::from_millis(500), ..ServerConfig::default() }).await);
    // Warm up once, so kernels' and tokenizer's one-time allocations are in
    // the baseline, then let the engine go idle and trim.
    client_burst(&srv, 0, 2).await;
    let idle = h.wait_idle().await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let before = rss_bytes();

    let peak = Arc::new(AtomicU64::new(before));
    let sampling = Arc::new(AtomicBool::new(true));
    let sampler = {
        let (peak, sampling) = (peak.clone(), sampling.clone());
        tokio::spawn(async move {
            while sampling.load(Ordering::Relaxed) {
                peak.fetch_max(rss_bytes(), Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };
    let started = Instant::now();
    let (clients, turns) = (8, 4);
    let burst_clients: Vec<_> = (1..=clients)
        .map(|client| {
            let srv = srv.clone();
            tokio::spawn(async move { client_burst(&srv, client, turns).await })
        })
        .collect();
    for c in burst_clients {
        c.await.unwrap();
    }
    let burst = started.elapsed();
    sampling.store(false, Ordering::Relaxed);
    sampler.await.unwrap();

    // Idle again: every session closed or expired, MLX back to its baseline
    // (the prefix cache dropped the sessions' entries), then the engine's
    // idle trim.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let s = h.wait_idle().await;
        if srv.state.session_count() == 0 && s.active_memory <= idle.active_memory + (1 << 20) {
            break;
        }
        assert!(Instant::now() < deadline, "sessions or MLX memory never went back: {} sessions, {s:?}", srv.state.session_count());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let after = rss_bytes();
    let peak = peak.load(Ordering::Relaxed).max(after);
    println!(
        "resident memory: before {:.0} MB, peak {:.0} MB during a {:.1} s burst of {} requests, after {:.0} MB",
        mb(before),
        mb(peak),
        burst.as_secs_f64(),
        clients * turns,
        mb(after)
    );
    let grown = after.saturating_sub(before);
    assert!(
        grown <= (48 << 20).max((peak - before) / 4),
        "resident memory stayed {:.0} MB over its baseline after the burst (peak {:.0} MB over)",
        mb(grown),
        mb(peak - before)
    );
}
