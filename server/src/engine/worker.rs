//! The engine thread: its state and its loop. Each turn of the loop takes
//! commands, ends rows the edge stopped, admits what the scheduler lets in,
//! and runs one step (`step.rs`); finished rows hand their KV state to the
//! prefix cache and their consumers hear how they ended.
use std::collections::VecDeque;
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::time::Duration;

use tether_sched::{EngineError, EngineEvent, Finish, FinishInfo, Scheduler, SchedulerConfig, WaitingView};

use super::api::{EngineModelInfo, EngineStats, SubmitRequest};
use super::config::EngineConfig;
use super::handle::{Command, Submission};
use super::prefix::{PrefixCache, Scope};
use super::row::{Admitted, Row};
use super::speculate::DraftModel;
use crate::loaded::LoadedModel;
use crate::models::{Kv, KvQuantization, RowKv, SharedKvBatch, SlotLease, Transformer};

/// How long the loop waits for a command while it has nothing it can do
/// now but will have soon: every running row's consumer is full, or final
/// events wait for room. Short against a step, long against a spin.
const PAUSED_POLL: Duration = Duration::from_millis(2);

/// Idle time after which the engine returns the C heap's free pages to the
/// system (see [`mlx::memory::release_to_system`]).
const IDLE_BEFORE_HEAP_TRIM: Duration = Duration::from_millis(500);

pub(super) struct Engine {
    pub(super) config: EngineConfig,
    pub(super) model: Transformer,
    kv_bytes_per_token: usize,
    waiting: VecDeque<Submission>,
    pub(super) running: Vec<Row>,
    /// Final events that found their channel full; retried every turn.
    undelivered: Vec<(tokio::sync::mpsc::Sender<EngineEvent>, EngineEvent)>,
    pub(super) stats: EngineStats,
    shutting_down: bool,
    pub(super) scheduler: Scheduler,
    prefix: PrefixCache,
    pub(super) draft: Option<DraftModel>,
    /// Decoding rows' KV caches, when they are batched (see [`super::KvLayout`]).
    pub(super) batch: Option<SharedKvBatch>,
    /// `TETHER_TRACE_STEPS=1`: log every step's rows, tokens and time.
    pub(super) trace_steps: bool,
    /// Turns constrained rows' token bitmasks into allowed sets on the device.
    pub(super) mask_expander: super::step_masks::MaskExpander,
    /// The next decode step, already queued on the device (see `lookahead.rs`).
    pub(super) lookahead: Option<super::lookahead::Lookahead>,
}

/// What the loop does before its next turn.
enum Idle {
    /// Nothing to do until a command arrives.
    Block,
    /// Nothing to do right now, but rows or events will be ready soon.
    Poll,
    /// Work is ready.
    Busy,
}

pub(super) fn run<F>(config: EngineConfig, load: F, rx: Receiver<Command>, info_tx: Sender<anyhow::Result<EngineModelInfo>>)
where
    F: FnOnce() -> anyhow::Result<LoadedModel>,
{
    match Engine::load(config, load) {
        Ok((mut engine, info)) => {
            let _ = info_tx.send(Ok(info));
            engine.run(rx);
        }
        Err(e) => {
            let _ = info_tx.send(Err(e));
        }
    }
}

impl Engine {
    /// Loads the model (and draft model), warms a GPU's kernels, and builds
    /// the engine's state.
    fn load<F>(mut config: EngineConfig, load: F) -> anyhow::Result<(Engine, EngineModelInfo)>
    where
        F: FnOnce() -> anyhow::Result<LoadedModel>,
    {
        let mut model = load()?;
        let draft = config
            .draft_model
            .as_ref()
            .map(|spec| DraftModel::load(spec, model.transformer.config.vocab_size))
            .transpose()
            .map_err(|e| e.context("loading the draft model"))?;
        let batched = config.kv_layout.batched_on(mlx::default_device());
        // Batched slots hold codes from a slot's first position (kv_batch.rs).
        if batched {
            config.kv_quantization = config.kv_quantization.map(|q| KvQuantization { start: 0, ..q });
        }
        anyhow::ensure!(
            !batched || model.transformer.config.hybrid.is_none(),
            "{} keeps recurrent state per row, which batched KV slots do not hold yet: serve it with --kv-layout rows",
            model.transformer.config.arch.name()
        );
        anyhow::ensure!(
            !batched || model.transformer.config.layer_plan.is_none(),
            "{} has layers of different shapes and KV-shared layers, which batched KV slots do not hold yet: serve it with --kv-layout rows",
            model.transformer.config.arch.name()
        );
        match batched {
            true => model.transformer.set_batched_kv_quantization(config.kv_quantization),
            false => model.transformer.set_kv_quantization(config.kv_quantization),
        }
        .map_err(|e| anyhow::anyhow!("--kv-bits: {e}"))?;
        if mlx::default_device() == mlx::Device::Gpu {
            super::warmup::warm_up(&model.transformer, &config, batched).map_err(|e| anyhow::anyhow!("warming up the model's kernels failed: {e}"))?;
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
        // Separates prefix-cache state computed under different models,
        // dtypes, weight forms or KV quantizations.
        let namespace = {
            use std::hash::{Hash, Hasher};
            let mut h = std::collections::hash_map::DefaultHasher::new();
            (model.path.display().to_string(), format!("{:?}", model.transformer.dtype), model.transformer.weight_form(), config.kv_quantization).hash(&mut h);
            h.finish()
        };
        let engine = Engine {
            prefix: PrefixCache::with_disk_tier(config.prefix_cache_bytes, config.prefix_block_tokens, namespace, config.kv_disk.as_ref())
                .map_err(|e| anyhow::anyhow!("opening the KV disk tier in {:?} failed: {e}", config.kv_disk.as_ref().map(|d| &d.dir)))?
                .with_host_tier(config.kv_host_bytes),
            draft,
            batch: batched.then(|| std::rc::Rc::new(std::cell::RefCell::new(model.transformer.new_kv_batch()))),
            scheduler: Scheduler::new(scheduler_config(&config, batched)),
            trace_steps: super::tracing(),
            mask_expander: Default::default(),
            lookahead: None,
            config,
            model: model.transformer,
            kv_bytes_per_token,
            waiting: VecDeque::new(),
            running: Vec::new(),
            undelivered: Vec::new(),
            stats: EngineStats::default(),
            shutting_down: false,
        };
        Ok((engine, info))
    }

    fn run(&mut self, rx: Receiver<Command>) {
        loop {
            let next = match self.idle() {
                Idle::Busy => rx.try_recv().map_err(|e| e == TryRecvError::Disconnected),
                Idle::Poll => rx.recv_timeout(PAUSED_POLL).map_err(|e| e == RecvTimeoutError::Disconnected),
                Idle::Block if self.shutting_down => return,
                Idle::Block => Self::wait_idle(&rx),
            };
            match next {
                Ok(cmd) => {
                    self.handle(cmd);
                    self.drain(&rx);
                }
                Err(true) => self.shutting_down = true,
                Err(false) => {}
            }
            self.retry_undelivered();
            self.end_stopped_rows();
            self.admit();
            if let Err(e) = self.step() {
                self.fail_all(EngineError::Internal(format!("engine step failed: {e}")));
            }
            if self.stats.steps.is_multiple_of(self.config.reclaim_every_steps) {
                self.prefix.maintain();
                let _ = mlx::memory::clear_cache();
            }
        }
    }

    /// Waits for the next command with nothing to do. MLX's cached buffers
    /// go back at once; the C heap's free pages only once the engine has
    /// been idle a while, so a client's next turn never waits on the trim.
    fn wait_idle(rx: &Receiver<Command>) -> Result<Command, bool> {
        let _ = mlx::memory::clear_cache();
        match rx.recv_timeout(IDLE_BEFORE_HEAP_TRIM) {
            Ok(cmd) => Ok(cmd),
            Err(RecvTimeoutError::Disconnected) => Err(true),
            Err(RecvTimeoutError::Timeout) => {
                let _ = mlx::memory::release_to_system();
                rx.recv().map_err(|_| true)
            }
        }
    }

    /// Busy only when a step can make progress now: a row can publish, or
    /// nothing runs and a request waits (the first one always gets a row).
    /// Rows paused on full consumers, requests waiting behind them, and
    /// final events waiting for room are polled, never spun on.
    fn idle(&self) -> Idle {
        if self.running.iter().any(Row::can_publish) || (self.running.is_empty() && !self.waiting.is_empty()) {
            Idle::Busy
        } else if !self.running.is_empty() || !self.waiting.is_empty() || !self.undelivered.is_empty() {
            Idle::Poll
        } else {
            Idle::Block
        }
    }

    /// Takes every command already sent.
    fn drain(&mut self, rx: &Receiver<Command>) {
        loop {
            match rx.try_recv() {
                Ok(cmd) => self.handle(cmd),
                Err(TryRecvError::Empty) => return,
                Err(TryRecvError::Disconnected) => {
                    self.shutting_down = true;
                    return;
                }
            }
        }
    }

    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Submit(submission) => self.enqueue(*submission),
            Command::Stats { reply } => {
                let _ = reply.send(self.snapshot());
            }
            Command::DropScope { scope } => self.prefix.drop_scope(&scope),
            Command::SetScopeLive { scope, live } => self.prefix.set_scope_live(&scope, live),
            Command::Shutdown => self.shutting_down = true,
        }
    }

    /// Queues a submission, or refuses it with the reason.
    fn enqueue(&mut self, s: Submission) {
        let needed = self.reserved_bytes(&s.request);
        let refusal = if self.shutting_down {
            Some(EngineError::ShuttingDown)
        } else if self.waiting.len() >= self.config.max_waiting {
            Some(EngineError::Overloaded { waiting: self.waiting.len() })
        } else if !self.scheduler.fits_alone(needed) {
            Some(EngineError::OverKvBudget { needed, budget: self.config.kv_budget_bytes })
        } else {
            None
        };
        match refusal {
            Some(e) => self.deliver_final(s.events, EngineEvent::Failed(e)),
            None => self.waiting.push_back(s),
        }
    }

    /// KV bytes a request can grow to (prompt + max_tokens, in cache blocks),
    /// in the form its cache ends in: codes once it passes the quantization's start;
    /// plus a hybrid model's recurrent state, the same at any length, and
    /// its checkpoints (`models/state_rows.rs`).
    /// (The conversion itself briefly holds both forms; a row converts once.)
    fn reserved_bytes(&self, r: &SubmitRequest) -> usize {
        let tokens = (r.prompt.len() + r.max_tokens).next_multiple_of(crate::models::KV_CAPACITY_STEP);
        let state = crate::models::MAX_STATES * self.model.config.state_bytes_per_row(self.model.dtype.size());
        state
            + match self.config.kv_quantization {
                Some(q) if tokens > q.start => tokens * q.bytes_per_token(&self.model.config),
                _ => tokens * self.kv_bytes_per_token,
            }
    }

    /// Ends the rows and waiting requests the edge stopped (or whose
    /// consumer went away) before they take another step.
    fn end_stopped_rows(&mut self) {
        let mut i = 0;
        while i < self.running.len() {
            match self.running[i].stop_requested() {
                Some(reason) => self.finish(i, reason.finish()),
                None => i += 1,
            }
        }
        let (stopped, waiting): (Vec<_>, Vec<_>) =
            std::mem::take(&mut self.waiting).into_iter().partition(|w| w.stop.requested().is_some() || w.events.is_closed());
        self.waiting = waiting.into();
        for w in stopped {
            let reason = w.stop.requested().map_or(Finish::Cancelled, |r| r.finish());
            let event =
                EngineEvent::Finished(FinishInfo { reason, prompt_tokens: w.request.prompt.len(), cached_tokens: 0, completion_tokens: 0, speculative: None });
            self.deliver_final(w.events, event);
        }
    }

    /// Moves the waiting requests the scheduler admits into rows: each
    /// resumes from the longest prefix its scope has cached and, when
    /// caches are batched, takes its slot.
    fn admit(&mut self) {
        // Most steps have nobody waiting or no free row: skip building views.
        if self.waiting.is_empty() || self.running.len() >= self.config.max_running {
            return;
        }
        let kv_bytes: Vec<usize> = self.waiting.iter().map(|w| self.reserved_bytes(&w.request)).collect();
        let admitted = {
            let waiting: Vec<WaitingView<'_>> =
                self.waiting.iter().zip(&kv_bytes).map(|(w, &kv_bytes)| WaitingView { id: w.id, session: w.request.session.as_deref(), kv_bytes }).collect();
            let running: Vec<_> = self.running.iter().map(|r| r.view(None)).collect();
            self.scheduler.admit(&waiting, &running)
        };
        for id in admitted {
            let pos = self.waiting.iter().position(|w| w.id == id).expect("the scheduler admits waiting requests");
            let w = self.waiting.remove(pos).expect("position is valid");
            let queue_ms = w.queued_at.elapsed().as_secs_f64() * 1e3;
            let kv_bytes = self.reserved_bytes(&w.request);
            let events = w.events.clone();
            let admitted = Admitted { id: w.id, request: w.request, events: w.events, stop: w.stop, kv_bytes };
            let mut row = match Row::new(admitted, self.model.new_cache(), self.draft.as_ref().map(|d| &d.model)) {
                Ok(row) => row,
                Err(e) => {
                    self.deliver_final(events, EngineEvent::Failed(EngineError::Internal(format!("setting up the request failed: {e}"))));
                    continue;
                }
            };
            if let Some(scope) = &row.request.cache_scope {
                // The session's own entry is lent (no copy of its history)
                // only to a row that keeps its own cache (a batched slot
                // copies the hit in anyway) and when no other request of the
                // session would look for it meanwhile.
                let lend = self.batch.is_none() && !self.has_request_of(scope);
                if let Some(hit) = self.prefix.lookup(scope, row.progress.prompt(), self.scheduler.prefill_token_seconds(), lend) {
                    row.resume_from(hit);
                }
            }
            if let Err(e) = self.seat(&mut row) {
                self.deliver_final(events, EngineEvent::Failed(EngineError::Internal(format!("no room in the KV batch: {e}"))));
                continue;
            }
            let _ = row.events.try_send(EngineEvent::Started { queue_ms });
            self.running.push(row);
        }
    }

    /// Whether a request of cache scope `scope` waits or runs.
    fn has_request_of(&self, scope: &Scope) -> bool {
        let of_scope = |r: &SubmitRequest| r.cache_scope.as_ref() == Some(scope);
        self.waiting.iter().any(|w| of_scope(&w.request)) || self.running.iter().any(|r| of_scope(&r.request))
    }

    /// Gives a new row its slot when caches are batched: it reads its prompt
    /// there too, so prompt chunks share the step's attention with the
    /// decoding rows instead of adding their own kernels, and the finished
    /// prompt needs no move. A prefix-cache hit is copied in. The slot gets
    /// the whole prompt's room now (see [`KvBatch::admit`]).
    fn seat(&mut self, row: &mut Row) -> mlx::Result<()> {
        let (Some(batch), RowKv::Own(cache)) = (&self.batch, &row.kv) else { return Ok(()) };
        row.kv = RowKv::Slot(SlotLease::admit(batch, cache, row.request.prompt.len() + 1)?);
        Ok(())
    }

    /// Removes row `i` from the running set. A row whose cache is batched
    /// gets it back as its own when `keep_cache` (to store it in the prefix
    /// cache); otherwise its slot is freed when the row is dropped.
    fn take_row(&mut self, i: usize, keep_cache: bool) -> Row {
        let mut row = self.running.remove(i);
        if keep_cache && matches!(row.kv, RowKv::Slot(_)) {
            if let RowKv::Slot(lease) = std::mem::replace(&mut row.kv, RowKv::Own(self.model.new_cache())) {
                // On an error the turn still finishes; only its cache entry is lost.
                row.kv = RowKv::Own(lease.release().unwrap_or_else(|_| self.model.new_cache()));
            }
        }
        row
    }

    /// Ends running row `i` with `reason` and tells its consumer. A turn
    /// that ended normally (an end token, a stop string, its length or time
    /// limit) leaves its KV state in the prefix cache for the session's next
    /// turn; what a cancelled one computed is freed, as the client asked
    /// (the history it was lent goes back).
    pub(super) fn finish(&mut self, i: usize, reason: Finish) {
        let cancelled = reason == Finish::Cancelled;
        let scope = self.running[i].request.cache_scope.clone().filter(|_| !cancelled);
        let row = self.take_row(i, scope.is_some());
        let event = row.final_event(reason);
        let events = row.events.clone();
        match scope {
            Some(scope) => {
                if let Some((tokens, cache, origin)) = row.into_cached_state() {
                    self.prefix.insert_continuing(scope, tokens, cache, origin);
                }
            }
            // Frees the KV cache before the consumer hears about it (a lent
            // history goes back through its lease).
            None => row.give_back_lent_history(),
        }
        self.deliver_final(events, event);
    }

    /// Ends running row `i` with `error`: its state is freed, as for a
    /// cancelled turn, and its consumer hears why.
    pub(super) fn fail(&mut self, i: usize, error: EngineError) {
        let row = self.take_row(i, false);
        let events = row.events.clone();
        drop(row);
        self.deliver_final(events, EngineEvent::Failed(error));
    }

    fn deliver_final(&mut self, events: tokio::sync::mpsc::Sender<EngineEvent>, event: EngineEvent) {
        if let Err(tokio::sync::mpsc::error::TrySendError::Full(event)) = events.try_send(event) {
            self.undelivered.push((events, event));
        }
    }

    fn retry_undelivered(&mut self) {
        for (events, event) in std::mem::take(&mut self.undelivered) {
            if !events.is_closed() {
                self.deliver_final(events, event);
            }
        }
    }

    fn fail_all(&mut self, error: EngineError) {
        for row in std::mem::take(&mut self.running) {
            let events = row.events.clone();
            drop(row); // its slot, if it held one, goes back to the batch
            self.deliver_final(events, EngineEvent::Failed(error.clone()));
        }
        // Whatever state a failed step left in the batch goes with it.
        self.lookahead = None;
        if let Some(kv) = &self.batch {
            *kv.borrow_mut() = self.model.new_kv_batch();
        }
    }

    fn snapshot(&mut self) -> EngineStats {
        EngineStats {
            running: self.running.len(),
            waiting: self.waiting.len(),
            kv_bytes: self.running.iter().map(|r| r.kv.nbytes()).sum::<usize>() + self.batch.as_ref().map_or(0, |b| b.borrow().nbytes()),
            active_memory: mlx::memory::active(),
            peak_memory: mlx::memory::peak(),
            cache_memory: mlx::memory::cache(),
            prefix: self.prefix.stats(),
            ..self.stats.clone()
        }
    }
}

fn scheduler_config(config: &EngineConfig, batched_kv: bool) -> SchedulerConfig {
    SchedulerConfig {
        max_running: config.max_running,
        step_token_budget: config.step_token_budget,
        step_draft_budget: config.step_draft_budget,
        prefill_chunk: config.prefill_chunk,
        min_prefill_chunk: config.min_prefill_chunk,
        max_prefill_chunk: config.max_prefill_chunk,
        kv_budget_bytes: config.kv_budget_bytes,
        // Chunks that fit the shared attention's smallest multi-query shape
        // (more would each attend alone: a dozen kernels a layer apiece).
        widened_chunk_max: crate::models::SMALL_QUERIES,
        batched_kv,
        max_itl_inflation: config.max_itl_inflation,
    }
}
