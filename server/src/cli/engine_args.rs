//! The engine's flags: scheduling (`tether serve`), and how rows hold their
//! KV state (`tether serve` and `tether bench`).
use clap::{Args, ValueEnum};
use tether::engine::{EngineConfig, KvLayout};

/// The engine's scheduling knobs.
#[derive(Args)]
pub(super) struct EngineArgs {
    /// Prompt tokens per prefill chunk (a request may ask for its own `chunk_size`).
    #[arg(long, default_value_t = EngineConfig::default().prefill_chunk)]
    prefill_chunk: usize,
    /// Fewest prompt tokens a step carries while streams decode (and the
    /// smallest `chunk_size` a request may ask for): a long prompt always
    /// moves, even where this many tokens cost more than --max-itl-inflation allows.
    #[arg(long, default_value_t = EngineConfig::default().min_prefill_chunk)]
    min_prefill_chunk: usize,
    /// Tokens (decode + prefill) per engine step.
    #[arg(long, default_value_t = EngineConfig::default().step_token_budget)]
    step_token_budget: usize,
    /// Requests decoding or prefilling at once (the batch).
    #[arg(long, default_value_t = EngineConfig::default().max_running)]
    max_running: usize,
    /// Draft tokens (all rows together) one step may verify.
    #[arg(long, default_value_t = EngineConfig::default().step_draft_budget)]
    step_draft_budget: usize,
    /// Bytes of KV state the prefix cache may hold, in MiB.
    #[arg(long, default_value_t = EngineConfig::default().prefix_cache_bytes >> 20)]
    prefix_cache_mib: usize,
    /// Bytes of evicted prefix-cache entries kept in memory, in MiB, in their
    /// compact file form (a session's without the shared prefix), before
    /// they go to disk: idle sessions come back with a copy, not a read.
    /// 0: none.
    #[arg(long, default_value_t = 0)]
    kv_host_mib: usize,
    /// Bytes of KV files the prefix cache may keep on disk, in MiB: entries
    /// RAM cannot hold (idle sessions' first) are written there and read
    /// back on their session's next turn. 0: they are dropped.
    #[arg(long, default_value_t = 0)]
    kv_disk_mib: usize,
    /// Where those files go (a folder per server process under it, removed
    /// when it stops). Default: `kv` under the cache directory.
    #[arg(long)]
    kv_dir: Option<std::path::PathBuf>,
    /// Where decoding rows keep their KV caches.
    #[arg(long, value_enum, default_value_t = KvLayoutArg::Auto)]
    kv_layout: KvLayoutArg,
    #[command(flatten)]
    kv: KvArgs,
    /// While streams decode, a step carries only as many prompt tokens as
    /// keep it within this multiple of a decode-only step (measured); 1 or
    /// less: prompt chunks are bounded by --prefill-chunk alone.
    #[arg(long, default_value_t = EngineConfig::default().max_itl_inflation)]
    max_itl_inflation: f64,
    /// Build each plain decode step while the step before it is still on
    /// the device, from its unread tokens (batched KV slots only: the GPU's
    /// default layout). Off: every step is built after the last one is read.
    #[arg(long, value_enum, default_value_t = Switch::On)]
    lookahead: Switch,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(super) enum Switch {
    On,
    Off,
}

impl EngineArgs {
    pub(super) fn config(&self) -> anyhow::Result<EngineConfig> {
        let d = EngineConfig::default();
        anyhow::ensure!(self.prefill_chunk >= 1 && self.step_token_budget >= 1 && self.max_running >= 1, "engine sizes must be at least 1");
        anyhow::ensure!((1..=self.prefill_chunk).contains(&self.min_prefill_chunk), "--min-prefill-chunk must be between 1 and --prefill-chunk");
        anyhow::ensure!(self.max_itl_inflation.is_finite(), "--max-itl-inflation must be a number");
        Ok(EngineConfig {
            prefill_chunk: self.prefill_chunk,
            min_prefill_chunk: self.min_prefill_chunk,
            max_prefill_chunk: d.max_prefill_chunk.max(self.prefill_chunk),
            step_token_budget: self.step_token_budget,
            max_running: self.max_running,
            prefix_cache_bytes: self.prefix_cache_mib << 20,
            kv_host_bytes: self.kv_host_mib << 20,
            kv_disk: (self.kv_disk_mib > 0).then(|| tether::engine::DiskTierConfig {
                dir: self.kv_dir.clone().unwrap_or_else(|| tether::registry::cache_dir().join("kv")),
                budget_bytes: self.kv_disk_mib << 20,
            }),
            step_draft_budget: self.step_draft_budget,
            kv_layout: self.kv_layout.layout(),
            kv_quantization: self.kv.quantization()?,
            max_itl_inflation: self.max_itl_inflation,
            lookahead: self.lookahead == Switch::On,
            ..d
        })
    }
}

#[derive(Clone, Copy, ValueEnum)]
pub(super) enum KvLayoutArg {
    /// Batched on a GPU, per row on the CPU.
    Auto,
    /// Each row its own cache (attention row by row, or the CPU's fused kernel).
    Rows,
    /// Slots of one shared buffer: one attention per layer for all decoding rows.
    Batched,
}

impl KvLayoutArg {
    pub(super) fn layout(self) -> KvLayout {
        match self {
            KvLayoutArg::Auto => KvLayout::Auto,
            KvLayoutArg::Rows => KvLayout::Rows,
            KvLayoutArg::Batched => KvLayout::Batched,
        }
    }
}

/// How rows hold their KV state.
#[derive(Args)]
pub(super) struct KvArgs {
    /// Bits per KV feature: 32 (full precision), 8 or 4 (affine codes in
    /// groups: a little over a quarter, or an eighth, of float32's bytes). A
    /// row turns to codes once past --kv-quantized-start tokens; batched
    /// slots (a GPU's) hold codes from the first token.
    #[arg(long, default_value_t = 32)]
    kv_bits: u32,
    /// Features per group of codes (one scale and bias each); divides the head size.
    #[arg(long, default_value_t = 64)]
    pub(super) kv_group_size: usize,
    /// Tokens a row keeps in full precision before its KV turns to codes.
    #[arg(long, default_value_t = 256)]
    pub(super) kv_quantized_start: usize,
}

impl KvArgs {
    pub(super) fn quantization(&self) -> anyhow::Result<Option<tether::models::KvQuantization>> {
        let bits = match self.kv_bits {
            32 => return Ok(None),
            8 => 8,
            4 => 4,
            b => anyhow::bail!("--kv-bits must be 32, 8 or 4, got {b}"),
        };
        anyhow::ensure!(self.kv_group_size > 0, "--kv-group-size must be at least 1");
        Ok(Some(tether::models::KvQuantization { bits, group: self.kv_group_size, start: self.kv_quantized_start }))
    }
}
