//! The `tether` command line.
use std::io::Write;
use std::ops::ControlFlow;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand, ValueEnum};
use tether::generate::{generate, GenerateOptions};
use tether::loaded::LoadedModel;
use tether::model::{LoadOptions, WeightFormat};
use tether::registry;
use tether::sample::SamplingParams;
use tether::stop::{StopMatcher, StopScan};
use tether::tokenizer::ChatMessage;

#[derive(Parser)]
#[command(name = "tether", version, about = "A stateful, streaming LLM inference server")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
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
}

#[derive(Args)]
struct BenchArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[arg(long, default_value_t = 512)]
    prompt_tokens: usize,
    #[arg(long, default_value_t = 128)]
    gen_tokens: usize,
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
    /// Weight storage: `dense` (compute dtype) or `quantized` (exact MLX
    /// affine form where the GGUF block type allows). Default: dense on CPU,
    /// quantized on GPU.
    #[arg(long)]
    weights: Option<String>,
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
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
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
        Command::Bench(args) => {
            let model = load_model(&args.model)?;
            let weights = match &args.model.weights {
                Some(w) => w.clone(),
                None => format!("{:?}", LoadOptions::for_device(mlx::default_device()).weights).to_lowercase(),
            };
            let result = tether::bench::run_decode_bench(&model, args.prompt_tokens, args.gen_tokens, &weights)?;
            println!("{}", serde_json::to_string(&result)?);
            Ok(())
        }
    }
}

fn load_model(args: &ModelArgs) -> anyhow::Result<LoadedModel> {
    let device = match args.device {
        DeviceArg::Cpu => mlx::Device::Cpu,
        DeviceArg::Gpu if !mlx::gpu_available() => anyhow::bail!("--device gpu: this MLX build has no usable GPU"),
        DeviceArg::Gpu => mlx::Device::Gpu,
        DeviceArg::Auto if mlx::gpu_available() => mlx::Device::Gpu,
        DeviceArg::Auto => mlx::Device::Cpu,
    };
    mlx::set_default_device(device)?;
    let mut opts = LoadOptions::for_device(device);
    if let Some(w) = &args.weights {
        opts.weights = WeightFormat::parse(w).ok_or_else(|| anyhow::anyhow!("--weights must be `dense` or `quantized`, got {w:?}"))?;
    }
    Ok(LoadedModel::load(&args.model, opts)?)
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
