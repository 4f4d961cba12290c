//! The engine thread with the real model: requests run concurrently give the
//! same greedy tokens as each alone; cancel and dropped receivers free rows.
mod common;

use std::time::Duration;

use common::*;
use tether::engine::{EngineConfig, EngineError, EngineEvent, EngineHandle, Finish, KvLayout, Scope, StopReason, SubmitRequest};
use tether::generate::greedy_tokens;
use tether::models::{load_transformer, LoadOptions};

fn start(config: EngineConfig) -> EngineHandle {
    start_smollm2_engine(config)
}

fn request(prompt: Vec<u32>, max_tokens: usize) -> SubmitRequest {
    SubmitRequest::new(prompt, max_tokens)
}

async fn collect(mut rx: tokio::sync::mpsc::Receiver<EngineEvent>) -> (Vec<u32>, Option<Finish>) {
    let mut ids = Vec::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            EngineEvent::Tokens { ids: t, .. } => ids.extend(t),
            EngineEvent::Finished(f) => return (ids, Some(f.reason)),
            EngineEvent::Failed(e) => panic!("request failed: {e}"),
            EngineEvent::Started { .. } => {}
        }
    }
    (ids, None)
}

fn prompts() -> Vec<Vec<u32>> {
    let fx = read_json("greedy/smollm2.json");
    fx["cases"].as_array().unwrap().iter().map(|c| ids(&c["prompt_ids"])).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_match_solo_greedy() {
    concurrent_requests_match_solo_greedy_with(EngineConfig { kv_layout: KvLayout::Rows, ..Default::default() }).await;
}

/// The same with every row in a KV slot of one shared buffer (the GPU
/// layout), run here on the CPU: rows read their prompts in their slots
/// beside decoding ones, leave, and others reuse their slots mid-run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_match_solo_greedy_in_batched_kv() {
    concurrent_requests_match_solo_greedy_with(EngineConfig { kv_layout: KvLayout::Batched, ..Default::default() }).await;
}

/// Batched, with no room for the shared attention's scores: every prompt
/// chunk attends alone, over its own slot, beside the shared attention of
/// the decoding slots.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_match_solo_greedy_with_chunks_attending_alone() {
    concurrent_requests_match_solo_greedy_with(EngineConfig { kv_layout: KvLayout::Batched, shared_attention_scores: 1, ..Default::default() }).await;
}

/// Batched: a long prompt joins decoding rows and is read in chunks that
/// attend alone (over the slot's whole capacity, queries padded to a
/// multiple of 16), while the other rows keep decoding in the shared
/// attention; every row's greedy tokens equal its own alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_prompt_read_alone_beside_decoding_rows_matches_solo_greedy() {
    let short = prompts();
    // ~300 tokens: the fixture prompts end to end, a few times over.
    let long: Vec<u32> = short.iter().flatten().copied().cycle().take(301).collect();
    mlx::set_default_device(mlx::Device::Cpu).unwrap();
    let model = load_transformer(&model_path("smollm2-135m"), LoadOptions::for_device(mlx::Device::Cpu)).unwrap();
    let want_long = greedy_tokens(&model, &long, 8).unwrap();
    let want_short: Vec<Vec<u32>> = short[..3].iter().map(|p| greedy_tokens(&model, p, 40).unwrap()).collect();
    drop(model);

    // 100-token chunks (the last one 1), no allowance, and shared scores
    // too few for any chunk: every chunk of the long prompt attends alone.
    let engine =
        start(EngineConfig { kv_layout: KvLayout::Batched, prefill_chunk: 100, max_itl_inflation: 1.0, shared_attention_scores: 1, ..Default::default() });
    let mut streams: Vec<_> = short[..3].iter().map(|p| engine.submit(request(p.clone(), 40)).unwrap().events).collect();
    // The short rows decode before the long prompt comes.
    for rx in &mut streams {
        while !matches!(rx.recv().await, Some(EngineEvent::Tokens { .. })) {}
    }
    let long_rx = engine.submit(request(long, 8)).unwrap().events;
    let (got_long, _) = collect(long_rx).await;
    assert_eq!(got_long, want_long, "the long prompt");
    for (i, (rx, want)) in streams.into_iter().zip(want_short).enumerate() {
        let (rest, finish) = collect(rx).await;
        assert_eq!(finish, Some(Finish::Length));
        assert_eq!(rest[..], want[want.len() - rest.len()..], "short request {i}");
    }
}

async fn concurrent_requests_match_solo_greedy_with(config: EngineConfig) {
    let kv_layout = config.kv_layout;
    let prompts = prompts();
    // The reference: each prompt alone through the plain loop, on this thread.
    mlx::set_default_device(mlx::Device::Cpu).unwrap();
    let model = load_transformer(&model_path("smollm2-135m"), LoadOptions::for_device(mlx::Device::Cpu)).unwrap();
    let solo: Vec<Vec<u32>> = prompts.iter().map(|p| greedy_tokens(&model, p, 12).unwrap()).collect();
    drop(model);

    // Small chunks and budget so prefills interleave with decodes across steps.
    let engine = start(EngineConfig { prefill_chunk: 16, min_prefill_chunk: 1, step_token_budget: 24, ..config });
    let mut handles = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        let chunk = if i % 2 == 0 { Some(3) } else { None };
        // Uneven lengths, so rows finish (and free slots) while others run.
        let rx = engine.submit(SubmitRequest { prefill_chunk: chunk, ..request(p.clone(), 12 - i % 3) }).unwrap().events;
        handles.push(tokio::spawn(collect(rx)));
        // Join some requests mid-way through the others.
        tokio::time::sleep(Duration::from_millis(30 * i as u64)).await;
    }
    for (i, (h, want)) in handles.into_iter().zip(solo.clone()).enumerate() {
        let (got, finish) = h.await.unwrap();
        assert_eq!(finish, Some(Finish::Length));
        assert_eq!(got, want[..12 - i % 3], "request {i} ({kv_layout:?})");
    }
    // A second wave reuses the slots the first one freed.
    let rx = engine.submit(request(prompts[0].clone(), 12)).unwrap().events;
    let (again, _) = collect(rx).await;
    assert_eq!(again, solo[0]);
}

/// Batched, each plain decode step is queued before the one before it is
/// read (the lookahead): greedy and seeded rows, one ending early on a stop
/// id, one with log-probabilities, give the same tokens as with it off, and
/// the lookahead is both used and dropped (when a row joins).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lookahead_steps_give_the_same_tokens_as_plain_steps() {
    let prompts = prompts();
    let seeded = |seed| tether::sample::SamplingParams { temperature: 0.9, top_p: 0.95, seed: Some(seed), ..Default::default() };
    let requests = || {
        vec![
            // Greedy " Paris" (7042) comes a few tokens in for this prompt.
            SubmitRequest { stop_ids: vec![7042], ..request(prompts[0].clone(), 20) },
            SubmitRequest { logprobs: Some(2), ..request(prompts[1].clone(), 13) },
            // Long enough to be still decoding when the late row joins, however
            // slowly a busy machine runs this thread.
            SubmitRequest { sampling: seeded(7), ..request(prompts[2].clone(), 48) },
            SubmitRequest { sampling: seeded(11), ..request(prompts[3 % prompts.len()].clone(), 9) },
        ]
    };
    let mut runs = Vec::new();
    for lookahead in [false, true] {
        let engine = start(EngineConfig { kv_layout: KvLayout::Batched, lookahead, ..Default::default() });
        let mut streams: Vec<_> = requests().into_iter().map(|r| engine.submit(r).unwrap().events).collect();
        // A row joining the decoding ones drops the lookahead in flight.
        // Once every row that emits has decoded a token past its prompt's
        // (the first ends on its stop id at once), so lookaheads are queued.
        let mut first = Vec::new();
        for rx in &mut streams[1..] {
            let mut ids = Vec::new();
            while ids.len() < 2 {
                match rx.recv().await {
                    Some(EngineEvent::Tokens { ids: more, .. }) => ids.extend(more),
                    Some(_) => {}
                    None => panic!("a row ended before its second token"),
                }
            }
            first.push(ids);
        }
        streams.push(engine.submit(request(prompts[1].clone(), 6)).unwrap().events);
        let mut outputs = Vec::new();
        for rx in streams {
            outputs.push(collect(rx).await);
        }
        for (output, first) in outputs[1..].iter_mut().zip(first) {
            output.0.splice(0..0, first);
        }
        let stats = engine.stats().await.unwrap();
        runs.push((outputs, stats.lookahead_served, stats.lookahead_dropped));
    }
    let (plain, served_off, _) = &runs[0];
    let (ahead, served, dropped) = &runs[1];
    assert_eq!(ahead, plain);
    assert_eq!(*served_off, 0);
    assert!(*served > 5 && *dropped > 0, "served {served}, dropped {dropped}");
    assert_eq!(plain[0].1, Some(Finish::Stop));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_and_dropped_receivers_free_rows() {
    let engine = start(EngineConfig::default());
    let prompt = prompts()[0].clone();
    let submitted = engine.submit(request(prompt.clone(), 10_00)).unwrap();
    let mut rx = submitted.events;
    // Wait for the first token, then cancel.
    loop {
        if let Some(EngineEvent::Tokens { .. }) = rx.recv().await {
            break;
        }
    }
    submitted.stop.stop(StopReason::Cancel);
    let (_, finish) = collect(rx).await;
    assert_eq!(finish, Some(Finish::Cancelled));

    let rx = engine.submit(request(prompt, 1000)).unwrap().events;
    drop(rx);
    for _ in 0..100 {
        let s = engine.stats().await.unwrap();
        if s.running == 0 && s.waiting == 0 {
            assert_eq!(s.kv_bytes, 0);
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("rows were not freed: {:?}", engine.stats().await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_ids_and_context_limit() {
    let engine = start(EngineConfig::default());
    let prompt = prompts()[0].clone();
    // Greedy " Paris" is 7042 for this prompt: stopping on it yields nothing.
    let rx = engine.submit(SubmitRequest { stop_ids: vec![7042], ..request(prompt.clone(), 5) }).unwrap().events;
    let (ids, finish) = collect(rx).await;
    assert!(ids.is_empty());
    assert_eq!(finish, Some(Finish::Stop));
    let too_long = request(vec![1; 10], engine.info().context_length);
    assert!(engine.submit(too_long).is_err());
}

/// Admission holds requests back while the KV they may grow to would pass
/// the budget: with per-row caches the rows' sum; batched, slots (a power
/// of two) as long as the longest row. A request that can never fit gets a
/// clear error, and the engine carries on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_budget_bounds_running_rows_in_both_layouts() {
    let probe = start(EngineConfig::default());
    let block_bytes = probe.info().kv_bytes_per_token * tether::models::KV_CAPACITY_STEP;
    probe.shutdown_and_join();
    let prompt = prompts().remove(0);
    // Each request fits one cache block; the budget holds three.
    let max_tokens = 24;
    assert!(prompt.len() + max_tokens <= tether::models::KV_CAPACITY_STEP);
    for (kv_layout, limit) in [(KvLayout::Rows, 3), (KvLayout::Batched, 2)] {
        let engine = start(EngineConfig { kv_budget_bytes: 3 * block_bytes, kv_layout, ..Default::default() });
        let handles: Vec<_> = (0..4).map(|_| tokio::spawn(collect(engine.submit(request(prompt.clone(), max_tokens)).unwrap().events))).collect();
        let mut most = 0;
        while !handles.iter().all(|h| h.is_finished()) {
            most = most.max(engine.stats().await.unwrap().running);
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        for h in handles {
            assert_eq!(h.await.unwrap().1, Some(Finish::Length));
        }
        assert_eq!(most, limit, "{kv_layout:?}: rows running at once");

        let mut rx = engine.submit(request(prompt.clone(), 3 * tether::models::KV_CAPACITY_STEP)).unwrap().events;
        match rx.recv().await {
            Some(EngineEvent::Failed(e)) => assert!(matches!(e, EngineError::OverKvBudget { .. }), "{e}"),
            other => panic!("a request over the budget must fail, got {other:?}"),
        }
        let (again, _) = collect(engine.submit(request(prompt.clone(), 4)).unwrap().events).await;
        assert_eq!(again.len(), 4);
    }
}

/// While more long prompts wait than rows decode, the prefill allowance
/// (which spares the decoding rows a prompt's cost) widens by that ratio:
/// six 100-token prompts joining one decoding row all move 16 tokens a step
/// and start within a few steps of what their length needs. Held to the
/// allowance alone (kept near one 16-token chunk a step by a tight
/// inflation target), they would share those 16 tokens and take about six
/// times as many steps.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_prompts_that_outnumber_decoding_rows_widen_the_allowance() {
    let engine = start(EngineConfig { max_itl_inflation: 1.05, ..Default::default() });
    let base = prompts()[0].clone();
    let decoding = engine.submit(request(base.clone(), 1000)).unwrap();
    let mut rx = decoding.events;
    // A client reading its stream throughout; the first tokens tell that
    // the row decodes and the allowance has decode-only steps to go by.
    let (decoded_tx, decoded_rx) = tokio::sync::oneshot::channel();
    let reader = tokio::spawn(async move {
        let (mut seen, mut decoded_tx) = (0, Some(decoded_tx));
        while let Some(ev) = rx.recv().await {
            if let EngineEvent::Tokens { ids, .. } = ev {
                seen += ids.len();
                if seen >= 8 {
                    decoded_tx.take().map(|tx| tx.send(()));
                }
            }
        }
    });
    let within = |secs| Duration::from_secs(secs);
    tokio::time::timeout(within(60), decoded_rx).await.expect("the first row decodes").unwrap();
    let before = engine.stats().await.unwrap().steps;
    let long_prompt = |i: u32| -> Vec<u32> { base.iter().cycle().take(100).enumerate().map(|(j, &t)| if j == 1 { t.wrapping_add(i) } else { t }).collect() };
    let waiting: Vec<_> = (0..6).map(|i| engine.submit(request(long_prompt(i), 1)).unwrap().events).collect();
    for rx in waiting {
        let (ids, finish) = tokio::time::timeout(within(60), collect(rx)).await.expect("every waiting prompt finishes");
        assert_eq!((ids.len(), finish), (1, Some(Finish::Length)));
    }
    let steps = engine.stats().await.unwrap().steps - before;
    decoding.stop.stop(StopReason::Cancel);
    reader.await.unwrap();
    // 100 tokens in 16-token chunks is 7 steps; a few more pass before the
    // engine reads the submissions and the last stats request (7-9 seen).
    // Unwidened, the same run takes about 40.
    assert!(steps <= 12, "six waiting 100-token prompts took {steps} steps beside one decoding row");
}

/// When `rx`'s request was seated in a row (its `Started` event), reading
/// its events to the end.
async fn started_at(mut rx: tokio::sync::mpsc::Receiver<EngineEvent>) -> std::time::Instant {
    let mut started = None;
    while let Some(ev) = rx.recv().await {
        match ev {
            EngineEvent::Started { .. } => started = Some(std::time::Instant::now()),
            EngineEvent::Finished(_) => break,
            EngineEvent::Failed(e) => panic!("request failed: {e}"),
            EngineEvent::Tokens { .. } => {}
        }
    }
    started.expect("the request was seated")
}

/// Sessions take turns for free rows: with two rows, session "a" queues
/// four requests, then session "b" one; "b" is seated with the first rows
/// to free up, before a's fourth request. (In arrival order it would wait
/// for all four of a's: a3 and a4 take the first two free rows, and "b"
/// starts some 16 steps after a4.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_with_many_requests_takes_turns_with_others_for_rows() {
    let engine = start(EngineConfig { max_running: 2, ..Default::default() });
    let prompt = prompts()[0].clone();
    let submit = |session: &str, max_tokens: usize| {
        let rx = engine.submit(SubmitRequest { session: Some(session.into()), ..request(prompt.clone(), max_tokens) }).unwrap().events;
        tokio::spawn(started_at(rx))
    };
    let a: Vec<_> = (0..4).map(|_| submit("a", 16)).collect();
    let b = submit("b", 12);
    let b = tokio::time::timeout(Duration::from_secs(120), b).await.expect("b finished").unwrap();
    let mut a_started = Vec::new();
    for task in a {
        a_started.push(tokio::time::timeout(Duration::from_secs(120), task).await.expect("a finished").unwrap());
    }
    assert!(b < a_started[3], "b was seated after all of a's requests");
}

/// A turn the edge ends on a stop string keeps its KV state for the
/// session's next turn, like a turn ended by an end token; a cancelled one
/// does not. Both stop after the same tokens; the next turn's prompt
/// extends what each had read and generated.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_ended_on_a_stop_string_is_cached_and_a_cancelled_one_is_not() {
    for kv_layout in [KvLayout::Rows, KvLayout::Batched] {
        let engine = start(EngineConfig { kv_layout, ..Default::default() });
        let prompt: Vec<u32> = prompts()[0].iter().cycle().take(40).copied().collect();
        let mut cached_after = Vec::new();
        for (session, reason) in [("stopped", StopReason::StopString), ("cancelled", StopReason::Cancel)] {
            let scoped = |prompt: Vec<u32>, max_tokens| SubmitRequest { cache_scope: Some(Scope::Session(session.into())), ..request(prompt, max_tokens) };
            let turn = engine.submit(scoped(prompt.clone(), 1000)).unwrap();
            let mut rx = turn.events;
            let mut generated = Vec::new();
            while generated.len() < 12 {
                match rx.recv().await {
                    Some(EngineEvent::Tokens { ids, .. }) => generated.extend(ids),
                    Some(EngineEvent::Started { .. }) => {}
                    other => panic!("{kv_layout:?}: the turn ended early: {other:?}"),
                }
            }
            turn.stop.stop(reason);
            let (_, finish) = collect(rx).await;
            let expected = if reason == StopReason::StopString { Finish::Stop } else { Finish::Cancelled };
            assert_eq!(finish, Some(expected), "{kv_layout:?}");
            let next: Vec<u32> = prompt.iter().chain(&generated[..10]).chain(&prompt[..8]).copied().collect();
            let mut rx = engine.submit(scoped(next, 1)).unwrap().events;
            let cached = loop {
                match rx.recv().await.expect("the next turn finishes") {
                    EngineEvent::Finished(info) => break info.cached_tokens,
                    EngineEvent::Failed(e) => panic!("{kv_layout:?}: {e}"),
                    _ => {}
                }
            };
            cached_after.push(cached);
        }
        // Cached in whole 16-token blocks: the prompt and the tokens
        // generated before the stop, up to the last full block.
        assert_eq!(cached_after, vec![48, 0], "{kv_layout:?}: tokens cached after a stopped and after a cancelled turn");
    }
}

/// A session's next turn is lent its own history (no copy: it leaves the
/// prefix cache while the turn runs). When that turn is cancelled, the
/// history goes back as it was lent, and a later turn continues from it as
/// the cancelled one did; what the cancelled turn computed is not kept.
/// Requests of one session that run together are never lent the entry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_turn_gives_back_the_history_it_was_lent() {
    let engine = start(EngineConfig { kv_layout: KvLayout::Rows, ..Default::default() });
    let scoped = |prompt: Vec<u32>, max_tokens| SubmitRequest { cache_scope: Some(Scope::Session("s".into())), ..request(prompt, max_tokens) };
    let lent = || async { engine.stats().await.expect("the engine runs").prefix.lent };
    let first: Vec<u32> = prompts()[0].iter().cycle().take(40).copied().collect();
    let (answer, _) = run_request(&engine, scoped(first.clone(), 8)).await;
    // The stored history is 47 tokens (the last answer token is not fed
    // back): two whole 16-token blocks match.
    let second: Vec<u32> = first.iter().chain(&answer).chain(prompts()[1].iter().cycle().take(24)).copied().collect();
    let turn = engine.submit(scoped(second.clone(), 1000)).unwrap();
    let mut rx = turn.events;
    let mut cancelled_tokens = Vec::new();
    while cancelled_tokens.len() < 4 {
        match rx.recv().await {
            Some(EngineEvent::Tokens { ids, .. }) => cancelled_tokens.extend(ids),
            Some(EngineEvent::Started { .. }) => {}
            other => panic!("the turn ended early: {other:?}"),
        }
    }
    assert_eq!(lent().await, 1, "the second turn was lent the session's history");
    turn.stop.stop(StopReason::Cancel);
    assert_eq!(collect(rx).await.1, Some(Finish::Cancelled));
    let (again, info) = run_request(&engine, scoped(second.clone(), 4)).await;
    assert_eq!(info.cached_tokens, 32, "the lent 32 tokens came back; the cancelled turn's own 40 prompt tokens did not");
    assert_eq!(again, cancelled_tokens[..4], "the history that came back continues as the cancelled turn did");
    assert_eq!(lent().await, 2);
    // While another request of the session runs, a turn reads the history
    // as a snapshot: the entry stays for the others.
    let other = engine.submit(scoped(prompts()[2].clone(), 1000)).unwrap();
    let mut rx = other.events;
    while !matches!(rx.recv().await, Some(EngineEvent::Tokens { .. })) {}
    let third: Vec<u32> = second.iter().chain(&again).chain(&first[..8]).copied().collect();
    let (_, info) = run_request(&engine, scoped(third.clone(), 2)).await;
    assert_eq!(info.cached_tokens, 64);
    assert_eq!(lent().await, 2, "not lent beside another request of the session");
    other.stop.stop(StopReason::Cancel);
    assert_eq!(collect(rx).await.1, Some(Finish::Cancelled));
}
