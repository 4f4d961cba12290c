//! Tether: a stateful, streaming LLM inference server.
pub mod bench;
pub mod engine;
pub mod generate;
pub mod grammar;
pub mod kv_bench;
pub mod loaded;
pub mod model;
pub mod registry;
pub mod sample;
pub mod server;
pub mod spec_bench;
pub mod stop;
pub mod tokenizer;
pub mod tools;
