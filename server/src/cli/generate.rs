//! `tether generate`: one prompt through the model on this thread (no
//! engine), streamed to stdout as it decodes.
use std::io::Write;
use std::ops::ControlFlow;

use clap::Args;
use tether::generate::{generate, GenerateOptions};
use tether::sample::SamplingParams;
use tether::stop::{StopMatcher, StopScan};
use tether::tokenizer::ChatMessage;

use super::model::ModelArgs;

#[derive(Args)]
pub(super) struct GenerateArgs {
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

pub(super) fn run(args: GenerateArgs) -> anyhow::Result<()> {
    let sampling = SamplingParams { temperature: args.temperature, top_k: args.top_k, top_p: args.top_p, min_p: args.min_p, seed: args.seed };
    sampling.validate().map_err(anyhow::Error::msg)?;
    let model = args.model.load_here()?;
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
