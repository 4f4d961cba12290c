//! One engine step, as `tether_sched` lays it out: the scheduler plans
//! (which rows decode, with how many drafts, and which read how much of
//! their prompt), the runner executes the plan on the device
//! (`runner.rs`), `apply` decides what the draws mean, and the engine
//! carries that out: rejected drafts leave the KV, tokens go to their
//! consumers, and rows that ended are finished.
use std::collections::HashMap;
use std::time::Instant;

use tether_sched::{Applied, End, EngineEvent, Finish, RowWork, StepPlan, StepTiming, Work};

use super::runner::RunTimes;
use super::speculate::{DraftRow, Proposal};
use super::worker::Engine;
use crate::models::Kv;

impl Engine {
    pub(super) fn step(&mut self) -> mlx::Result<()> {
        if self.running.is_empty() {
            return Ok(());
        }
        let started = Instant::now();
        let mut proposals = self.propose_drafts();
        let plan = self.plan(&proposals);
        if plan.is_empty() {
            return Ok(());
        }
        let mut work = self.fill_drafts(&plan.work, &mut proposals)?;
        let counts = WorkCounts::of(&work);
        self.stats.prompt_tokens += counts.prefill_tokens as u64;
        let (output, times) = self.execute(&mut work)?;
        self.stats.steps += 1;
        let applied = tether_sched::apply(&mut self.running, &work, output, Instant::now());
        self.carry_out(applied);
        self.account(started, &plan, counts, times);
        Ok(())
    }

    /// Decoding rows propose their drafts before planning, so the plan
    /// counts the drafts a row has, not the most it could have (host
    /// lookups are cheap; the draft model's run comes after the plan).
    fn propose_drafts(&mut self) -> Vec<Option<Proposal>> {
        self.running.iter_mut().map(|r| (r.progress.pending_token.is_some() && r.can_publish() && r.drafter.is_some()).then(|| r.drafts())).collect()
    }

    fn plan(&mut self, proposals: &[Option<Proposal>]) -> StepPlan {
        let views: Vec<_> = self.running.iter().zip(proposals).map(|(r, p)| r.view(p.as_ref().map(Proposal::count))).collect();
        self.scheduler.plan(&views)
    }

    /// The plan's work by running row (`None`: the row sits this step out),
    /// with each decoding row's drafts: its proposal within the plan's cap,
    /// the draft model's made in one batched round for all rows that draft
    /// with it (see [`super::speculate::DraftModel::propose`]).
    fn fill_drafts(&mut self, plan: &[(tether_sched::RequestId, RowWork)], proposals: &mut [Option<Proposal>]) -> mlx::Result<Vec<Option<Work>>> {
        let index: HashMap<_, _> = self.running.iter().enumerate().map(|(i, r)| (r.id(), i)).collect();
        let mut work: Vec<Option<Work>> = (0..self.running.len()).map(|_| None).collect();
        // (running row, depth) of rows drafting with the model, in running order.
        let mut from_model: Vec<(usize, usize)> = Vec::new();
        for (id, w) in plan {
            let i = index[id];
            work[i] = Some(match *w {
                RowWork::Prefill { tokens } => Work::Prefill { tokens },
                RowWork::Decode { max_drafts } => match proposals[i].take().map(|p| p.truncated(max_drafts)) {
                    Some(Proposal::FromModel(depth)) if depth > 0 => {
                        from_model.push((i, depth));
                        Work::Decode { drafts: Vec::new() }
                    }
                    Some(Proposal::Ready(drafts)) => Work::Decode { drafts },
                    _ => Work::Decode { drafts: Vec::new() },
                },
            });
        }
        let Some(draft) = &self.draft else { return Ok(work) };
        if from_model.is_empty() {
            return Ok(work);
        }
        from_model.sort_unstable();
        let mut rows: Vec<DraftRow<'_>> = Vec::new();
        let mut wanted = from_model.iter().peekable();
        for (i, row) in self.running.iter_mut().enumerate() {
            let Some(&&(_, depth)) = wanted.peek().filter(|(r, _)| *r == i) else { continue };
            wanted.next();
            let cache = row.drafter.as_mut().and_then(|d| d.model_cache()).expect("model-drafting rows have a draft cache");
            rows.push(DraftRow { history: &row.progress.tokens, cache, depth });
        }
        let proposals = draft.propose(&mut rows)?;
        for (&(i, _), drafts) in from_model.iter().zip(proposals) {
            if let Some(Work::Decode { drafts: slot }) = &mut work[i] {
                *slot = drafts;
            }
        }
        Ok(work)
    }

    /// Carries out what `apply` decided: drops rejected drafts from each
    /// row's KV (and its draft model's), sends the tokens, and finishes the
    /// rows that ended (last index first, so the others' indices hold).
    fn carry_out(&mut self, applied: Applied) {
        let c = applied.counts;
        self.stats.generated_tokens += c.generated_tokens;
        self.stats.drafted_tokens += c.drafted_tokens;
        self.stats.accepted_draft_tokens += c.accepted_draft_tokens;
        self.stats.spec_decode_forwards += c.spec_decode_forwards;
        self.stats.spec_decode_tokens += c.spec_decode_tokens;
        let mut ended = Vec::new();
        for update in applied.updates {
            let row = &mut self.running[update.row];
            if update.rejected_drafts > 0 {
                row.kv.trim(update.rejected_drafts);
            }
            if let (Some(drafter), Some(verified)) = (&mut row.drafter, update.verified) {
                drafter.verified(verified);
            }
            let mut end = update.end;
            // can_publish() held when the row was scheduled, so this fits;
            // a consumer that went away meanwhile cancels its row.
            if !update.tokens.is_empty() && row.events.try_send(EngineEvent::Tokens { ids: update.tokens, logprobs: update.logprobs }).is_err() {
                end = Some(End::Finished(Finish::Cancelled));
            }
            if let Some(end) = end {
                ended.push((update.row, end));
            }
        }
        for (i, end) in ended.into_iter().rev() {
            match end {
                End::Finished(reason) => self.finish(i, reason),
                End::Failed(error) => self.fail(i, error),
            }
        }
    }

    /// Teaches the scheduler the step's time, and records where it went.
    fn account(&mut self, started: Instant, plan: &StepPlan, counts: WorkCounts, times: RunTimes) {
        let RunTimes { built, evaluated, masks_ms, constrained_rows, primitives } = times;
        let seconds = started.elapsed().as_secs_f64();
        let WorkCounts { decode_rows, draft_tokens, prefill_tokens } = counts;
        self.scheduler.record(StepTiming { decode_rows, draft_tokens, prefill_tokens, widened: plan.widened, seconds });
        if self.trace_steps {
            // One line per step, for tuning the prefill allowance on a new machine.
            let next = self.scheduler.learned_allowance();
            let widened = plan.widened;
            let ms = |from: Instant, to: Instant| to.duration_since(from).as_secs_f64() * 1e3;
            eprintln!(
                "[step] decode_rows={decode_rows} constrained_rows={constrained_rows} draft_tokens={draft_tokens} prefill_tokens={prefill_tokens} ms={:.2} masks_ms={masks_ms:.2} build_ms={:.2} eval_ms={:.2} primitives={} widened={widened} next_allowance={next:?}",
                seconds * 1e3,
                ms(started, built),
                ms(built, evaluated),
                primitives.unwrap_or(0),
            );
        }
        let micros = |from: Instant, to: Instant| to.duration_since(from).as_micros() as u64;
        let times = &mut self.stats.step_time;
        times.build_us += micros(started, built);
        times.eval_us += micros(built, evaluated);
        times.publish_us += micros(evaluated, Instant::now());
    }
}

/// What a step's work holds, for the cost models and traces.
#[derive(Clone, Copy, Default)]
struct WorkCounts {
    decode_rows: usize,
    draft_tokens: usize,
    prefill_tokens: usize,
}

impl WorkCounts {
    fn of(work: &[Option<Work>]) -> WorkCounts {
        let mut c = WorkCounts::default();
        for w in work.iter().flatten() {
            match w {
                Work::Prefill { tokens } => c.prefill_tokens += tokens,
                Work::Decode { drafts } => {
                    c.decode_rows += 1;
                    c.draft_tokens += drafts.len();
                }
            }
        }
        c
    }
}
