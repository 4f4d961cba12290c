//! Prometheus metrics (`GET /metrics`, OpenMetrics text). Engine gauges are
//! refreshed from [`EngineStats`] on every scrape.
use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use protocol::{ErrorCode, FinishReason};

use crate::engine::EngineStats;

type Labels = [(&'static str, &'static str); 1];

pub struct Metrics {
    registry: Registry,
    pub sessions: Gauge,
    pub connections: Gauge,
    pub requests_in_flight: Gauge,
    requests: Family<Labels, Counter>,
    errors: Family<Labels, Counter>,
    pub generated_tokens: Counter,
    pub prompt_tokens: Counter,
    pub replayed_frames: Counter,
    pub sessions_expired: Counter,
    pub sessions_evicted: Counter,
    engine_running: Gauge,
    engine_waiting: Gauge,
    engine_kv_bytes: Gauge,
    engine_active_memory: Gauge,
    engine_peak_memory: Gauge,
    engine_cache_memory: Gauge,
    engine_steps: Counter<u64, AtomicU64>,
    lookahead_served: Counter<u64, AtomicU64>,
    lookahead_dropped: Counter<u64, AtomicU64>,
    prefix_hits: Counter<u64, AtomicU64>,
    prefix_lent: Counter<u64, AtomicU64>,
    prefix_misses: Counter<u64, AtomicU64>,
    prefix_hit_tokens: Counter<u64, AtomicU64>,
    prefix_evictions: Counter<u64, AtomicU64>,
    prefix_entries: Gauge,
    prefix_bytes: Gauge,
    kv_host_entries: Gauge,
    kv_host_bytes: Gauge,
    kv_host_moves: Counter<u64, AtomicU64>,
    kv_host_hits: Counter<u64, AtomicU64>,
    kv_host_failed: Counter<u64, AtomicU64>,
    kv_host_restore_seconds: Counter<f64, AtomicU64>,
    kv_disk_entries: Gauge,
    kv_disk_bytes: Gauge,
    kv_disk_writes: Counter<u64, AtomicU64>,
    kv_disk_written_bytes: Counter<u64, AtomicU64>,
    kv_disk_hits: Counter<u64, AtomicU64>,
    kv_disk_failed_reads: Counter<u64, AtomicU64>,
    kv_disk_evictions: Counter<u64, AtomicU64>,
    kv_disk_read_seconds: Counter<f64, AtomicU64>,
    kv_disk_skipped: Counter<u64, AtomicU64>,
    spec_drafted: Counter<u64, AtomicU64>,
    spec_accepted: Counter<u64, AtomicU64>,
    spec_forwards: Counter<u64, AtomicU64>,
    spec_tokens: Counter<u64, AtomicU64>,
    step_time: Family<Labels, Counter<u64, AtomicU64>>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("tether");
        let m = Metrics {
            registry: Registry::default(),
            sessions: Gauge::default(),
            connections: Gauge::default(),
            requests_in_flight: Gauge::default(),
            requests: Family::default(),
            errors: Family::default(),
            generated_tokens: Counter::default(),
            prompt_tokens: Counter::default(),
            replayed_frames: Counter::default(),
            sessions_expired: Counter::default(),
            sessions_evicted: Counter::default(),
            engine_running: Gauge::default(),
            engine_waiting: Gauge::default(),
            engine_kv_bytes: Gauge::default(),
            engine_active_memory: Gauge::default(),
            engine_peak_memory: Gauge::default(),
            engine_cache_memory: Gauge::default(),
            engine_steps: Counter::default(),
            lookahead_served: Counter::default(),
            lookahead_dropped: Counter::default(),
            prefix_hits: Counter::default(),
            prefix_lent: Counter::default(),
            prefix_misses: Counter::default(),
            prefix_hit_tokens: Counter::default(),
            prefix_evictions: Counter::default(),
            prefix_entries: Gauge::default(),
            prefix_bytes: Gauge::default(),
            kv_host_entries: Gauge::default(),
            kv_host_bytes: Gauge::default(),
            kv_host_moves: Counter::default(),
            kv_host_hits: Counter::default(),
            kv_host_failed: Counter::default(),
            kv_host_restore_seconds: Counter::default(),
            kv_disk_entries: Gauge::default(),
            kv_disk_bytes: Gauge::default(),
            kv_disk_writes: Counter::default(),
            kv_disk_written_bytes: Counter::default(),
            kv_disk_hits: Counter::default(),
            kv_disk_failed_reads: Counter::default(),
            kv_disk_evictions: Counter::default(),
            kv_disk_read_seconds: Counter::default(),
            kv_disk_skipped: Counter::default(),
            spec_drafted: Counter::default(),
            spec_accepted: Counter::default(),
            spec_forwards: Counter::default(),
            spec_tokens: Counter::default(),
            step_time: Family::default(),
        };
        registry.register("sessions", "Sessions alive (attached or awaiting resume)", m.sessions.clone());
        registry.register("connections", "Open WebSocket connections", m.connections.clone());
        registry.register("requests_in_flight", "Generation requests in flight", m.requests_in_flight.clone());
        registry.register("requests", "Finished generation requests by finish reason (or error)", m.requests.clone());
        registry.register("errors", "Error frames sent, by code", m.errors.clone());
        registry.register("generated_tokens", "Tokens generated and streamed", m.generated_tokens.clone());
        registry.register("prompt_tokens", "Prompt tokens submitted", m.prompt_tokens.clone());
        registry.register("replayed_frames", "Frames replayed on resume", m.replayed_frames.clone());
        registry.register("sessions_expired", "Sessions dropped after their TTL", m.sessions_expired.clone());
        registry.register("sessions_evicted", "Detached sessions ended early to make room for a new session at the session limit", m.sessions_evicted.clone());
        registry.register("engine_running", "Requests holding an engine row", m.engine_running.clone());
        registry.register("engine_waiting", "Requests queued in the engine", m.engine_waiting.clone());
        registry.register("engine_kv_bytes", "KV cache bytes held by live requests", m.engine_kv_bytes.clone());
        registry.register("engine_active_memory_bytes", "MLX bytes held by live arrays", m.engine_active_memory.clone());
        registry.register("engine_peak_memory_bytes", "MLX peak active bytes", m.engine_peak_memory.clone());
        registry.register("engine_cache_memory_bytes", "MLX free-buffer cache bytes", m.engine_cache_memory.clone());
        registry.register("engine_steps", "Engine steps run", m.engine_steps.clone());
        registry.register("engine_lookahead_served_steps", "Decode steps queued before the step before them was read, and used", m.lookahead_served.clone());
        registry.register(
            "engine_lookahead_dropped_steps",
            "Decode steps queued ahead and dropped (a row ended, joined or changed its work)",
            m.lookahead_dropped.clone(),
        );
        registry.register("prefix_cache_hits", "Requests that resumed from a cached prefix", m.prefix_hits.clone());
        registry.register(
            "prefix_cache_lent",
            "Hits that handed a session's own cached history to its turn (no copy; it leaves the cache until the turn ends)",
            m.prefix_lent.clone(),
        );
        registry.register("prefix_cache_misses", "Requests with a cache scope that found no cached prefix", m.prefix_misses.clone());
        registry.register("prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache", m.prefix_hit_tokens.clone());
        registry.register("prefix_cache_evictions", "Prefix-cache entries evicted under the byte budget", m.prefix_evictions.clone());
        registry.register("prefix_cache_entries", "Prefix-cache entries held", m.prefix_entries.clone());
        registry.register("prefix_cache_bytes", "KV bytes held by the prefix cache", m.prefix_bytes.clone());
        registry.register("kv_host_entries", "Prefix-cache entries held in the host tier", m.kv_host_entries.clone());
        registry.register("kv_host_bytes", "Bytes of prefix-cache entries in the host tier", m.kv_host_bytes.clone());
        registry.register("kv_host_moves", "Prefix-cache entries moved out of RAM into the host tier", m.kv_host_moves.clone());
        registry.register("kv_host_hits", "Prefix-cache hits restored from the host tier", m.kv_host_hits.clone());
        registry.register("kv_host_failed", "Host-tier entries that could not serve (their shared prefix gone): misses", m.kv_host_failed.clone());
        registry.register("kv_host_restore_seconds", "Time spent restoring host-tier entries for hits", m.kv_host_restore_seconds.clone());
        registry.register("kv_disk_entries", "Prefix-cache entries held on disk", m.kv_disk_entries.clone());
        registry.register("kv_disk_bytes", "Bytes of prefix-cache files on disk", m.kv_disk_bytes.clone());
        registry.register("kv_disk_writes", "Prefix-cache entries written to disk out of RAM", m.kv_disk_writes.clone());
        registry.register("kv_disk_written_bytes", "Bytes written to the KV disk tier", m.kv_disk_written_bytes.clone());
        registry.register("kv_disk_hits", "Prefix-cache hits read back from disk", m.kv_disk_hits.clone());
        registry.register("kv_disk_failed_reads", "KV files that could not serve (missing, damaged, other state): misses", m.kv_disk_failed_reads.clone());
        registry.register("kv_disk_evictions", "KV files dropped under the disk budget", m.kv_disk_evictions.clone());
        registry.register("kv_disk_read_seconds", "Time spent reading KV files back for hits", m.kv_disk_read_seconds.clone());
        registry.register(
            "kv_disk_skipped",
            "Matches on disk passed over: computing their tokens was expected to be faster than reading them",
            m.kv_disk_skipped.clone(),
        );
        registry.register("spec_drafted_tokens", "Draft tokens verified", m.spec_drafted.clone());
        registry.register("spec_accepted_tokens", "Draft tokens accepted", m.spec_accepted.clone());
        registry.register("spec_decode_forwards", "Decode forwards of speculating requests (per request row)", m.spec_forwards.clone());
        registry.register("spec_decode_tokens", "Tokens those forwards produced (tokens per forward = this / forwards)", m.spec_tokens.clone());
        registry.register(
            "engine_step_microseconds",
            "Engine-thread time per step phase: build (schedule, record the graph), eval (run it, read tokens back), publish",
            m.step_time.clone(),
        );
        Metrics { registry, ..m }
    }

    pub fn request_finished(&self, reason: FinishReason) {
        self.requests.get_or_create(&[("finish_reason", reason.as_str())]).inc();
    }

    pub fn request_failed(&self, code: ErrorCode) {
        self.requests.get_or_create(&[("finish_reason", code.as_str())]).inc();
    }

    pub fn error(&self, code: ErrorCode) {
        self.errors.get_or_create(&[("code", code.as_str())]).inc();
    }

    pub fn error_count(&self, code: ErrorCode) -> u64 {
        self.errors.get_or_create(&[("code", code.as_str())]).get()
    }

    /// OpenMetrics text, with the engine gauges set from `stats`.
    pub fn render(&self, stats: Option<&EngineStats>) -> String {
        if let Some(s) = stats {
            self.engine_running.set(s.running as i64);
            self.engine_waiting.set(s.waiting as i64);
            self.engine_kv_bytes.set(s.kv_bytes as i64);
            self.engine_active_memory.set(s.active_memory as i64);
            self.engine_peak_memory.set(s.peak_memory as i64);
            self.engine_cache_memory.set(s.cache_memory as i64);
            catch_up(&self.engine_steps, s.steps);
            catch_up(&self.lookahead_served, s.lookahead_served);
            catch_up(&self.lookahead_dropped, s.lookahead_dropped);
            catch_up(&self.prefix_hits, s.prefix.hits);
            catch_up(&self.prefix_lent, s.prefix.lent);
            catch_up(&self.prefix_misses, s.prefix.misses);
            catch_up(&self.prefix_hit_tokens, s.prefix.hit_tokens);
            catch_up(&self.prefix_evictions, s.prefix.evictions);
            self.prefix_entries.set(s.prefix.entries as i64);
            self.prefix_bytes.set(s.prefix.bytes as i64);
            let h = &s.prefix.host;
            self.kv_host_entries.set(h.entries as i64);
            self.kv_host_bytes.set(h.bytes as i64);
            catch_up(&self.kv_host_moves, h.moves);
            catch_up(&self.kv_host_hits, h.hits);
            catch_up(&self.kv_host_failed, h.failed);
            catch_up_seconds(&self.kv_host_restore_seconds, h.restore_seconds);
            let d = &s.prefix.disk;
            self.kv_disk_entries.set(d.entries as i64);
            self.kv_disk_bytes.set(d.bytes as i64);
            catch_up(&self.kv_disk_writes, d.writes);
            catch_up(&self.kv_disk_written_bytes, d.written_bytes);
            catch_up(&self.kv_disk_hits, d.hits);
            catch_up(&self.kv_disk_failed_reads, d.failed_reads);
            catch_up(&self.kv_disk_evictions, d.evictions);
            catch_up(&self.kv_disk_skipped, d.skipped);
            catch_up_seconds(&self.kv_disk_read_seconds, d.read_seconds);
            catch_up(&self.spec_drafted, s.drafted_tokens);
            catch_up(&self.spec_accepted, s.accepted_draft_tokens);
            catch_up(&self.spec_forwards, s.spec_decode_forwards);
            catch_up(&self.spec_tokens, s.spec_decode_tokens);
            for (phase, total) in [("build", s.step_time.build_us), ("eval", s.step_time.eval_us), ("publish", s.step_time.publish_us)] {
                catch_up(&self.step_time.get_or_create(&[("phase", phase)]), total);
            }
        }
        let mut out = String::new();
        encode(&mut out, &self.registry).expect("writing to a String cannot fail");
        out
    }
}

/// Raises a counter mirrored from the engine's running total to that total.
fn catch_up(counter: &Counter<u64, AtomicU64>, total: u64) {
    let seen = counter.get();
    if total > seen {
        counter.inc_by(total - seen);
    }
}

/// [`catch_up`] for a counter of seconds.
fn catch_up_seconds(counter: &Counter<f64, AtomicU64>, total: f64) {
    let seen = counter.get();
    if total > seen {
        counter.inc_by(total - seen);
    }
}
