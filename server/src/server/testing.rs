//! What the server's unit tests share: a [`ServerState`] over a tiny
//! byte-level tokenizer and an engine handle with no engine thread behind
//! it. A test plays the engine: it reads the commands the edge sends and
//! answers a submit through the submission's event sender. No MLX runs and
//! no model is loaded.
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::Duration;

use super::{ServerConfig, ServerState};
use crate::engine::{Command, EngineConfig, EngineHandle, EngineModelInfo};
use crate::tokenizer::{GgufVocab, TextTokenizer};

/// The tiny vocabulary's end-of-sequence control token, `<|end|>` (see
/// `tokenizer::tests::tiny_vocab`: ids 0..=255 are the bytes themselves,
/// 256 is `ab`).
pub const END: u32 = 257;

/// A ChatML-like template, enough for `messages` to render.
const TEMPLATE: &str = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}";

/// The tiny vocabulary with a chat template and its eos, as a tokenizer.
pub fn tokenizer() -> Arc<TextTokenizer> {
    let vocab = GgufVocab { chat_template: Some(TEMPLATE.into()), ..crate::tokenizer::tests::tiny_vocab() };
    Arc::new(TextTokenizer::from_gguf_vocab(vocab).expect("the tiny vocabulary loads"))
}

/// The token ids of `text` in the tiny vocabulary (its bytes, `ab` merged).
pub fn ids(text: &str) -> Vec<u32> {
    tokenizer().encode(text, false).unwrap()
}

/// An engine handle for the tiny vocabulary with no thread behind it, and
/// the commands the edge sends it.
pub fn engine() -> (EngineHandle, Receiver<Command>) {
    let info = EngineModelInfo {
        name: "tiny".into(),
        architecture: "test".into(),
        context_length: 256,
        vocab_size: 258,
        kv_bytes_per_token: 0,
        weight_bytes: 0,
        draft_model: None,
    };
    EngineHandle::for_tests(info, EngineConfig::default())
}

/// A server's state for `config`, and the commands its one engine receives.
pub fn state(config: ServerConfig) -> (Arc<ServerState>, Receiver<Command>) {
    let (engine, commands) = engine();
    (ServerState::new(config, engine.into(), tokenizer()), commands)
}

/// The next command the engine receives; a test that waits longer than
/// this for one has hung.
pub fn next_command(commands: &Receiver<Command>) -> Command {
    commands.recv_timeout(Duration::from_secs(10)).expect("the engine got no command")
}
