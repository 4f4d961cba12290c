//! One engine step: carry out the scheduler's plan. All rows' graphs are
//! built lazily and evaluated together with ONE `eval`, then the sampled
//! ids are read back in one copy and published.
use std::collections::HashMap;
use std::time::Instant;

use super::api::{EngineError, EngineEvent, Finish};
use super::row::{logprobs_of, Work};
use super::scheduler::{RowWork, StepTiming};
use super::speculate::{self, DraftRow, Proposal};
use super::step_masks::{cut_forbidden_drafts, MasksInFlight, RowMasks};
use super::worker::Engine;
use crate::model::{BatchedRows, KvBatch, RowInput};

/// A row's part in this step, as the runner carries it out.
struct Scheduled {
    row: usize,
    /// Whether its logits are sampled (decode, or the last prefill chunk).
    samples: bool,
    /// Whether it decodes (a verification, drafts or not) rather than prefills.
    decode: bool,
    /// Draft tokens fed after its pending token.
    drafts: Vec<u32>,
    /// Where its logits come back.
    logits_at: LogitsAt,
    /// A constrained row's allowed tokens, one mask per sampled position.
    masks: Option<RowMasks>,
}

/// How a row's part in a step ended it.
enum End {
    Finished(Finish),
    Failed(EngineError),
}

enum LogitsAt {
    /// A slot of the batched rows.
    Slot(usize),
    /// An entry of the per-row inputs.
    Row(usize),
}

/// The KV buffers a step writes that no draw depends on: those of rows that
/// read a prompt chunk without sampling, and the batched KV when it ran.
fn written_kv<'a>(scheduled: &[Scheduled], running: &'a [super::row::Row], batch: Option<&'a KvBatch>) -> Vec<&'a mlx::Array> {
    let mut out: Vec<&mlx::Array> = scheduled.iter().filter(|s| !s.samples).flat_map(|s| running[s.row].cache.buffers()).collect();
    out.extend(batch.map(KvBatch::buffers).unwrap_or_default());
    out
}

impl Engine {
    pub(super) fn step(&mut self) -> mlx::Result<()> {
        if self.running.is_empty() {
            return Ok(());
        }
        let started = Instant::now();
        // Decoding rows propose their drafts before planning, so the plan
        // counts the drafts a row has, not the most it could have (host
        // lookups are cheap; the draft model's run comes after the plan).
        let mut proposals: Vec<Option<Proposal>> =
            self.running.iter_mut().map(|r| (r.pending_token.is_some() && r.can_publish() && r.draft.is_some()).then(|| r.drafts())).collect();
        let views: Vec<_> = self
            .running
            .iter()
            .zip(&proposals)
            .map(|(r, p)| {
                let mut view = r.view();
                if let (Some(d), Some(p)) = (&mut view.draft, p) {
                    d.ready = p.count();
                }
                view
            })
            .collect();
        let plan = self.scheduler.plan(&views);
        drop(views);
        if plan.is_empty() {
            return Ok(());
        }
        let mut work = self.fill_drafts(&plan.work, &mut proposals)?;
        let mut ended: Vec<(usize, End)> = Vec::new();
        for (i, e) in cut_forbidden_drafts(&mut self.running, &mut work) {
            work[i] = None;
            ended.push((i, End::Failed(EngineError::Constraint(e))));
        }
        // Constrained rows' masks are made while the forward is built and
        // evaluated: the forward does not need them, only the draws after it.
        let masks_in_flight = MasksInFlight::start(&mut self.running, &work);
        let (mut decode_rows, mut draft_tokens, mut prefill_tokens) = (0, 0, 0);
        for w in work.iter().flatten() {
            match w {
                Work::Prefill { tokens } => prefill_tokens += tokens,
                Work::Decode { drafts } => {
                    decode_rows += 1;
                    draft_tokens += drafts.len();
                }
            }
        }
        self.stats.prompt_tokens += prefill_tokens as u64;

        // One forward for every scheduled row, then one eval.
        let mut inputs = Vec::new();
        let mut scheduled: Vec<Scheduled> = Vec::new();
        let slots = self.batch.as_ref().map_or(0, KvBatch::slots);
        let (mut slot_tokens, mut slot_logits_wanted) = (vec![Vec::new(); slots], vec![0; slots]);
        for (i, row) in self.running.iter_mut().enumerate() {
            let Some(work) = work[i].take() else { continue };
            let tokens: Vec<i32> = row.take_input(&work)?.into_iter().map(|t| t as i32).collect();
            let samples = row.samples_after(&work);
            let (decode, drafts) = match work {
                Work::Decode { drafts } => (true, drafts),
                Work::Prefill { .. } => (false, Vec::new()),
            };
            let logits_at = match row.slot {
                Some(slot) => {
                    slot_tokens[slot] = tokens;
                    slot_logits_wanted[slot] = if samples { 1 + drafts.len() } else { 0 };
                    LogitsAt::Slot(slot)
                }
                None => {
                    let ids = mlx::Array::from_i32(&tokens, &[1, tokens.len()])?;
                    inputs.push(RowInput { ids, cache: &mut row.cache, n_logits: 1 + drafts.len() });
                    LogitsAt::Row(inputs.len() - 1)
                }
            };
            scheduled.push(Scheduled { row: i, samples, decode, drafts, logits_at, masks: None });
        }
        let batched = match &mut self.batch {
            Some(kv) if slot_tokens.iter().any(|t| !t.is_empty()) => {
                Some(BatchedRows { kv, tokens: slot_tokens, logits: slot_logits_wanted, shared_scores: self.config.shared_attention_scores })
            }
            _ => None,
        };
        let ran_batched = batched.is_some();
        let step_logits = self.model.forward_step(batched, &mut inputs)?;
        drop(inputs);
        let mut slot_logits = step_logits.batched;
        let mut row_logits: Vec<Option<mlx::Array>> = step_logits.rows.into_iter().map(Some).collect();
        // A prompt chunk in a slot that does not finish the prompt wants no logits.
        let logits: Vec<Option<mlx::Array>> = scheduled
            .iter()
            .map(|s| match s.logits_at {
                LogitsAt::Slot(slot) => slot_logits[slot].take(),
                LogitsAt::Row(k) => row_logits[k].take(),
            })
            .collect();

        let masks_started = Instant::now();
        if let Some(in_flight) = masks_in_flight {
            // Masks not ready yet: the forward goes to MLX first, and they
            // finish beside its evaluation (handing it over holds this
            // thread: on a GPU it launches every kernel; on the CPU MLX waits
            // while more than a few operations are queued). Ready: the draws
            // join the forward's one evaluation, which saves a round trip.
            if !in_flight.is_finished() {
                let batch = self.batch.as_ref().filter(|_| ran_batched);
                let mut outputs: Vec<&mlx::Array> = logits.iter().flatten().collect();
                outputs.extend(written_kv(&scheduled, &self.running, batch));
                mlx::async_eval(&outputs)?;
            }
            for (row, made) in in_flight.finish(&mut self.running) {
                let s = scheduled.iter_mut().find(|s| s.row == row).expect("a row with masks is scheduled");
                match made {
                    Ok(m) => s.masks = Some(m),
                    Err(e) => {
                        // Its forward ran; the row ends here and its state is dropped.
                        s.samples = false;
                        ended.push((s.row, End::Failed(EngineError::Constraint(e))));
                    }
                }
            }
        }
        let masks_ms = masks_started.elapsed().as_secs_f64() * 1e3;
        let constrained_rows = scheduled.iter().filter(|s| s.masks.is_some()).count();

        // Each sampling row's draws, lazily: one per position it verifies
        // (the pending token's successor, then one after each draft), each
        // the argmax or the position-keyed sample (see Sampler::draw).
        // (index into `scheduled`, draws, logits kept for logprobs)
        let mut draws: Vec<(usize, mlx::Array, Option<mlx::Array>)> = Vec::new();
        // Every constrained position's allowed set, expanded on the device at once.
        let constrained: Vec<&RowMasks> = scheduled.iter().filter(|s| s.samples).filter_map(|s| s.masks.as_ref()).collect();
        let width = logits.iter().flatten().next().map(|l| l.dim(-1));
        let allowed = match width {
            Some(vocab) if !constrained.is_empty() => {
                let forbidden = mlx::Array::scalar(f32::NEG_INFINITY, mlx::Dtype::F32)?;
                Some((self.mask_expander.allowed(&constrained, vocab)?, vocab, forbidden))
            }
            _ => None,
        };
        let mut at_position = 0;
        for (k, (s, logits)) in scheduled.iter().zip(logits).enumerate() {
            if !s.samples {
                continue;
            }
            let logits = logits.ok_or_else(|| mlx::Error { op: "engine", message: "a sampling row got no logits".into() })?;
            let row = &mut self.running[s.row];
            let masked = match (&s.masks, &allowed) {
                (Some(m), Some((allowed, vocab, forbidden))) => {
                    let (from, to) = (at_position as i32, (at_position + m.len()) as i32);
                    at_position += m.len();
                    &mlx::where_(&allowed.slice(&[from, 0], &[to, *vocab as i32])?, &logits, forbidden)?
                }
                _ => &logits,
            };
            let draw = row.sampler.draw(masked, row.generated)?;
            let keep = row.request.logprobs.is_some().then_some(logits);
            draws.push((k, draw, keep));
        }
        let mut to_eval: Vec<&mlx::Array> = draws.iter().map(|(_, d, _)| d).collect();
        to_eval.extend(written_kv(&scheduled, &self.running, self.batch.as_ref().filter(|_| ran_batched)));
        let built = Instant::now();
        mlx::eval(&to_eval)?;
        self.stats.steps += 1;

        // One readback for every row's draws, not one per row.
        let lens: Vec<usize> = draws.iter().map(|(_, d, _)| d.size()).collect();
        let flat: Vec<i32> = match draws.len() {
            0 => Vec::new(),
            1 => draws[0].1.to_vec_i32()?,
            _ => mlx::concatenate(&draws.iter().map(|(_, d, _)| d).collect::<Vec<_>>(), 0)?.to_vec_i32()?,
        };
        let evaluated = Instant::now();
        let mut at = 0;
        for ((k, _, logits), len) in draws.into_iter().zip(lens) {
            let readback = &flat[at..at + len];
            at += len;
            let s = &scheduled[k];
            if let Some(end) = self.publish(s.row, s.decode, &s.drafts, readback, logits.as_ref())? {
                ended.push((s.row, end));
            }
        }
        let now = Instant::now();
        for (i, row) in self.running.iter().enumerate() {
            if ended.iter().any(|(j, _)| *j == i) {
                continue;
            }
            if row.is_prewarm() && row.prompt_remaining() == 0 {
                ended.push((i, End::Finished(Finish::Length)));
            } else if row.request.deadline.is_some_and(|d| now >= d) {
                // Deadlines also end rows still reading a long prompt.
                ended.push((i, End::Finished(Finish::TimeLimit)));
            }
        }
        ended.sort_by_key(|&(i, _)| std::cmp::Reverse(i));
        for (i, end) in ended {
            match end {
                End::Finished(reason) => self.finish(i, reason),
                End::Failed(error) => self.fail(i, error),
            }
        }
        let seconds = started.elapsed().as_secs_f64();
        self.scheduler.record(StepTiming { decode_rows, draft_tokens, prefill_tokens, widened: plan.widened, seconds });
        if self.trace_steps {
            // One line per step, for tuning the prefill allowance on a new machine.
            let next = self.scheduler.learned_allowance();
            let widened = plan.widened;
            let ms = |from: Instant, to: Instant| to.duration_since(from).as_secs_f64() * 1e3;
            eprintln!(
                "[step] decode_rows={decode_rows} constrained_rows={constrained_rows} draft_tokens={draft_tokens} prefill_tokens={prefill_tokens} ms={:.2} masks_ms={masks_ms:.2} build_ms={:.2} eval_ms={:.2} widened={widened} next_allowance={next:?}",
                seconds * 1e3,
                ms(started, built),
                ms(built, evaluated),
            );
        }
        let micros = |from: Instant, to: Instant| to.duration_since(from).as_micros() as u64;
        let times = &mut self.stats.step_time;
        times.build_us += micros(started, built);
        times.eval_us += micros(built, evaluated);
        times.publish_us += micros(evaluated, Instant::now());
        Ok(())
    }

    /// The plan's work by running row (`None`: the row sits this step out),
    /// with each decoding row's drafts: its proposal within the plan's cap,
    /// the draft model's made in one batched round for all rows that draft
    /// with it (see [`speculate::DraftModel::propose`]).
    fn fill_drafts(&mut self, plan: &[(super::RequestId, RowWork)], proposals: &mut [Option<Proposal>]) -> mlx::Result<Vec<Option<Work>>> {
        let index: HashMap<_, _> = self.running.iter().enumerate().map(|(i, r)| (r.id, i)).collect();
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
            let cache = row.draft.as_mut().and_then(|d| d.model_cache()).expect("model-drafting rows have a draft cache");
            rows.push(DraftRow { history: &row.tokens, cache, depth });
        }
        let proposals = draft.propose(&mut rows)?;
        for (&(i, _), drafts) in from_model.iter().zip(proposals) {
            if let Some(Work::Decode { drafts: slot }) = &mut work[i] {
                *slot = drafts;
            }
        }
        Ok(work)
    }

    /// Turns row `i`'s draws into published tokens: accepts drafts, rolls
    /// the KV cache back past rejected ones, emits tokens up to a stop token
    /// or `max_tokens` or the end of its grammar, and advances its matcher
    /// by them. Returns how the row ended, if it did.
    fn publish(&mut self, i: usize, decode: bool, drafts: &[u32], readback: &[i32], logits: Option<&mlx::Array>) -> mlx::Result<Option<End>> {
        let row = &mut self.running[i];
        let targets: Vec<u32> = readback.iter().map(|&t| t as u32).collect();
        let accepted = speculate::accept_matching(drafts, &targets);
        let emitted = &targets[..=accepted];
        // The forward appended the pending token and every draft; keep the
        // accepted ones only.
        let rejected = drafts.len() - accepted;
        match (row.slot, &mut self.batch) {
            (Some(slot), Some(kv)) => kv.truncate(slot, kv.len(slot) - rejected),
            _ => row.cache.truncate(row.cache.len() - rejected),
        }
        if let (Some(draft), true) = (&mut row.draft, decode) {
            draft.verified(row.tokens.len(), drafts.len(), accepted, emitted.len());
            self.stats.drafted_tokens += drafts.len() as u64;
            self.stats.accepted_draft_tokens += accepted as u64;
            self.stats.spec_decode_forwards += 1;
            self.stats.spec_decode_tokens += emitted.len() as u64;
        }
        let host_logits = match (logits, row.request.logprobs) {
            (Some(l), Some(_)) => Some(l.to_vec_f32()?),
            _ => None,
        };
        let mut ids = Vec::with_capacity(emitted.len());
        let mut logprobs = Vec::new();
        let mut finish = None;
        for (pos, &id) in emitted.iter().enumerate() {
            if row.request.stop_ids.contains(&id) {
                finish = Some(Finish::Stop);
                break;
            }
            if let (Some(host), Some(n)) = (&host_logits, row.request.logprobs) {
                let vocab = host.len() / (drafts.len() + 1);
                logprobs.push(logprobs_of(&host[pos * vocab..(pos + 1) * vocab], id, n as usize));
            }
            if let Some(c) = &mut row.constraint {
                if let Err(e) = c.consume(&[id]) {
                    return Ok(Some(End::Failed(EngineError::Constraint(e))));
                }
            }
            ids.push(id);
            row.generated += 1;
            row.tokens.push(id);
            if row.constraint.as_ref().is_some_and(|c| c.is_finished()) {
                // The grammar allows nothing more: the answer is complete.
                finish = Some(Finish::Stop);
                break;
            }
            if row.generated >= row.request.max_tokens {
                finish = Some(Finish::Length);
                break;
            }
        }
        self.stats.generated_tokens += ids.len() as u64;
        if let Some(&last) = ids.last() {
            // can_publish() held when the row was scheduled, so this fits.
            if row.events.try_send(EngineEvent::Tokens { ids, logprobs }).is_err() {
                return Ok(Some(End::Finished(Finish::Cancelled)));
            }
            row.pending_token = Some(last);
        }
        Ok(finish.map(End::Finished))
    }
}
