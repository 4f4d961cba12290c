//! The `tether` command line: the process's allocator, its start and its
//! exit code. The commands are modules of this binary ([`cli`], one file
//! each), not of the library: the library is what a server is made of, and
//! the benchmarks and argument parsing are not.
use std::process::ExitCode;

use clap::Parser;

mod cli;

/// jemalloc for the whole process: with `unprefixed_malloc_on_supported_platforms`
/// it also answers MLX's C++ allocations (every graph node allocates), which
/// glibc's malloc served slowly from two threads at once (an engine thread
/// building a step while MLX's stream thread frees the last): one-stream CPU
/// decode ran 25-30% faster with it (docs/performance.md).
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() -> ExitCode {
    mlx::apply_cuda_server_defaults();
    let cli = cli::Cli::parse();
    match cli::run(cli) {
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
