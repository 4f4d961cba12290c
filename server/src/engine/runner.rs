//! The runner: carries out one step's work on the device. Every row's
//! graph is built lazily and evaluated together with ONE `eval`, then the
//! sampled ids are read back in one copy and handed to `tether_sched::apply`
//! as a plain [`StepOutput`]. This is the only part of a step that touches
//! MLX; it decides nothing about what the draws mean.
use std::time::Instant;

use tether_sched::{Sampled, StepOutput, Work};

use super::lookahead::{decodes_after, plain_decode, Lookahead};
use super::row::Row;
use super::step_masks::{cut_forbidden_drafts, MaskExpander, MasksInFlight, RowMasks};
use super::worker::Engine;
use crate::models::{BatchedRows, Kv, KvBatch, RowInput, RowKv, Transformer};

/// Where a step's run spent its time.
pub(super) struct RunTimes {
    /// When the graph was built (host work done) and when the draws were
    /// read back (device work done).
    pub built: Instant,
    pub evaluated: Instant,
    /// Time spent waiting for constrained rows' masks.
    pub masks_ms: f64,
    pub constrained_rows: usize,
    /// The primitives MLX evaluated for the step (counted only when steps
    /// are traced: the count walks the graph).
    pub primitives: Option<usize>,
}

/// A row's part in this step, as the runner carries it out.
pub(super) struct Scheduled {
    pub row: usize,
    /// Whether its logits are sampled (decode, or the last prefill chunk).
    pub samples: bool,
    /// Where its logits come back.
    pub logits_at: LogitsAt,
    /// A constrained row's allowed tokens, one mask per sampled position.
    pub masks: Option<RowMasks>,
}

pub(super) enum LogitsAt {
    /// A slot of the batched rows.
    Slot(usize),
    /// An entry of the per-row inputs.
    Row(usize),
}

/// The KV buffers a step writes that no draw depends on: those of rows that
/// read a prompt chunk without sampling, and the batched KV when it ran.
fn written_kv<'a>(scheduled: &[Scheduled], running: &'a [Row], batch: Option<&'a KvBatch>) -> Vec<&'a mlx::Array> {
    let mut out: Vec<&mlx::Array> = scheduled.iter().filter(|s| !s.samples).flat_map(|s| running[s.row].kv.buffers()).collect();
    out.extend(batch.map(KvBatch::buffers).unwrap_or_default());
    out
}

fn no_input() -> mlx::Error {
    mlx::Error { op: "engine", message: "a decode without a token to feed".into() }
}

/// A step's forward: every scheduled row's inputs, the one forward over
/// them, and each row's logits (`None` where a row wants none).
struct Forward {
    scheduled: Vec<Scheduled>,
    logits: Vec<Option<mlx::Array>>,
    /// Whether the batched rows took part (their KV buffers were written).
    ran_batched: bool,
    /// Whether they ran in the GPU's fused kernels.
    fused: bool,
}

/// A step's graph, built: each sampling row's draws, lazily.
struct Built {
    draws: Vec<Draws>,
    scheduled: Vec<Scheduled>,
    ran_batched: bool,
    fused: bool,
}

impl Engine {
    /// Runs `work` (by running row; `None`: the row sits the step out). A
    /// row whose grammar fails before it can sample (a draft check, its
    /// masks) is reported in the output and its work dropped.
    pub(super) fn execute(&mut self, work: &mut [Option<Work>]) -> mlx::Result<(StepOutput, RunTimes)> {
        let mut output = StepOutput::default();
        for (i, e) in cut_forbidden_drafts(&mut self.running, work) {
            work[i] = None;
            output.constraint_failed.push((i, e));
        }
        // Held through the step: no row is dropped meanwhile (see SlotLease).
        let mut batch = self.batch.as_ref().map(|b| b.borrow_mut());
        let ahead = self.lookahead.take();
        let had_ahead = ahead.is_some();
        let ahead = ahead.filter(|a| batch.as_deref().is_some_and(|kv| a.serves(work, &self.running, kv)));
        match (had_ahead, ahead.is_some()) {
            (true, true) => self.stats.lookahead_served += 1,
            (true, false) => self.stats.lookahead_dropped += 1,
            _ => {}
        }
        let (step, masks_ms) = match (ahead, batch.as_deref_mut()) {
            // The step is already on the device (see lookahead.rs).
            (Some(ahead), Some(kv)) => {
                let fused = ahead.fused;
                let (draws, scheduled) = ahead.resume(work, &self.running, kv);
                (Built { draws, scheduled, ran_batched: true, fused }, 0.0)
            }
            _ => {
                // Constrained rows' masks are made while the forward is built and
                // evaluated: the forward does not need them, only the draws after it.
                let masks_in_flight = MasksInFlight::start(&mut self.running, work);
                let mut forward = forward(&self.model, &mut self.running, work, batch.as_deref_mut(), None, self.config.shared_attention_scores)?;
                let written_batch = batch.as_deref().filter(|_| forward.ran_batched);
                let masks_started = Instant::now();
                if let Some(in_flight) = masks_in_flight {
                    take_masks(in_flight, &mut self.running, &mut forward, written_batch, &mut output)?;
                }
                let masks_ms = masks_started.elapsed().as_secs_f64() * 1e3;
                let draws = draw(&mut self.running, &mut self.mask_expander, forward.logits, &forward.scheduled, 0)?;
                (Built { draws, scheduled: forward.scheduled, ran_batched: forward.ran_batched, fused: forward.fused }, masks_ms)
            }
        };
        let constrained_rows = step.scheduled.iter().filter(|s| s.masks.is_some()).count();
        let primitives = match self.trace_steps {
            true => Some(count_primitives(&step.draws, &step.scheduled, &self.running, batch.as_deref().filter(|_| step.ran_batched))?),
            false => None,
        };
        let built = Instant::now();
        if self.config.lookahead {
            if let Some(kv) = batch.as_deref_mut() {
                self.lookahead = look_ahead(&self.model, &mut self.running, work, &step, kv, self.config.shared_attention_scores)?;
            }
        }
        output.sampled = evaluate(step.draws, &step.scheduled, &self.running, batch.as_deref().filter(|_| step.ran_batched))?;
        let evaluated = Instant::now();
        Ok((output, RunTimes { built, evaluated, masks_ms, constrained_rows, primitives }))
    }
}

/// Queues the step after `step` before `step` is read, if every row of it
/// may be looked ahead of (see lookahead.rs): `step` goes to the device,
/// then its successor, built from its draws, follows it there. Where the
/// GPU's fused kernels exist, only a fused step is followed (a step on
/// MLX's ops leaves the batch's buffers pending, and a successor built on
/// them would take MLX's ops as well, each step in turn).
fn look_ahead(
    model: &Transformer,
    running: &mut [Row],
    work: &[Option<Work>],
    step: &Built,
    kv: &mut KvBatch,
    shared_scores: usize,
) -> mlx::Result<Option<Lookahead>> {
    let plain = step.draws.len() == step.scheduled.len()
        && (step.fused || !model.has_fused_decode())
        && step.scheduled.iter().all(|s| plain_decode(&running[s.row], work[s.row].as_ref()));
    // Its rows: those that go on after this token, with their draws.
    let (rows, fed): (Vec<&Scheduled>, Vec<&mlx::Array>) =
        step.scheduled.iter().zip(&step.draws).filter(|(s, _)| decodes_after(&running[s.row])).map(|(s, d)| (s, &d.tokens)).unzip();
    if !plain || rows.is_empty() {
        return Ok(None);
    }
    mlx::async_eval(&step_outputs(&step.draws, &step.scheduled, running, Some(kv)))?;
    let slot_of = |s: &Scheduled| match s.logits_at {
        LogitsAt::Slot(slot) => slot,
        LogitsAt::Row(_) => unreachable!("lookahead rows are batch slots"),
    };
    let lens: Vec<usize> = rows.iter().map(|s| kv.len(slot_of(s))).collect();
    // The draws in slot order: the batch feeds them to its slots in that order.
    let mut order: Vec<usize> = (0..rows.len()).collect();
    order.sort_by_key(|&i| slot_of(rows[i]));
    let fed: Vec<&mlx::Array> = order.iter().map(|&i| fed[i]).collect();
    let fed = if fed.len() == 1 { fed[0].clone() } else { mlx::concatenate(&fed, 0)? };
    let ahead_work: Vec<Option<Work>> = (0..work.len()).map(|i| rows.iter().any(|s| s.row == i).then(|| Work::Decode { drafts: Vec::new() })).collect();
    let ahead = forward(model, running, &ahead_work, Some(kv), Some(fed), shared_scores)?;
    // Nothing of the lookahead shows until it is used: the slots' lengths go
    // back (what it wrote lies past them).
    for (s, &len) in rows.iter().zip(&lens) {
        kv.truncate(slot_of(s), len);
    }
    let draws = draw(running, &mut MaskExpander::default(), ahead.logits, &ahead.scheduled, 1)?;
    mlx::async_eval(&step_outputs(&draws, &ahead.scheduled, running, Some(kv)))?;
    Ok(Some(Lookahead::new(running, &ahead.scheduled, &lens, draws, ahead.fused)))
}

/// Builds one forward for every row with work: rows in the batch write
/// their slots, rows with caches of their own go as per-row inputs. `fed`:
/// the decoding slots' tokens as an unread array (a lookahead's, see
/// [`BatchedRows::fed`]), in place of their pending tokens.
fn forward(
    model: &Transformer,
    running: &mut [Row],
    work: &[Option<Work>],
    batch: Option<&mut KvBatch>,
    fed: Option<mlx::Array>,
    shared_scores: usize,
) -> mlx::Result<Forward> {
    let mut inputs = Vec::new();
    let mut scheduled: Vec<Scheduled> = Vec::new();
    let slots = batch.as_deref().map_or(0, KvBatch::slots);
    let (mut slot_tokens, mut slot_logits_wanted) = (vec![Vec::new(); slots], vec![0; slots]);
    for (i, row) in running.iter_mut().enumerate() {
        let Some(w) = &work[i] else { continue };
        let tokens: Vec<i32> = match fed {
            // A placeholder: the batch feeds the unread token.
            Some(_) => vec![0],
            None => row.progress.input(w).ok_or_else(no_input)?.into_iter().map(|t| t as i32).collect(),
        };
        let samples = row.progress.samples_after(w);
        let positions = match w {
            Work::Decode { drafts } => 1 + drafts.len(),
            Work::Prefill { .. } => 1,
        };
        let logits_at = match &mut row.kv {
            RowKv::Slot(lease) => {
                let slot = lease.slot();
                slot_tokens[slot] = tokens;
                slot_logits_wanted[slot] = if samples { positions } else { 0 };
                LogitsAt::Slot(slot)
            }
            RowKv::Own(cache) => {
                let ids = mlx::Array::from_i32(&tokens, &[1, tokens.len()])?;
                inputs.push(RowInput { ids, cache, n_logits: positions });
                LogitsAt::Row(inputs.len() - 1)
            }
        };
        scheduled.push(Scheduled { row: i, samples, logits_at, masks: None });
    }
    let batched = match batch {
        Some(kv) if slot_tokens.iter().any(|t| !t.is_empty()) => Some(BatchedRows { kv, tokens: slot_tokens, fed, logits: slot_logits_wanted, shared_scores }),
        _ => None,
    };
    let ran_batched = batched.is_some();
    let step_logits = model.forward_step(batched, &mut inputs)?;
    drop(inputs);
    let mut slot_logits = step_logits.batched;
    let mut row_logits: Vec<Option<mlx::Array>> = step_logits.rows.into_iter().map(Some).collect();
    // A prompt chunk in a slot that does not finish the prompt wants no logits.
    let logits = scheduled
        .iter()
        .map(|s| match s.logits_at {
            LogitsAt::Slot(slot) => slot_logits[slot].take(),
            LogitsAt::Row(k) => row_logits[k].take(),
        })
        .collect();
    Ok(Forward { scheduled, logits, ran_batched, fused: step_logits.fused })
}

/// Waits for the constrained rows' masks. Not ready yet: the forward goes
/// to MLX first, and they finish beside its evaluation (handing it over
/// holds this thread: on a GPU it launches every kernel; on the CPU MLX
/// waits while more than a few operations are queued). Ready: the draws
/// join the forward's one evaluation, which saves a round trip. A row whose
/// matcher failed stops sampling and is reported.
fn take_masks(in_flight: MasksInFlight, running: &mut [Row], forward: &mut Forward, batch: Option<&KvBatch>, output: &mut StepOutput) -> mlx::Result<()> {
    if !in_flight.is_finished() {
        let mut outputs: Vec<&mlx::Array> = forward.logits.iter().flatten().collect();
        outputs.extend(written_kv(&forward.scheduled, running, batch));
        mlx::async_eval(&outputs)?;
    }
    for (row, made) in in_flight.finish(running) {
        let s = forward.scheduled.iter_mut().find(|s| s.row == row).expect("a row with masks is scheduled");
        match made {
            Ok(m) => s.masks = Some(m),
            Err(e) => {
                // Its forward ran; the row ends here and its state is dropped.
                s.samples = false;
                output.constraint_failed.push((s.row, e));
            }
        }
    }
    Ok(())
}

/// A sampling row's draws, with its logits when it reports log-probabilities.
pub(super) struct Draws {
    pub row: usize,
    pub tokens: mlx::Array,
    pub logits: Option<mlx::Array>,
}

/// Each sampling row's draws, lazily: one per position it verifies (the
/// pending token's successor, then one after each draft; `ahead` tokens
/// further on in a lookahead), each the argmax
/// or the position-keyed sample (see `Sampler::draw`), over the logits its
/// grammar allows (every constrained position's allowed set is expanded on
/// the device at once).
fn draw(running: &mut [Row], masks: &mut MaskExpander, logits: Vec<Option<mlx::Array>>, scheduled: &[Scheduled], ahead: usize) -> mlx::Result<Vec<Draws>> {
    let constrained: Vec<&RowMasks> = scheduled.iter().filter(|s| s.samples).filter_map(|s| s.masks.as_ref()).collect();
    let width = logits.iter().flatten().next().map(|l| l.dim(-1));
    let allowed = match width {
        Some(vocab) if !constrained.is_empty() => {
            let forbidden = mlx::Array::scalar(f32::NEG_INFINITY, mlx::Dtype::F32)?;
            Some((masks.allowed(&constrained, vocab)?, vocab, forbidden))
        }
        _ => None,
    };
    let mut draws = Vec::new();
    let mut at_position = 0;
    for (s, logits) in scheduled.iter().zip(logits) {
        if !s.samples {
            continue;
        }
        let logits = logits.ok_or_else(|| mlx::Error { op: "engine", message: "a sampling row got no logits".into() })?;
        let row = &mut running[s.row];
        let masked = match (&s.masks, &allowed) {
            (Some(m), Some((allowed, vocab, forbidden))) => {
                let (from, to) = (at_position as i32, (at_position + m.len()) as i32);
                at_position += m.len();
                &mlx::where_(&allowed.slice(&[from, 0], &[to, *vocab as i32])?, &logits, forbidden)?
            }
            _ => &logits,
        };
        let tokens = row.sampler.draw(masked, row.progress.generated + ahead)?;
        let logits = row.progress.limits.logprobs.is_some().then_some(logits);
        draws.push(Draws { row: s.row, tokens, logits });
    }
    Ok(draws)
}

/// What a step evaluates: the draws and the KV it wrote.
fn step_outputs<'a>(draws: &'a [Draws], scheduled: &[Scheduled], running: &'a [Row], batch: Option<&'a KvBatch>) -> Vec<&'a mlx::Array> {
    let mut outputs: Vec<&mlx::Array> = draws.iter().map(|d| &d.tokens).collect();
    outputs.extend(written_kv(scheduled, running, batch));
    outputs
}

/// The primitives [`evaluate`] will run (for traces: the count walks the graph).
fn count_primitives(draws: &[Draws], scheduled: &[Scheduled], running: &[Row], batch: Option<&KvBatch>) -> mlx::Result<usize> {
    mlx::cuda::primitive_count(&step_outputs(draws, scheduled, running, batch))
}

/// Evaluates the draws and the KV the step wrote in ONE eval, then reads
/// every row's draws back in one copy, not one per row.
fn evaluate(draws: Vec<Draws>, scheduled: &[Scheduled], running: &[Row], batch: Option<&KvBatch>) -> mlx::Result<Vec<Sampled>> {
    mlx::eval(&step_outputs(&draws, scheduled, running, batch))?;
    let flat: Vec<i32> = match draws.len() {
        0 => Vec::new(),
        1 => draws[0].tokens.to_vec_i32()?,
        _ => mlx::concatenate(&draws.iter().map(|d| &d.tokens).collect::<Vec<_>>(), 0)?.to_vec_i32()?,
    };
    let mut sampled = Vec::with_capacity(draws.len());
    let mut at = 0;
    for d in draws {
        let len = d.tokens.size();
        let targets = flat[at..at + len].iter().map(|&t| t as u32).collect();
        at += len;
        let logits = d.logits.map(|l| l.to_vec_f32()).transpose()?;
        sampled.push(Sampled { row: d.row, targets, logits });
    }
    Ok(sampled)
}
