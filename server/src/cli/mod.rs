//! The commands of `tether`: the argument types and one module per command.
//!
//! Each command parses its flags into the library's configs (validated
//! there), loads what it needs and runs. What several commands share is
//! here once: `--model` and its loading in `model`, the engine's flags in
//! `engine_args`.
use clap::{Parser, Subcommand};

mod bench;
mod engine_args;
mod generate;
mod model;
mod models;
mod serve;

#[derive(Parser)]
#[command(name = "tether", version, about = "A stateful, streaming LLM inference server")]
pub(crate) struct Cli {
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
    Generate(generate::GenerateArgs),
    /// Measure single-stream prefill and decode tokens/s (prints one JSON line).
    Bench(bench::BenchArgs),
    /// Serve protocol v1 over WebSocket (`GET /v1/ws`), with `/healthz` and `/metrics`.
    Serve(serve::ServeArgs),
}

pub(crate) fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::FetchModel { name } => models::fetch(&name),
        Command::Models => models::list(),
        Command::Generate(args) => generate::run(args),
        Command::Bench(args) => bench::run(args),
        Command::Serve(args) => serve::run(args),
    }
}
