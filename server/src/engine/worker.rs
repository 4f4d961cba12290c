//! The engine thread's loop: admit, schedule, forward, sample, publish.
//!
//! Each step gives every running row work under a token budget: decode rows
//! first (one token each), then prefill chunks of rows still reading their
//! prompt. All rows' graphs are built lazily and evaluated together with ONE
//! `eval`, then the sampled ids are read back and published. A row whose
//! consumer has no room is paused (skipped) until it drains.
use std::collections::{HashMap, VecDeque};
use std::sync::mpsc::{Receiver, Sender, TryRecvError};
use std::time::Instant;

use super::config::EngineConfig;
use super::draft_cost::DraftCost;
use super::prefix::PrefixCache;
use super::row::{logprobs_of, Row, Work};
use super::speculate::{self, DraftModel, DraftRow, Proposal};
use super::step_cost::StepCost;
use super::{Command, EngineEvent, EngineModelInfo, EngineStats, Finish, RequestId, SubmitRequest};
use crate::loaded::LoadedModel;
use crate::model::{BatchedRows, KvBatch, RowInput, Transformer};

/// Prompts this short are prefilled whole even while streams decode (see
/// [`Engine::plan`]).
const SHORT_PROMPT_TOKENS: usize = 64;

/// Most tokens of a long prompt a step carries while rows decode, whatever
/// the allowance: with batched KV, larger chunks leave the shared
/// attention's small shape, and a GPU pays milliseconds for each new shape
/// (each larger size was a slow step of its own:
/// bench/results/gpu-h200-admit-trace-prefill-in-slots.log); on a CPU the
/// allowance rarely reaches it (16 prompt tokens cost half a decode step).
const MIXED_CHUNK_MAX: usize = crate::model::SMALL_QUERIES;

/// Every this many steps a row whose drafts fell under the bar (see
/// [`DraftCost`]) drafts anyway, to measure its acceptance again.
const DRAFT_RETRY_EVERY: usize = 32;

/// Whether the prefill allowance limits `row`'s prompt while rows decode:
/// prompts up to [`SHORT_PROMPT_TOKENS`] (past what the cache held) are
/// read whole (see [`Engine::plan`]).
fn held_back(row: &Row) -> bool {
    row.request.prompt.len() - row.cached_tokens > SHORT_PROMPT_TOKENS
}

/// A row's part in this step.
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
}

enum LogitsAt {
    /// A slot of the batched rows.
    Slot(usize),
    /// An entry of the per-row inputs.
    Row(usize),
}

struct Waiting {
    id: RequestId,
    request: SubmitRequest,
    events: tokio::sync::mpsc::Sender<EngineEvent>,
    queued_at: Instant,
}

struct Engine {
    config: EngineConfig,
    model: Transformer,
    kv_bytes_per_token: usize,
    waiting: VecDeque<Waiting>,
    running: Vec<Row>,
    /// Final events that found their channel full; retried every step.
    undelivered: Vec<(tokio::sync::mpsc::Sender<EngineEvent>, EngineEvent)>,
    stats: EngineStats,
    shutting_down: bool,
    /// Where the next step's round-robin starts, so no row is always last.
    rotate: usize,
    prefix: PrefixCache,
    draft: Option<DraftModel>,
    /// Decoding rows' KV caches, when they are batched (see [`super::KvLayout`]).
    batch: Option<KvBatch>,
    step_cost: StepCost,
    /// What a draft token costs beside the step's rows (fed by decode-only steps).
    draft_cost: DraftCost,
    /// Whether this step's prefill allowance was widened (see
    /// [`Engine::prefill_allowance`]); such steps do not feed `step_cost`.
    allowance_widened: bool,
    /// `TETHER_TRACE_STEPS=1`: log every step's rows, tokens and time.
    trace_steps: bool,
}

pub(super) fn run<F>(config: EngineConfig, load: F, rx: Receiver<Command>, info_tx: Sender<anyhow::Result<EngineModelInfo>>)
where
    F: FnOnce() -> anyhow::Result<LoadedModel>,
{
    let model = match load() {
        Ok(m) => m,
        Err(e) => {
            let _ = info_tx.send(Err(e));
            return;
        }
    };
    let draft = match config.draft_model.as_ref().map(|spec| DraftModel::load(spec, model.transformer.config.vocab_size)).transpose() {
        Ok(d) => d,
        Err(e) => {
            let _ = info_tx.send(Err(e.context("loading the draft model")));
            return;
        }
    };
    let batched = config.kv_layout.batched_on(mlx::default_device());
    if mlx::default_device() == mlx::Device::Gpu {
        if let Err(e) = super::warmup::warm_up(&model.transformer, &config, batched) {
            let _ = info_tx.send(Err(anyhow::anyhow!("warming up the model's kernels failed: {e}")));
            return;
        }
    }
    let c = &model.transformer.config;
    let kv_bytes_per_token = c.kv_bytes_per_token(model.transformer.dtype.size());
    let info = EngineModelInfo {
        name: model.name.clone(),
        architecture: c.arch.name().to_string(),
        context_length: c.context_length,
        vocab_size: c.vocab_size,
        kv_bytes_per_token,
        weight_bytes: model.transformer.nbytes(),
        draft_model: config.draft_model.as_ref().map(|d| d.path.display().to_string()),
    };
    let _ = info_tx.send(Ok(info));
    let namespace = {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        (model.path.display().to_string(), format!("{:?}", model.transformer.dtype), model.transformer.weight_form()).hash(&mut h);
        h.finish()
    };
    let prefix = PrefixCache::new(config.prefix_cache_bytes, config.prefix_block_tokens, namespace);
    let batch = batched.then(|| model.transformer.new_kv_batch());
    let mut engine = Engine {
        prefix,
        draft,
        batch,
        step_cost: StepCost::new(config.max_itl_inflation, config.min_prefill_chunk),
        draft_cost: DraftCost::default(),
        allowance_widened: false,
        trace_steps: super::tracing(),
        config,
        model: model.transformer,
        kv_bytes_per_token,
        waiting: VecDeque::new(),
        running: Vec::new(),
        undelivered: Vec::new(),
        stats: EngineStats::default(),
        shutting_down: false,
        rotate: 0,
    };
    engine.run(rx);
}

impl Engine {
    fn run(&mut self, rx: Receiver<Command>) {
        loop {
            // Idle: block until there is something to do.
            if self.running.is_empty() && self.waiting.is_empty() && self.undelivered.is_empty() {
                if self.shutting_down {
                    return;
                }
                let _ = mlx::memory::clear_cache();
                match rx.recv() {
                    Ok(cmd) => self.handle(cmd),
                    Err(_) => return,
                }
            }
            loop {
                match rx.try_recv() {
                    Ok(cmd) => self.handle(cmd),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        self.shutting_down = true;
                        break;
                    }
                }
            }
            self.retry_undelivered();
            self.admit();
            if let Err(e) = self.step() {
                self.fail_all(&format!("engine step failed: {e}"));
            }
            if self.stats.steps % self.config.reclaim_every_steps == 0 {
                self.prefix.maintain();
                let _ = mlx::memory::clear_cache();
            }
            if self.running.iter().all(|r| !r.can_publish()) && !self.running.is_empty() {
                // Every consumer is full: wait briefly instead of spinning.
                std::thread::sleep(std::time::Duration::from_millis(2));
            }
        }
    }

    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Submit { id, request, events, queued_at } => {
                if self.shutting_down {
                    let _ = events.try_send(EngineEvent::Failed { message: "the engine is shutting down".into() });
                } else if self.waiting.len() >= self.config.max_waiting {
                    let _ = events.try_send(EngineEvent::Failed { message: format!("overloaded: {} requests waiting", self.waiting.len()) });
                } else if self.reserved_bytes(&request) > self.config.kv_budget_bytes {
                    let _ = events.try_send(EngineEvent::Failed {
                        message: format!("the request needs more KV cache than the engine's budget of {} bytes", self.config.kv_budget_bytes),
                    });
                } else {
                    self.waiting.push_back(Waiting { id, request, events, queued_at });
                }
            }
            Command::Cancel { id } => self.cancel(id),
            Command::Stats { reply } => {
                let _ = reply.send(self.snapshot());
            }
            Command::DropScope { scope } => self.prefix.drop_scope(&scope),
            Command::SetScopeLive { scope, live } => self.prefix.set_scope_live(&scope, live),
            Command::Shutdown => self.shutting_down = true,
        }
    }

    /// KV bytes a request can grow to (prompt + max_tokens, in cache blocks).
    fn reserved_bytes(&self, r: &SubmitRequest) -> usize {
        let tokens = (r.prompt.len() + r.max_tokens).div_ceil(crate::model::KV_CAPACITY_STEP) * crate::model::KV_CAPACITY_STEP;
        tokens * self.kv_bytes_per_token
    }

    /// KV bytes `requests` can grow to together. Batched, every slot is as
    /// long as the longest row and slots come in powers of two, so that is
    /// what they may take, however short the other rows are.
    fn kv_reservation<'r>(&self, requests: impl Iterator<Item = &'r SubmitRequest>) -> usize {
        let (count, sum, longest) = requests.fold((0usize, 0usize, 0usize), |(n, sum, max), r| {
            let bytes = self.reserved_bytes(r);
            (n + 1, sum + bytes, max.max(bytes))
        });
        match self.batch {
            Some(_) => longest * count.next_power_of_two(),
            None => sum,
        }
    }

    fn cancel(&mut self, id: RequestId) {
        if let Some(pos) = self.running.iter().position(|r| r.id == id) {
            self.finish(pos, Finish::Cancelled);
        } else if let Some(pos) = self.waiting.iter().position(|w| w.id == id) {
            let w = self.waiting.remove(pos).expect("position is valid");
            let event = EngineEvent::Finished(super::FinishInfo {
                reason: Finish::Cancelled,
                prompt_tokens: w.request.prompt.len(),
                cached_tokens: 0,
                completion_tokens: 0,
                speculative: None,
            });
            self.deliver_final(w.events, event);
        }
    }

    /// Moves waiting requests into rows while rows and KV budget allow, in
    /// the order [`next_waiting`](Self::next_waiting) gives (a request that
    /// does not fit yet blocks the others, so large requests are not starved
    /// by small ones).
    fn admit(&mut self) {
        self.waiting.retain(|w| !w.events.is_closed());
        while self.running.len() < self.config.max_running {
            let Some(next) = self.next_waiting() else { break };
            let requests = self.running.iter().map(|r| &r.request).chain(std::iter::once(&self.waiting[next].request));
            if self.kv_reservation(requests) > self.config.kv_budget_bytes {
                break;
            }
            let w = self.waiting.remove(next).expect("next_waiting gives a valid index");
            let queue_ms = w.queued_at.elapsed().as_secs_f64() * 1e3;
            match Row::new(w.id, w.request, w.events.clone(), self.model.new_cache(), self.draft.as_ref().map(|d| &d.model)) {
                Ok(mut row) => {
                    if let Some(scope) = &row.request.cache_scope {
                        if let Some((cache, len)) = self.prefix.lookup(scope, &row.request.prompt) {
                            row.resume_from(cache, len);
                        }
                    }
                    if let Err(e) = self.seat(&mut row) {
                        self.deliver_final(w.events, EngineEvent::Failed { message: format!("no room in the KV batch: {e}") });
                        continue;
                    }
                    let _ = row.events.try_send(EngineEvent::Started { queue_ms });
                    self.running.push(row);
                }
                Err(e) => self.deliver_final(w.events, EngineEvent::Failed { message: e.to_string() }),
            }
        }
    }

    /// Which waiting request takes the next free row: the earliest queued
    /// of those whose session has the fewest rows running. Arrival order
    /// alone would let a session that queues many requests take every row
    /// that frees up until all of them ran; this way sessions take turns
    /// (requests without a session count as sessions of their own).
    fn next_waiting(&self) -> Option<usize> {
        let mut rows_of: HashMap<&str, usize> = HashMap::new();
        for row in &self.running {
            if let Some(session) = &row.request.session {
                *rows_of.entry(session.as_str()).or_default() += 1;
            }
        }
        let running = |w: &Waiting| w.request.session.as_deref().map_or(0, |s| rows_of.get(s).copied().unwrap_or(0));
        self.waiting.iter().enumerate().min_by_key(|&(i, w)| (running(w), i)).map(|(i, _)| i)
    }

    /// Gives a new row its slot when caches are batched: it reads its prompt
    /// there too, so prompt chunks share the step's attention with the
    /// decoding rows instead of adding their own kernels, and the finished
    /// prompt needs no move. A prefix-cache hit is copied in. The slot gets
    /// the whole prompt's room now (see [`KvBatch::admit`]).
    fn seat(&mut self, row: &mut Row) -> mlx::Result<()> {
        let Some(kv) = &mut self.batch else { return Ok(()) };
        let slot = kv.admit(&row.cache, row.request.prompt.len() + 1)?;
        row.slot = Some(slot);
        row.cache = self.model.new_cache();
        Ok(())
    }

    /// Assigns this step's work under the token budget, starting at a
    /// rotating row for fairness: every decode row's token first, then the
    /// decode rows' draft tokens, then prefill chunks.
    fn plan(&mut self) -> Vec<(usize, Work)> {
        let n = self.running.len();
        let order: Vec<usize> = (0..n).map(|i| (i + self.rotate) % n.max(1)).collect();
        let mut budget = self.config.step_token_budget;
        let mut decoding = Vec::new();
        for &i in &order {
            let row = &self.running[i];
            if row.pending_token.is_some() && row.can_publish() && budget > 0 {
                decoding.push(i);
                budget -= 1;
            }
        }
        let mut draft_budget = budget.min(self.config.step_draft_budget);
        let bar = self.draft_cost.bar(decoding.len());
        let mut plan = Vec::new();
        for i in decoding {
            // A row held back by the bar still drafts now and then, so its
            // acceptance keeps up with what it is writing.
            let retry = (self.stats.steps as usize + i) % DRAFT_RETRY_EVERY == 0;
            let (drafts, model_depth) = match self.running[i].drafts(draft_budget, bar.filter(|_| !retry)) {
                Proposal::Ready(drafts) => (drafts, 0),
                Proposal::FromModel(depth) => (Vec::new(), depth),
            };
            let n = drafts.len() + model_depth;
            draft_budget -= n;
            budget -= n;
            plan.push((i, Work::Decode { drafts, model_depth }));
        }
        // Prompt tokens ride along only as far as the decoding rows can
        // afford (until the costs are measured, chunks alone bound them).
        // Short prompts are exempt, though they use up the allowance: they
        // finish in one step, so holding them back would cost their time
        // to first token more than it spares the running streams (32
        // streams started together would otherwise start one per step).
        let mut allowance = self.prefill_allowance(plan.len());
        for &i in &order {
            let row = &self.running[i];
            let remaining = row.prompt_remaining();
            if remaining == 0 || !row.can_publish() || budget == 0 {
                continue;
            }
            let chunk = row.request.prefill_chunk.unwrap_or(self.config.prefill_chunk).clamp(self.config.min_prefill_chunk, self.config.max_prefill_chunk);
            let mut tokens = remaining.min(chunk).min(budget);
            if let Some(left) = &mut allowance {
                // The exemption is for short prompts, not for the last
                // chunk of a long one.
                if held_back(row) {
                    tokens = tokens.min(*left).min(MIXED_CHUNK_MAX);
                }
                *left = left.saturating_sub(tokens);
            }
            if tokens == 0 {
                continue;
            }
            plan.push((i, Work::Prefill { tokens }));
            budget -= tokens;
        }
        plan
    }

    /// Prompt tokens this step may carry beside `decode_rows` decoding rows:
    /// none while nothing decodes (no limit), else the allowance the step
    /// costs have taught (see [`StepCost`]), widened by the ratio of long
    /// prompts waiting to rows decoding when they outnumber them. The
    /// allowance spares the running streams a prompt's cost; once the
    /// prompts it holds back outnumber the streams it protects, it costs
    /// more waiting than it saves (32 streams started together with
    /// 512-token prompts on an H200: one row decoding in 5 ms steps held the
    /// other 31 to 16 prompt tokens a step, 6 s mean time to first token).
    /// Widened, each prompt still moves at most [`MIXED_CHUNK_MAX`] tokens a
    /// step, and the step does not teach the cost model.
    fn prefill_allowance(&mut self, decode_rows: usize) -> Option<usize> {
        self.allowance_widened = false;
        if decode_rows == 0 {
            return None;
        }
        let learned = self.step_cost.prefill_allowance()?;
        let waiting = self.running.iter().filter(|r| r.prompt_remaining() > 0 && r.can_publish() && held_back(r)).count();
        let widen = (waiting / decode_rows).max(1);
        self.allowance_widened = widen > 1;
        Some(learned * widen)
    }

    fn step(&mut self) -> mlx::Result<()> {
        self.drop_finished_consumers();
        if self.running.is_empty() {
            return Ok(());
        }
        let started = Instant::now();
        let mut plan = self.plan();
        self.rotate = self.rotate.wrapping_add(1);
        if plan.is_empty() {
            return Ok(());
        }
        self.draft_with_model(&mut plan)?;
        // One forward for every scheduled row, then one eval.
        let mut work_of: Vec<Option<Work>> = (0..self.running.len()).map(|_| None).collect();
        let (mut decode_rows, mut draft_tokens, mut prefill_tokens) = (0, 0, 0);
        for (i, work) in plan {
            match &work {
                Work::Prefill { tokens } => prefill_tokens += tokens,
                Work::Decode { drafts, .. } => {
                    decode_rows += 1;
                    draft_tokens += drafts.len();
                }
            }
            work_of[i] = Some(work);
        }
        self.stats.prompt_tokens += prefill_tokens as u64;
        let mut inputs = Vec::new();
        let mut scheduled: Vec<Scheduled> = Vec::new();
        let slots = self.batch.as_ref().map_or(0, KvBatch::slots);
        let (mut slot_tokens, mut slot_logits_wanted) = (vec![Vec::new(); slots], vec![0; slots]);
        for (i, row) in self.running.iter_mut().enumerate() {
            let Some(work) = work_of[i].take() else { continue };
            let tokens: Vec<i32> = row.take_input(&work)?.into_iter().map(|t| t as i32).collect();
            let samples = row.samples_after(&work);
            let (decode, drafts) = match work {
                Work::Decode { drafts, .. } => (true, drafts),
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
            scheduled.push(Scheduled { row: i, samples, decode, drafts, logits_at });
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

        // Each sampling row's draws, lazily: greedy rows take the argmax at
        // every position; sampled rows with drafts run speculative sampling.
        // (index into `scheduled`, draws, logits kept for logprobs)
        let mut draws: Vec<(usize, mlx::Array, Option<mlx::Array>)> = Vec::new();
        for (k, (s, logits)) in scheduled.iter().zip(logits).enumerate() {
            if !s.samples {
                continue;
            }
            let logits = logits.ok_or_else(|| mlx::Error { op: "engine", message: "a sampling row got no logits".into() })?;
            let row = &mut self.running[s.row];
            let draw =
                if s.drafts.is_empty() || row.request.sampling.is_greedy() { row.sampler.sample(&logits)? } else { row.sampler.verify(&logits, &s.drafts)? };
            let keep = row.request.logprobs.is_some().then_some(logits);
            draws.push((k, draw, keep));
        }
        let mut to_eval: Vec<&mlx::Array> = draws.iter().map(|(_, d, _)| d).collect();
        for s in &scheduled {
            if !s.samples {
                to_eval.extend(self.running[s.row].cache.buffers());
            }
        }
        if let (true, Some(kv)) = (ran_batched, &self.batch) {
            to_eval.extend(kv.buffers());
        }
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
        let mut finished: Vec<(usize, Finish)> = Vec::new();
        let mut at = 0;
        for ((k, _, logits), len) in draws.into_iter().zip(lens) {
            let readback = &flat[at..at + len];
            at += len;
            let s = &scheduled[k];
            if let Some(reason) = self.publish(s.row, s.decode, &s.drafts, readback, logits.as_ref())? {
                finished.push((s.row, reason));
            }
        }
        for (i, row) in self.running.iter().enumerate() {
            if finished.iter().any(|(j, _)| *j == i) {
                continue;
            }
            if row.is_prewarm() && row.prompt_remaining() == 0 {
                finished.push((i, Finish::Length));
            } else if row.request.deadline.is_some_and(|d| Instant::now() >= d) {
                // Deadlines also end rows still reading a long prompt.
                finished.push((i, Finish::TimeLimit));
            }
        }
        finished.sort_by(|a, b| b.0.cmp(&a.0));
        for (i, reason) in finished {
            self.finish(i, reason);
        }
        let micros = |from: Instant, to: Instant| to.duration_since(from).as_micros() as u64;
        let seconds = started.elapsed().as_secs_f64();
        if !self.allowance_widened {
            self.step_cost.record(decode_rows, prefill_tokens, seconds);
        }
        if decode_rows > 0 && prefill_tokens == 0 {
            self.draft_cost.record(decode_rows + draft_tokens, seconds);
        }
        if self.trace_steps {
            // One line per step, for tuning the prefill allowance on a new machine.
            let next = self.step_cost.prefill_allowance();
            let widened = self.allowance_widened;
            eprintln!("[step] decode_rows={decode_rows} draft_tokens={draft_tokens} prefill_tokens={prefill_tokens} ms={:.2} widened={widened} next_allowance={next:?}", seconds * 1e3);
        }
        let times = &mut self.stats.step_time;
        times.build_us += micros(started, built);
        times.eval_us += micros(built, evaluated);
        times.publish_us += micros(evaluated, Instant::now());
        Ok(())
    }

    /// Fills in the drafts of rows that take them from the draft model: one
    /// batched draft round for all of them (see [`DraftModel::propose`]).
    fn draft_with_model(&mut self, plan: &mut [(usize, Work)]) -> mlx::Result<()> {
        let Some(draft) = &self.draft else { return Ok(()) };
        let wanted: Vec<(usize, usize)> = plan
            .iter()
            .enumerate()
            .filter_map(|(p, (_, w))| match w {
                Work::Decode { model_depth, .. } if *model_depth > 0 => Some((p, *model_depth)),
                _ => None,
            })
            .collect();
        if wanted.is_empty() {
            return Ok(());
        }
        let rows_of: Vec<usize> = wanted.iter().map(|&(p, _)| plan[p].0).collect();
        let mut rows: Vec<DraftRow<'_>> = Vec::new();
        for (r, row) in self.running.iter_mut().enumerate() {
            let Some(k) = rows_of.iter().position(|&i| i == r) else { continue };
            let cache = row.draft.as_mut().and_then(|d| d.model_cache()).expect("model-drafting rows have a draft cache");
            rows.push(DraftRow { history: &row.tokens, cache, depth: wanted[k].1 });
        }
        // `rows` follows running order; map each back to its plan entry.
        let mut order: Vec<usize> = (0..wanted.len()).collect();
        order.sort_by_key(|&k| rows_of[k]);
        let proposals = draft.propose(&mut rows)?;
        for (k, drafts) in order.into_iter().zip(proposals) {
            if let (_, Work::Decode { drafts: slot, .. }) = &mut plan[wanted[k].0] {
                *slot = drafts;
            }
        }
        Ok(())
    }

    /// Turns row `i`'s draws into published tokens: accepts drafts, rolls
    /// the KV cache back past rejected ones, emits tokens up to a stop token
    /// or `max_tokens`. Returns why the row finished, if it did.
    fn publish(&mut self, i: usize, decode: bool, drafts: &[u32], readback: &[i32], logits: Option<&mlx::Array>) -> mlx::Result<Option<Finish>> {
        let row = &mut self.running[i];
        let (emitted, accepted): (Vec<u32>, usize) = if drafts.is_empty() || row.request.sampling.is_greedy() {
            let targets: Vec<u32> = readback.iter().map(|&t| t as u32).collect();
            let accepted = speculate::accept_greedy(drafts, &targets);
            (targets[..=accepted].to_vec(), accepted)
        } else {
            speculate::accept_sampled(drafts, readback)
        };
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
            ids.push(id);
            row.generated += 1;
            row.tokens.push(id);
            if row.generated >= row.request.max_tokens {
                finish = Some(Finish::Length);
                break;
            }
        }
        self.stats.generated_tokens += ids.len() as u64;
        if let Some(&last) = ids.last() {
            // can_publish() held when the row was scheduled, so this fits.
            if row.events.try_send(EngineEvent::Tokens { ids, logprobs }).is_err() {
                return Ok(Some(Finish::Cancelled));
            }
            row.pending_token = Some(last);
        }
        Ok(finish)
    }

    /// Removes row `i` from the running set. A row whose cache is batched
    /// gets it back as its own when `keep_cache` (to store it in the prefix
    /// cache); otherwise its slot is just freed.
    fn take_row(&mut self, i: usize, keep_cache: bool) -> Row {
        let mut row = self.running.remove(i);
        if let (Some(slot), Some(kv)) = (row.slot.take(), &mut self.batch) {
            if keep_cache {
                match kv.release(slot) {
                    Ok(cache) => row.cache = cache,
                    // The turn still finishes; only its cache entry is lost.
                    Err(_) => kv.forget(slot),
                }
            } else {
                kv.forget(slot);
            }
        }
        row
    }

    /// Rows whose receiver was dropped are cancelled.
    fn drop_finished_consumers(&mut self) {
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].consumer_gone() {
                let row = self.take_row(i, false);
                drop(row); // nobody to tell; its KV cache is freed here
            } else {
                i += 1;
            }
        }
    }

    /// Ends running row `i` with `reason` and tells its consumer.
    fn finish(&mut self, i: usize, reason: Finish) {
        let scope = self.running[i].request.cache_scope.clone().filter(|_| reason != Finish::Cancelled);
        let row = self.take_row(i, scope.is_some());
        let event = row.final_event(reason);
        let events = row.events.clone();
        if let Some(scope) = scope {
            // A finished turn's state goes back for the session's next turn;
            // a cancelled one is freed, as the client asked.
            let (tokens, cache) = row.into_cached_state();
            self.prefix.insert(scope, tokens, cache);
        } else {
            drop(row); // frees the KV cache before the consumer hears about it
        }
        self.deliver_final(events, event);
    }

    fn deliver_final(&mut self, events: tokio::sync::mpsc::Sender<EngineEvent>, event: EngineEvent) {
        match events.try_send(event) {
            Err(tokio::sync::mpsc::error::TrySendError::Full(event)) => self.undelivered.push((events, event)),
            _ => {}
        }
    }

    fn retry_undelivered(&mut self) {
        let pending = std::mem::take(&mut self.undelivered);
        for (events, event) in pending {
            self.deliver_final(events, event);
        }
    }

    fn fail_all(&mut self, message: &str) {
        if let Some(kv) = &mut self.batch {
            *kv = self.model.new_kv_batch();
        }
        for row in std::mem::take(&mut self.running) {
            let events = row.events.clone();
            drop(row);
            self.deliver_final(events, EngineEvent::Failed { message: message.to_string() });
        }
    }

    fn snapshot(&self) -> EngineStats {
        EngineStats {
            running: self.running.len(),
            waiting: self.waiting.len(),
            kv_bytes: self.running.iter().map(|r| r.cache.nbytes()).sum::<usize>() + self.batch.as_ref().map_or(0, KvBatch::nbytes),
            active_memory: mlx::memory::active(),
            peak_memory: mlx::memory::peak(),
            cache_memory: mlx::memory::cache(),
            prefix: self.prefix.stats(),
            ..self.stats.clone()
        }
    }
}
