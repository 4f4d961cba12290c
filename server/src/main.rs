//! The `tether` command line.
use std::io::Write;
use std::ops::ControlFlow;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use tether::engine::speculate::DraftKind;
use tether::engine::{EngineConfig, EngineHandle};
use tether::generate::{generate, GenerateOptions};
use tether::loaded::LoadedModel;
use tether::model::{LoadOptions, WeightFormat};
use tether::registry;
use tether::sample::SamplingParams;
use tether::server::ServerConfig;
use tether::stop::{StopMatcher, StopScan};
use tether::tokenizer::{ChatMessage, TextTokenizer};

/// jemalloc for the whole process: with `unprefixed_malloc_on_supported_platforms`
/// it also answers MLX's C++ allocations (every graph node allocates), which
/// glibc's malloc served slowly from two threads at once (an engine thread
/// building a step while MLX's stream thread frees the last): one-stream CPU
/// decode ran 25-30% faster with it (docs/performance.md).
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[derive(Parser)]
#[command(name = "tether", version, about = "A stateful, streaming LLM inference server")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
// Parsed once at start: the size of the largest variant costs nothing.
#[allow(clippy::large_enum_variant)]
enum Command {
    /// Download a known model into the model cache and verify its hash.
    FetchModel {
        /// A known model name (see `tether models`).
        name: String,
    },
    /// List the models `fetch-model` knows.
    Models,
    /// Generate text from a prompt and stream it to stdout.
    Generate(GenerateArgs),
    /// Measure single-stream prefill and decode tokens/s (prints one JSON line).
    Bench(BenchArgs),
    /// Serve protocol v1 over WebSocket (`GET /v1/ws`), with `/healthz` and `/metrics`.
    Serve(ServeArgs),
}

#[derive(Args)]
struct ServeArgs {
    /// Engine workers, each with its own copy of the model (one per device,
    /// or replicas on one device); a session is pinned to one by its id.
    #[arg(long, default_value_t = 1)]
    workers: usize,
    #[command(flatten)]
    engine: EngineArgs,
    #[command(flatten)]
    model: ModelArgs,
    /// Default draft source for requests that do not choose one: `echo`
    /// (prompt lookup), `draft_model` (needs --draft-model), `off`, or
    /// `auto`: echo on the CPU, off on a GPU, where requests opt in: in
    /// bfloat16 a verification forward rounds differently from one-token
    /// decoding, so outputs can differ from speculation off, and prompt
    /// lookup gains little outside edits (see the README's Performance).
    #[arg(long, default_value = "auto")]
    speculation: String,
    /// A small model sharing --model's tokenizer that drafts for it, for
    /// requests with `speculation.source: "draft_model"` (e.g.
    /// qwen2.5-coder-0.5b for qwen2.5-coder-1.5b).
    #[arg(long)]
    draft_model: Option<String>,
    /// Default most draft tokens per verification (a request may ask for 1..=32).
    #[arg(long, default_value_t = tether::engine::speculate::DEFAULT_MAX_DRAFT)]
    max_draft: usize,
    /// Address to bind.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to bind; 0 picks a free one. The bound address is printed as
    /// `listening on http://HOST:PORT`.
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Bearer token clients must present (header, `?token=` or the
    /// `tether.bearer.<token>` subprotocol). Default: $TETHER_AUTH_TOKEN; none = no auth.
    #[arg(long)]
    auth_token: Option<String>,
    /// An allowed `Origin` (repeatable); none allows every origin.
    #[arg(long = "allow-origin")]
    allow_origin: Vec<String>,
    /// Largest client frame in bytes.
    #[arg(long, default_value_t = 1 << 20)]
    max_frame_bytes: usize,
    /// Most prompt tokens (default: the context length minus one).
    #[arg(long)]
    max_prompt_tokens: Option<usize>,
    /// Largest `max_tokens` a request may ask for.
    #[arg(long, default_value_t = 4096)]
    max_tokens: usize,
    /// Concurrent requests per session.
    #[arg(long, default_value_t = 8)]
    max_in_flight: usize,
    /// Sessions per server.
    #[arg(long, default_value_t = 256)]
    max_sessions: usize,
    /// Open connections per server.
    #[arg(long, default_value_t = 1024)]
    max_connections: usize,
    /// Seconds a session outlives its socket.
    #[arg(long, default_value_t = 60.0)]
    session_ttl_secs: f64,
    /// Seconds a socket may stay silent with nothing in flight.
    #[arg(long, default_value_t = 300.0)]
    idle_timeout_secs: f64,
    /// Frames kept per session for replay on resume.
    #[arg(long, default_value_t = 1024)]
    replay_frames: usize,
    /// Connection-level frames queued per socket.
    #[arg(long, default_value_t = 256)]
    outgoing_queue: usize,
    /// Seconds a client may stop reading before its socket is closed.
    #[arg(long, default_value_t = 30.0)]
    stall_timeout_secs: f64,
    /// Client frames per second per WebSocket, and HTTP requests per second
    /// per bearer token (burst: twice that).
    #[arg(long, default_value_t = 100.0)]
    rate_limit: f64,
    /// Seconds graceful shutdown waits for in-flight requests.
    #[arg(long, default_value_t = 30.0)]
    drain_timeout_secs: f64,
    /// Serve the static files of this folder on other GET paths, e.g. the
    /// browser playground built into `client-ts/dist/playground`.
    #[arg(long)]
    ui_dir: Option<std::path::PathBuf>,
}

#[derive(Args)]
struct BenchArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[arg(long, default_value_t = 512)]
    prompt_tokens: usize,
    #[arg(long, default_value_t = 128)]
    gen_tokens: usize,
    /// Concurrent streams through the engine (continuous batching); 0 runs
    /// the single-stream prefill/decode measurement instead.
    #[arg(long, default_value_t = 0)]
    streams: usize,
    /// Run a multi-turn agent session of this many turns instead (time to
    /// first token per turn, prefix cache on and off); each turn adds
    /// --prompt-tokens new tokens and generates --gen-tokens.
    #[arg(long, default_value_t = 0)]
    turns: usize,
    /// Run the speculative-decoding benchmark instead: a code-edit and (on
    /// models with FIM tokens) a FIM workload at these concurrency levels,
    /// speculation off then on, e.g. `--speculation-streams 1,8`.
    #[arg(long, value_delimiter = ',')]
    speculation_streams: Vec<usize>,
    /// Most draft tokens per verification in the speculation benchmark.
    #[arg(long, default_value_t = tether::engine::speculate::DEFAULT_MAX_DRAFT)]
    max_draft: usize,
    /// Also compare drafting with this model (same tokenizer as --model).
    #[arg(long)]
    draft_model: Option<String>,
    /// Draft tokens (all rows together) one engine step may verify.
    #[arg(long, default_value_t = EngineConfig::default().step_draft_budget)]
    step_draft_budget: usize,
    /// Default prompt tokens per prefill chunk (the server's --prefill-chunk).
    #[arg(long, default_value_t = EngineConfig::default().prefill_chunk)]
    prefill_chunk: usize,
    /// With --turns: run only the session with the prefix cache on.
    #[arg(long)]
    cached_only: bool,
    /// Run the quantized KV benchmark instead: perplexity of --kv-text and
    /// greedy agreement on windows of it, then decode speed after a
    /// --prompt-tokens history, full precision beside 8- and 4-bit codes
    /// (or the codes --kv-bits names).
    #[arg(long)]
    kv_quality: bool,
    /// The fixed text the quantized KV benchmark scores: its first --kv-text-tokens tokens.
    #[arg(long, default_value = "docs/architecture.md")]
    kv_text: std::path::PathBuf,
    #[arg(long, default_value_t = 2560)]
    kv_text_tokens: usize,
    /// Reference prompts for the quantized KV benchmark's greedy comparison: a
    /// greedy fixture (`cases[].prompt_ids`) of the same model.
    #[arg(long, default_value = "tests/fixtures/greedy/smollm2.json")]
    kv_prompts: std::path::PathBuf,
    #[command(flatten)]
    kv: KvArgs,
    /// Where decoding rows keep their KV caches.
    #[arg(long, value_enum, default_value_t = KvLayoutArg::Auto)]
    kv_layout: KvLayoutArg,
}

#[derive(Clone, Copy, ValueEnum)]
enum KvLayoutArg {
    /// Batched on a GPU, per row on the CPU.
    Auto,
    /// Each row its own cache (attention row by row, or the CPU's fused kernel).
    Rows,
    /// Slots of one shared buffer: one attention per layer for all decoding rows.
    Batched,
}

impl KvLayoutArg {
    fn layout(self) -> tether::engine::KvLayout {
        use tether::engine::KvLayout;
        match self {
            KvLayoutArg::Auto => KvLayout::Auto,
            KvLayoutArg::Rows => KvLayout::Rows,
            KvLayoutArg::Batched => KvLayout::Batched,
        }
    }
}

#[derive(Clone, Copy, ValueEnum)]
enum DeviceArg {
    /// The GPU when MLX has one, else the CPU.
    Auto,
    Cpu,
    Gpu,
}

#[derive(Args)]
struct ModelArgs {
    /// A known model name, a .gguf file, or an HF safetensors folder.
    #[arg(long, default_value = registry::DEFAULT_MODEL)]
    model: String,
    #[arg(long, value_enum, default_value = "auto")]
    device: DeviceArg,
    /// Weight storage: `dense` (compute dtype) or `quantized` (quantized GGUF
    /// blocks kept in an exact affine form where the device has a kernel).
    /// Default: quantized.
    #[arg(long)]
    weights: Option<String>,
    /// Activations, KV cache and dense weights: float32 (the CPU's default)
    /// or bfloat16/float16 (the GPU's default is bfloat16). float32 on a GPU
    /// brings batched and speculative outputs much closer to one-token
    /// decoding (the GPU's kernels still vary with the rows in a step).
    #[arg(long, value_enum, default_value = "auto")]
    dtype: DtypeArg,
}

#[derive(Clone, Copy, ValueEnum)]
enum DtypeArg {
    /// float32 on the CPU, bfloat16 on a GPU.
    Auto,
    F32,
    Bf16,
    F16,
}

#[derive(Args)]
struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[arg(long)]
    prompt: String,
    /// Treat the prompt as a user message and apply the model's chat template.
    #[arg(long)]
    chat: bool,
    /// A system message for --chat.
    #[arg(long)]
    system: Option<String>,
    #[arg(long, default_value_t = 256)]
    max_tokens: usize,
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    #[arg(long, default_value_t = 0)]
    top_k: u32,
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    #[arg(long)]
    seed: Option<u64>,
    /// Stop when this text appears (repeatable); it is not printed.
    #[arg(long)]
    stop: Vec<String>,
    /// Print timing to stderr.
    #[arg(long)]
    stats: bool,
}

fn main() -> ExitCode {
    mlx::apply_cuda_server_defaults();
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", error_chain(&e));
            ExitCode::FAILURE
        }
    }
}

/// The error and its causes, skipping causes whose text a message already
/// includes (many of our error types print their source inline).
fn error_chain(e: &anyhow::Error) -> String {
    let mut text = e.to_string();
    for cause in e.chain().skip(1) {
        let c = cause.to_string();
        if !text.contains(&c) {
            text.push_str(": ");
            text.push_str(&c);
        }
    }
    text
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::FetchModel { name } => {
            let path = registry::fetch(&name, &mut |msg| eprintln!("[fetch] {msg}"))?;
            println!("{}", path.display());
            Ok(())
        }
        Command::Models => {
            for m in registry::KNOWN_MODELS {
                let here = registry::models_dir().join(m.file_name).exists();
                println!("{:<22} {}{}", m.name, m.description, if here { " [fetched]" } else { "" });
            }
            Ok(())
        }
        Command::Generate(args) => run_generate(args),
        Command::Serve(args) => run_serve(args),
        Command::Bench(args) if !args.speculation_streams.is_empty() => {
            let config = EngineConfig { draft_model: draft_model_spec(&args.model, args.draft_model.as_deref())?, ..bench_engine_config(&args)? };
            let mut sources = vec![DraftKind::Echo];
            sources.extend(config.draft_model.is_some().then_some(DraftKind::Model));
            let (engine, tokenizer) = start_engine(&args.model, config)?;
            let fim = tether::server::FimTokens::detect(&tokenizer);
            tether::spec_bench::run_all(&engine, &tokenizer, fim.as_ref(), &args.speculation_streams, &sources, args.max_draft)
        }
        Command::Bench(args) if args.kv_quality => {
            let mut model = load_model(&args.model)?;
            let (group, start) = (args.kv.kv_group_size, args.kv.kv_quantized_start);
            // Both code widths unless --kv-bits names one.
            let bits = args.kv.quantization()?.map_or(vec![8, 4], |q| vec![q.bits]);
            let variants = tether::kv_bench::variants(&bits, group, start);
            let text = std::fs::read_to_string(&args.kv_text).map_err(|e| anyhow::anyhow!("reading {:?}: {e}", args.kv_text))?;
            let mut text = model.tokenizer.encode(&text, false)?;
            anyhow::ensure!(text.len() >= args.kv_text_tokens, "{:?} holds {} tokens, fewer than --kv-text-tokens", args.kv_text, text.len());
            text.truncate(args.kv_text_tokens);
            let fixture: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(&args.kv_prompts).map_err(|e| anyhow::anyhow!("reading {:?}: {e}", args.kv_prompts))?)?;
            let reference_prompts: Vec<Vec<u32>> = serde_json::from_value(
                fixture["cases"]
                    .as_array()
                    .ok_or_else(|| anyhow::anyhow!("{:?} has no cases", args.kv_prompts))?
                    .iter()
                    .map(|c| c["prompt_ids"].clone())
                    .collect::<Vec<_>>()
                    .into(),
            )?;
            // The windows pass the start, so their whole history turns to codes.
            let windows = tether::kv_bench::text_windows(&text, 20, start + 64)?;
            for row in tether::kv_bench::quality(&mut model, &text, &[("reference", reference_prompts), ("text_windows", windows)], &variants)? {
                println!("{}", serde_json::to_string(&row)?);
            }
            let history = tether::bench::prompt_tokens(&model, args.prompt_tokens)?;
            // At a long history the from-0 variants hold what the others do.
            let speed_variants: Vec<_> = variants.iter().copied().filter(|v| v.quantization.is_none_or(|q| q.start == start)).collect();
            for row in tether::kv_bench::speed(&mut model, &history, &speed_variants, args.gen_tokens, 3)? {
                println!("{}", serde_json::to_string(&row)?);
            }
            Ok(())
        }
        Command::Bench(args) if args.turns > 0 => {
            let (engine, tokenizer) = start_engine(&args.model, bench_engine_config(&args)?)?;
            for cache in [true, false].into_iter().filter(|&c| c || !args.cached_only) {
                for turn in tether::bench::run_agent_bench(&engine, &tokenizer, args.turns, args.prompt_tokens, args.gen_tokens, cache)? {
                    println!("{}", serde_json::to_string(&turn)?);
                }
            }
            Ok(())
        }
        Command::Bench(args) if args.streams > 0 => {
            let (engine, tokenizer) = start_engine(&args.model, bench_engine_config(&args)?)?;
            let prompt = tether::bench::prompt_tokens_with(&tokenizer, args.prompt_tokens)?;
            for streams in [1, args.streams] {
                let r = tether::bench::run_streams_bench(&engine, &args.model.model, prompt.clone(), streams, args.gen_tokens)?;
                println!("{}", serde_json::to_string(&r)?);
            }
            Ok(())
        }
        Command::Bench(args) => {
            let model = load_model(&args.model)?;
            let result = tether::bench::run_decode_bench(&model, args.prompt_tokens, args.gen_tokens)?;
            println!("{}", serde_json::to_string(&result)?);
            Ok(())
        }
    }
}

/// The engine a benchmark runs: the server's defaults but for what the
/// benchmark's flags set.
fn bench_engine_config(args: &BenchArgs) -> anyhow::Result<EngineConfig> {
    Ok(EngineConfig {
        step_draft_budget: args.step_draft_budget,
        kv_layout: args.kv_layout.layout(),
        prefill_chunk: args.prefill_chunk,
        kv_quantization: args.kv.quantization()?,
        ..EngineConfig::default()
    })
}

fn load_options(args: &ModelArgs) -> anyhow::Result<LoadOptions> {
    let device = pick_device(args)?;
    let mut opts = LoadOptions::for_device(device);
    match args.dtype {
        DtypeArg::Auto => {}
        DtypeArg::F32 => opts.dtype = mlx::Dtype::F32,
        DtypeArg::Bf16 => opts.dtype = mlx::Dtype::BF16,
        DtypeArg::F16 => opts.dtype = mlx::Dtype::F16,
    }
    if let Some(w) = &args.weights {
        opts.weights = WeightFormat::parse(w).ok_or_else(|| anyhow::anyhow!("--weights must be `dense` or `quantized`, got {w:?}"))?;
    }
    Ok(opts)
}

fn pick_device(args: &ModelArgs) -> anyhow::Result<mlx::Device> {
    Ok(match args.device {
        DeviceArg::Cpu => mlx::Device::Cpu,
        DeviceArg::Gpu if !mlx::gpu_available() => anyhow::bail!("--device gpu: this MLX build has no usable GPU"),
        DeviceArg::Gpu => mlx::Device::Gpu,
        DeviceArg::Auto if mlx::gpu_available() => mlx::Device::Gpu,
        DeviceArg::Auto => mlx::Device::Cpu,
    })
}

/// The draft model to load beside `target`: same device and weight form.
fn draft_model_spec(target: &ModelArgs, draft: Option<&str>) -> anyhow::Result<Option<tether::engine::speculate::DraftModelSpec>> {
    let Some(name) = draft else { return Ok(None) };
    Ok(Some(tether::engine::speculate::DraftModelSpec { path: registry::resolve(name)?, options: load_options(target)? }))
}

fn speculation_arg(source: &str, max_draft: usize, has_draft_model: bool, device: mlx::Device) -> anyhow::Result<tether::engine::speculate::Speculation> {
    use tether::engine::speculate::{DraftKind, Speculation};
    let kind = match source {
        "auto" if device == mlx::Device::Cpu => DraftKind::Echo,
        "auto" => DraftKind::Off,
        "echo" => DraftKind::Echo,
        "off" => DraftKind::Off,
        "draft_model" if has_draft_model => DraftKind::Model,
        "draft_model" => anyhow::bail!("--speculation draft_model needs --draft-model"),
        other => anyhow::bail!("--speculation must be `auto`, `echo`, `draft_model` or `off`, got {other:?}"),
    };
    anyhow::ensure!((1..=protocol::MAX_DRAFT_TOKENS as usize).contains(&max_draft), "--max-draft must be in [1, {}]", protocol::MAX_DRAFT_TOKENS);
    Ok(Speculation { kind, max_draft, ..Default::default() })
}

fn secs(name: &str, v: f64) -> anyhow::Result<Duration> {
    Duration::try_from_secs_f64(v).map_err(|_| anyhow::anyhow!("--{name} must be a non-negative number of seconds, got {v}"))
}

/// The engine's scheduling knobs.
#[derive(Args)]
struct EngineArgs {
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
}

/// How rows hold their KV state.
#[derive(Args)]
struct KvArgs {
    /// Bits per KV feature: 32 (full precision), 8 or 4 (affine codes in
    /// groups: a little over a quarter, or an eighth, of the bytes; the CPU
    /// only). A row turns to codes once past --kv-quantized-start tokens.
    #[arg(long, default_value_t = 32)]
    kv_bits: u32,
    /// Features per group of codes (one scale and bias each); divides the head size.
    #[arg(long, default_value_t = 64)]
    kv_group_size: usize,
    /// Tokens a row keeps in full precision before its KV turns to codes.
    #[arg(long, default_value_t = 256)]
    kv_quantized_start: usize,
}

impl KvArgs {
    fn quantization(&self) -> anyhow::Result<Option<tether::model::KvQuantization>> {
        let bits = match self.kv_bits {
            32 => return Ok(None),
            8 => 8,
            4 => 4,
            b => anyhow::bail!("--kv-bits must be 32, 8 or 4, got {b}"),
        };
        anyhow::ensure!(self.kv_group_size > 0, "--kv-group-size must be at least 1");
        Ok(Some(tether::model::KvQuantization { bits, group: self.kv_group_size, start: self.kv_quantized_start }))
    }
}

impl EngineArgs {
    fn config(&self) -> anyhow::Result<EngineConfig> {
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
            ..d
        })
    }
}

fn run_serve(args: ServeArgs) -> anyhow::Result<()> {
    let tokenizer = load_tokenizer(&args.model)?;
    let config = ServerConfig {
        host: args.host.clone(),
        port: args.port,
        model_name: Some(args.model.model.clone()),
        speculation: speculation_arg(&args.speculation, args.max_draft, args.draft_model.is_some(), pick_device(&args.model)?)?,
        has_draft_model: args.draft_model.is_some(),
        max_frame_bytes: args.max_frame_bytes,
        max_prompt_tokens: args.max_prompt_tokens,
        max_tokens: args.max_tokens,
        max_in_flight: args.max_in_flight,
        max_sessions: args.max_sessions,
        max_connections: args.max_connections,
        session_ttl: secs("session-ttl-secs", args.session_ttl_secs)?,
        idle_timeout: secs("idle-timeout-secs", args.idle_timeout_secs)?,
        replay_frames: args.replay_frames,
        outgoing_queue: args.outgoing_queue,
        stall_timeout: secs("stall-timeout-secs", args.stall_timeout_secs)?,
        rate_limit_per_sec: args.rate_limit,
        rate_limit_burst: (args.rate_limit * 2.0).max(1.0),
        auth_token: args.auth_token.clone().or_else(|| std::env::var("TETHER_AUTH_TOKEN").ok().filter(|t| !t.is_empty())),
        allowed_origins: args.allow_origin.clone(),
        drain_timeout: secs("drain-timeout-secs", args.drain_timeout_secs)?,
        ui_dir: match &args.ui_dir {
            Some(d) => Some(d.canonicalize().ok().filter(|p| p.is_dir()).ok_or_else(|| anyhow::anyhow!("--ui-dir {}: not a folder", d.display()))?),
            None => None,
        },
        ..ServerConfig::default()
    };
    config.validate().map_err(anyhow::Error::msg)?;
    anyhow::ensure!(args.workers >= 1, "--workers must be at least 1");
    let engine_config = EngineConfig { draft_model: draft_model_spec(&args.model, args.draft_model.as_deref())?, ..args.engine.config()? };
    let workers = (0..args.workers).map(|_| start_worker(&args.model, engine_config.clone())).collect::<anyhow::Result<Vec<_>>>()?;
    let engine = tether::engine::EnginePool::new(workers);
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let result = runtime.block_on(async {
        let server = tether::server::serve(config, engine.clone(), Arc::new(tokenizer)).await?;
        println!("listening on http://{}", server.addr());
        std::io::stdout().flush()?;
        shutdown_signal().await;
        eprintln!("[serve] shutting down: draining in-flight requests");
        server.shutdown().await;
        anyhow::Ok(())
    });
    // The engine finishes what is left, drops the model and exits.
    engine.shutdown_and_join();
    result
}

/// SIGINT or SIGTERM.
async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// An engine thread that loads `args`' model onto the chosen device.
fn start_worker(args: &ModelArgs, config: EngineConfig) -> anyhow::Result<EngineHandle> {
    let device = pick_device(args)?;
    let opts = load_options(args)?;
    let name = args.model.clone();
    EngineHandle::start(config, move || {
        mlx::set_default_device(device)?;
        Ok(LoadedModel::load(&name, opts)?)
    })
}

/// The model's tokenizer, for the edge (the engine speaks token ids).
fn load_tokenizer(args: &ModelArgs) -> anyhow::Result<TextTokenizer> {
    let path = registry::resolve(&args.model)?;
    let tokenizer = if path.is_dir() { TextTokenizer::from_hf_dir(&path) } else { TextTokenizer::from_gguf_path(&path) };
    tokenizer.map_err(|e| anyhow::anyhow!("tokenizer of {}: {e}", path.display()))
}

fn start_engine(args: &ModelArgs, config: EngineConfig) -> anyhow::Result<(EngineHandle, TextTokenizer)> {
    Ok((start_worker(args, config)?, load_tokenizer(args)?))
}

fn load_model(args: &ModelArgs) -> anyhow::Result<LoadedModel> {
    mlx::set_default_device(pick_device(args)?)?;
    Ok(LoadedModel::load(&args.model, load_options(args)?)?)
}

fn run_generate(args: GenerateArgs) -> anyhow::Result<()> {
    let sampling = SamplingParams { temperature: args.temperature, top_k: args.top_k, top_p: args.top_p, min_p: args.min_p, seed: args.seed };
    sampling.validate().map_err(anyhow::Error::msg)?;
    let model = load_model(&args.model)?;
    let prompt = if args.chat {
        let mut messages = Vec::new();
        messages.extend(args.system.as_ref().map(ChatMessage::system));
        messages.push(ChatMessage::user(&args.prompt));
        model.encode_chat(&messages)?
    } else {
        model.encode_prompt(&args.prompt)?
    };
    let context = model.transformer.config.context_length;
    if prompt.len() + args.max_tokens > context {
        anyhow::bail!("prompt ({} tokens) plus --max-tokens {} exceeds the model's context of {context} tokens", prompt.len(), args.max_tokens);
    }
    let opts = GenerateOptions { max_tokens: args.max_tokens, sampling, stop_ids: model.tokenizer.eos_ids().to_vec(), prefill_chunk: 512 };
    let mut decoder = model.tokenizer.stream_decoder(true);
    let mut stops = StopMatcher::new(args.stop.clone());
    let mut out = std::io::stdout().lock();
    let stats = generate(&model.transformer, &prompt, &opts, |id| {
        let Some(text) = decoder.push(&model.tokenizer, id) else { return ControlFlow::Continue(()) };
        match stops.push(&text) {
            StopScan::Continue(t) => {
                let _ = out.write_all(t.as_bytes()).and_then(|()| out.flush());
                ControlFlow::Continue(())
            }
            StopScan::Stopped(t) => {
                let _ = out.write_all(t.as_bytes());
                ControlFlow::Break(())
            }
        }
    })?;
    let tail = decoder.flush(&model.tokenizer).unwrap_or_default();
    let (StopScan::Continue(t) | StopScan::Stopped(t)) = stops.push(&tail);
    out.write_all(t.as_bytes())?;
    out.write_all(stops.finish().as_bytes())?;
    writeln!(out)?;
    if args.stats {
        eprintln!(
            "[stats] model {} loaded in {:.2}s; prompt {} tokens at {:.1} tok/s; {} tokens at {:.1} tok/s; finish {:?}",
            model.name,
            model.load_seconds,
            stats.prompt_tokens,
            stats.prefill_tokens_per_second(),
            stats.completion_tokens,
            stats.decode_tokens_per_second(),
            stats.finish
        );
    }
    Ok(())
}
