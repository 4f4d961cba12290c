//! Tether: a stateful, streaming LLM inference server.
//!
//! The library is what a server is made of; the command line and the
//! benchmarks are modules of the `tether` binary (`src/cli/`).
pub mod engine;
pub mod generate;
pub mod grammar;
pub mod loaded;
pub mod models;
pub mod registry;
pub mod sample;
pub mod server;
pub mod stop;
pub mod tokenizer;
pub mod tools;
