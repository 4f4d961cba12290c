//! The scheduler alone: no model, no MLX. Unit tests of each rule, then a
//! seeded randomized run against a simulated engine that checks the
//! invariants every step (budgets, rows, KV reservation, fairness) and that
//! every request is admitted and finishes.
use super::*;

fn config() -> SchedulerConfig {
    SchedulerConfig {
        max_running: 4,
        step_token_budget: 64,
        step_draft_budget: 8,
        prefill_chunk: 32,
        min_prefill_chunk: 16,
        max_prefill_chunk: 128,
        kv_budget_bytes: 1 << 20,
        widened_chunk_max: 16,
        batched_kv: false,
        max_itl_inflation: 1.5,
    }
}

fn row(id: u64, session: Option<&str>) -> RowView<'_> {
    RowView {
        id: RequestId(id),
        session,
        kv_bytes: 1000,
        prompt_remaining: 0,
        uncached_prompt: 10,
        decoding: true,
        can_publish: true,
        prefill_chunk: None,
        generation_room: 100,
        draft: None,
    }
}

fn waiting(id: u64, session: Option<&str>) -> WaitingView<'_> {
    WaitingView { id: RequestId(id), session, kv_bytes: 1000 }
}

fn ids(v: &[RequestId]) -> Vec<u64> {
    v.iter().map(|r| r.0).collect()
}

#[test]
fn sessions_take_turns_for_free_rows() {
    let s = Scheduler::new(config());
    let running = [row(1, Some("a"))];
    // "a" queued three before "b" and "c" queued one each: "b" and "c"
    // (no rows yet) go first, then "a" again, in arrival order.
    let queue = [waiting(2, Some("a")), waiting(3, Some("a")), waiting(4, Some("b")), waiting(5, Some("c"))];
    assert_eq!(ids(&s.admit(&queue, &running)), vec![4, 5, 2]);
}

#[test]
fn a_request_that_does_not_fit_blocks_those_behind_it() {
    let mut c = config();
    c.kv_budget_bytes = 2500;
    let s = Scheduler::new(c);
    let big = WaitingView { id: RequestId(2), session: None, kv_bytes: 2000 };
    assert!(s.admit(&[big.clone(), waiting(3, None)], &[row(1, None)]).is_empty(), "the small one must not pass the big one");
    assert_eq!(ids(&s.admit(&[big, waiting(3, None)], &[])), vec![2]);
}

#[test]
fn batched_kv_reserves_the_longest_row_for_a_power_of_two_of_slots() {
    let mut c = config();
    c.batched_kv = true;
    let s = Scheduler::new(c);
    assert_eq!(s.kv_reservation([100, 300, 200].into_iter()), 300 * 4);
    let s = Scheduler::new(config());
    assert_eq!(s.kv_reservation([100, 300, 200].into_iter()), 600);
}

#[test]
fn decode_rows_come_first_and_paused_rows_sit_out() {
    let mut s = Scheduler::new(config());
    let mut prefilling = row(1, None);
    prefilling.decoding = false;
    prefilling.prompt_remaining = 40;
    let mut paused = row(2, None);
    paused.can_publish = false;
    let plan = s.plan(&[prefilling, paused, row(3, None)]);
    assert_eq!(plan.work, vec![(RequestId(3), RowWork::Decode { max_drafts: 0 }), (RequestId(1), RowWork::Prefill { tokens: 32 })]);
}

#[test]
fn drafts_share_the_draft_budget_and_respect_max_tokens() {
    let mut s = Scheduler::new(config());
    let drafting = |id, room| RowView { draft: Some(DraftView { ready: 6, recent_acceptance: None }), generation_room: room, ..row(id, None) };
    let plan = s.plan(&[drafting(1, 100), drafting(2, 100), drafting(3, 2)]);
    let drafts: HashMap<u64, usize> = plan
        .work
        .iter()
        .map(|(id, w)| match w {
            RowWork::Decode { max_drafts } => (id.0, *max_drafts),
            RowWork::Prefill { .. } => panic!("no prompts here"),
        })
        .collect();
    assert_eq!(drafts.values().sum::<usize>(), 8, "the step's draft budget: {drafts:?}");
    assert!(drafts[&3] <= 2, "a row near max_tokens drafts at most its room: {drafts:?}");
}

#[test]
fn while_rows_decode_long_prompts_keep_to_the_learned_allowance() {
    let mut s = Scheduler::new(SchedulerConfig { step_token_budget: 256, ..config() });
    // Teach it: 10 ms decode steps, a lone prompt at 1 ms a token: a
    // 1.5x step leaves 5 ms, 5 tokens, spent in floors of 16.
    s.record(StepTiming { decode_rows: 1, draft_tokens: 0, prefill_tokens: 0, widened: false, seconds: 0.010 });
    s.record(StepTiming { decode_rows: 0, draft_tokens: 0, prefill_tokens: 64, widened: false, seconds: 0.064 });
    let mut long = row(2, None);
    long.decoding = false;
    long.prompt_remaining = 500;
    long.uncached_prompt = 500;
    let mut short = RowView { id: RequestId(3), prompt_remaining: 50, uncached_prompt: 50, ..long.clone() };
    short.prefill_chunk = Some(64);
    let plan = s.plan(&[row(1, None), long, short]);
    let prefill: HashMap<u64, usize> = plan
        .work
        .iter()
        .filter_map(|(id, w)| match w {
            RowWork::Prefill { tokens } => Some((id.0, *tokens)),
            RowWork::Decode { .. } => None,
        })
        .collect();
    assert_eq!(prefill.get(&3), Some(&50), "a short prompt rides along whole");
    assert!(prefill.get(&2).is_none_or(|&t| t <= 16), "the long prompt keeps to the allowance: {prefill:?}");
}

/// A small deterministic generator (PCG-style), so failures repeat.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        self.0 >> 33
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

/// A request as the simulated engine tracks it.
#[derive(Clone)]
struct SimRequest {
    id: RequestId,
    session: &'static str,
    prompt: usize,
    max_tokens: usize,
    kv_bytes: usize,
    prefilled: usize,
    generated: usize,
    drafts: bool,
    paused: bool,
}

impl SimRequest {
    fn view(&self) -> RowView<'_> {
        RowView {
            id: self.id,
            session: Some(self.session),
            kv_bytes: self.kv_bytes,
            prompt_remaining: self.prompt - self.prefilled,
            uncached_prompt: self.prompt,
            decoding: self.prefilled == self.prompt,
            can_publish: !self.paused,
            prefill_chunk: None,
            generation_room: self.max_tokens.saturating_sub(self.generated + 1),
            draft: self.drafts.then_some(DraftView { ready: 4, recent_acceptance: Some(0.5) }),
        }
    }
}

const SESSIONS: [&str; 5] = ["a", "b", "c", "d", "e"];

/// Runs `steps` steps of random arrivals (then drains), checking every
/// invariant at every step.
fn simulate(seed: u64, batched_kv: bool) {
    let mut rng = Rng(seed);
    let mut c = config();
    c.max_running = 1 + rng.below(8) as usize;
    c.step_token_budget = 16 + rng.below(200) as usize;
    c.step_draft_budget = rng.below(16) as usize;
    c.kv_budget_bytes = 400_000;
    c.batched_kv = batched_kv;
    let mut s = Scheduler::new(c.clone());
    let (mut waiting, mut running, mut done): (Vec<SimRequest>, Vec<SimRequest>, Vec<RequestId>) = (Vec::new(), Vec::new(), Vec::new());
    let mut next_id = 1;
    let arrivals_until = 300;
    for step in 0..20_000 {
        if step < arrivals_until && rng.chance(40) {
            let (prompt, max_tokens) = (1 + rng.below(300) as usize, 1 + rng.below(40) as usize);
            let kv_bytes = (prompt + max_tokens) * 100;
            let request = SimRequest {
                id: RequestId(next_id),
                session: SESSIONS[rng.below(5) as usize],
                prompt,
                max_tokens,
                kv_bytes,
                prefilled: 0,
                generated: 0,
                drafts: rng.chance(30),
                paused: false,
            };
            next_id += 1;
            // The engine refuses at the door what could never fit.
            if s.fits_alone(kv_bytes) {
                waiting.push(request);
            }
        }
        if step >= arrivals_until && waiting.is_empty() && running.is_empty() {
            break;
        }
        for r in &mut running {
            r.paused = rng.chance(10);
        }

        // Admission.
        let admitted = {
            let w: Vec<_> = waiting.iter().map(|r| WaitingView { id: r.id, session: Some(r.session), kv_bytes: r.kv_bytes }).collect();
            let v: Vec<_> = running.iter().map(SimRequest::view).collect();
            s.admit(&w, &v)
        };
        if running.is_empty() && !waiting.is_empty() {
            assert!(!admitted.is_empty(), "seed {seed}: an idle engine must admit its first waiting request");
        }
        for id in admitted {
            // Fairness: no waiting request's session had fewer rows.
            let rows = |session: &str| running.iter().filter(|r| r.session == session).count();
            let pos = waiting.iter().position(|r| r.id == id).expect("admitted from the queue");
            let fewest = waiting.iter().map(|r| rows(r.session)).min().unwrap();
            assert_eq!(rows(waiting[pos].session), fewest, "seed {seed}: a session with fewer rows was passed over");
            assert!(waiting[..pos].iter().all(|r| rows(r.session) > fewest), "seed {seed}: an earlier request of a session as light was passed over");
            running.push(waiting.remove(pos));
        }
        assert!(running.len() <= c.max_running, "seed {seed}: {} rows over {}", running.len(), c.max_running);
        assert!(s.kv_reservation(running.iter().map(|r| r.kv_bytes)) <= c.kv_budget_bytes, "seed {seed}: KV budget exceeded");

        // The step.
        let plan = {
            let v: Vec<_> = running.iter().map(SimRequest::view).collect();
            s.plan(&v)
        };
        assert!(plan.max_tokens() <= c.step_token_budget, "seed {seed}: {} tokens over {}", plan.max_tokens(), c.step_token_budget);
        let drafts: usize = plan.work.iter().map(|(_, w)| if let RowWork::Decode { max_drafts } = w { *max_drafts } else { 0 }).sum();
        assert!(drafts <= c.step_draft_budget, "seed {seed}: {drafts} drafts over {}", c.step_draft_budget);
        let mut seen = std::collections::HashSet::new();
        let (mut decode_rows, mut prefill_tokens) = (0, 0);
        for (id, w) in &plan.work {
            assert!(seen.insert(*id), "seed {seed}: a row scheduled twice");
            let r = running.iter_mut().find(|r| r.id == *id).expect("plans name running rows");
            assert!(!r.paused, "seed {seed}: a paused row was scheduled");
            match *w {
                RowWork::Decode { max_drafts } => {
                    assert_eq!(r.prefilled, r.prompt, "seed {seed}: a decode before the prompt was read");
                    assert!(max_drafts == 0 || r.drafts, "seed {seed}: drafts for a row that does not speculate");
                    decode_rows += 1;
                    let accepted = rng.below(max_drafts as u64 + 1) as usize;
                    r.generated = (r.generated + 1 + accepted).min(r.max_tokens);
                }
                RowWork::Prefill { tokens } => {
                    assert!(tokens > 0 && tokens <= r.prompt - r.prefilled, "seed {seed}: a chunk past the prompt");
                    r.prefilled += tokens;
                    prefill_tokens += tokens;
                }
            }
        }
        // A machine where a step costs 10 ms plus 1 ms a token.
        let seconds = 0.010 + 0.001 * (decode_rows + prefill_tokens) as f64;
        s.record(StepTiming { decode_rows, draft_tokens: drafts, prefill_tokens, widened: plan.widened, seconds });
        let (finished, still): (Vec<_>, Vec<_>) = running.into_iter().partition(|r| r.generated >= r.max_tokens);
        done.extend(finished.iter().map(|r| r.id));
        running = still;
    }
    assert!(waiting.is_empty() && running.is_empty(), "seed {seed}: {} waiting, {} running never finished", waiting.len(), running.len());
    assert!(!done.is_empty(), "seed {seed}: nothing ran");
}

#[test]
fn randomized_runs_keep_every_invariant_and_finish_every_request() {
    for seed in 1..=200 {
        simulate(seed, seed % 2 == 0);
    }
}
