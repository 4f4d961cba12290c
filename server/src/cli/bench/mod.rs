//! `tether bench`: benchmarks that print one JSON line per measurement
//! (never timed asserts). The flags pick one run: speculative decoding
//! (`--speculation-streams`), quantized KV (`--kv-quality`), an agent
//! session (`--turns`), concurrent streams (`--streams`), or else
//! single-stream prefill and decode, or the GPU's fused decode step beside
//! MLX's ops (`--gpu-kernels`).
//!
//! They are the binary's, not the library's: they drive the engine and the
//! model through the same public interfaces the server uses.
use clap::Args;
use tether::engine::speculate::DraftKind;
use tether::engine::{EngineConfig, EngineHandle};
use tether::tokenizer::TextTokenizer;

use super::engine_args::{KvArgs, KvLayoutArg, Switch};
use super::model::ModelArgs;

mod gpu_kernels;
mod kv;
mod spec;
mod throughput;

#[derive(Args)]
pub(super) struct BenchArgs {
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
    /// Run the fused GPU decode step beside MLX's ops instead, at these row
    /// counts: logits' distance, top-1 agreement, primitives and step time
    /// over --gen-tokens steps after --prompt-tokens prompts.
    #[arg(long, value_delimiter = ',')]
    gpu_kernels: Vec<usize>,
    /// Where decoding rows keep their KV caches.
    #[arg(long, value_enum, default_value_t = KvLayoutArg::Auto)]
    kv_layout: KvLayoutArg,
    /// Queue each plain decode step before the one before it is read (as `serve`).
    #[arg(long, value_enum, default_value_t = Switch::On)]
    lookahead: Switch,
}

pub(super) fn run(args: BenchArgs) -> anyhow::Result<()> {
    if !args.speculation_streams.is_empty() {
        let config = EngineConfig { draft_model: args.model.draft_model_spec(args.draft_model.as_deref())?, ..engine_config(&args)? };
        let mut sources = vec![DraftKind::Echo];
        sources.extend(config.draft_model.is_some().then_some(DraftKind::Model));
        let (engine, tokenizer) = start_engine(&args.model, config)?;
        let fim = tether::server::FimTokens::detect(&tokenizer);
        spec::run_all(&engine, &tokenizer, fim.as_ref(), &args.speculation_streams, &sources, args.max_draft)
    } else if !args.gpu_kernels.is_empty() {
        let mut model = args.model.load_here()?;
        // The fused path beside MLX's ops on slots of --kv-bits codes; the reference keeps float32.
        model.transformer.set_batched_kv_quantization(args.kv.quantization()?)?;
        let reference = args.model.load_here_in(mlx::Dtype::F32)?;
        for check in gpu_kernels::run(&mut model.transformer, &reference.transformer, &args.gpu_kernels, args.prompt_tokens, args.gen_tokens)? {
            println!("{}", serde_json::to_string(&check)?);
        }
        Ok(())
    } else if args.kv_quality {
        kv::run(&args)
    } else if args.turns > 0 {
        let (engine, tokenizer) = start_engine(&args.model, engine_config(&args)?)?;
        for cache in [true, false].into_iter().filter(|&c| c || !args.cached_only) {
            for turn in throughput::run_agent_bench(&engine, &tokenizer, args.turns, args.prompt_tokens, args.gen_tokens, cache)? {
                println!("{}", serde_json::to_string(&turn)?);
            }
        }
        Ok(())
    } else if args.streams > 0 {
        let (engine, tokenizer) = start_engine(&args.model, engine_config(&args)?)?;
        let prompt = throughput::prompt_tokens(&tokenizer, args.prompt_tokens)?;
        for streams in [1, args.streams] {
            let r = throughput::run_streams_bench(&engine, &args.model.model, prompt.clone(), streams, args.gen_tokens)?;
            println!("{}", serde_json::to_string(&r)?);
        }
        Ok(())
    } else {
        let model = args.model.load_here()?;
        let result = throughput::run_decode_bench(&model, args.prompt_tokens, args.gen_tokens)?;
        println!("{}", serde_json::to_string(&result)?);
        Ok(())
    }
}

/// The engine a benchmark runs: the server's defaults but for what the
/// benchmark's flags set.
fn engine_config(args: &BenchArgs) -> anyhow::Result<EngineConfig> {
    Ok(EngineConfig {
        step_draft_budget: args.step_draft_budget,
        kv_layout: args.kv_layout.layout(),
        prefill_chunk: args.prefill_chunk,
        kv_quantization: args.kv.quantization()?,
        lookahead: args.lookahead == Switch::On,
        ..EngineConfig::default()
    })
}

/// One engine worker and the tokenizer, loaded once, here: the engine
/// takes token ids.
fn start_engine(args: &ModelArgs, config: EngineConfig) -> anyhow::Result<(EngineHandle, TextTokenizer)> {
    let tokenizer = args.load_tokenizer()?;
    Ok((args.start_worker(config, &tokenizer)?, tokenizer))
}
