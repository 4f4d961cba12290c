//! Loading a model, in its two halves, each where it is used: the weights
//! onto the device ([`LoadedModel`]), by the thread that runs them, and the
//! tokenizer with its chat template ([`load_tokenizer`]), for whatever turns
//! text into token ids and back.
//!
//! The key decision: an engine thread loads the weights only, since it
//! speaks token ids; the process loads the tokenizer once and shares it
//! (immutable, behind an `Arc`) with every session and worker, and checks
//! it against the weights with [`check_vocab`]. [`ModelWithTokenizer`]
//! holds both for what runs text through a model on one thread with no
//! engine: `tether generate`, the benchmarks and the reference tests.
use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::models::{self, LoadOptions, Transformer};
use crate::tokenizer::{ChatMessage, TextTokenizer};

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error(transparent)]
    Fetch(#[from] crate::registry::FetchError),
    #[error("loading {path}: {source}")]
    Load { path: String, source: models::LoadError },
    #[error("tokenizer of {path}: {source}")]
    Tokenizer { path: String, source: crate::tokenizer::TokenizerError },
    #[error("model and tokenizer disagree: {0}")]
    Mismatch(String),
}

/// A model's weights on the device: all an engine thread loads.
pub struct LoadedModel {
    /// What the user called it (`--model`).
    pub name: String,
    pub path: PathBuf,
    pub transformer: Transformer,
}

impl LoadedModel {
    /// Resolves a known name or a path and loads the weights.
    pub fn load(model: &str, opts: LoadOptions) -> Result<LoadedModel, ModelError> {
        let path = crate::registry::resolve(model)?;
        Self::load_path(model, &path, opts)
    }

    pub fn load_path(name: &str, path: &Path, opts: LoadOptions) -> Result<LoadedModel, ModelError> {
        let transformer = models::load_transformer(path, opts).map_err(|source| ModelError::Load { path: path.display().to_string(), source })?;
        Ok(LoadedModel { name: name.to_string(), path: path.to_path_buf(), transformer })
    }
}

/// The tokenizer and chat template that came with the model at `path` (a
/// GGUF file or an HF folder, as [`crate::registry::resolve`] gives it).
pub fn load_tokenizer(path: &Path) -> Result<TextTokenizer, ModelError> {
    let tokenizer = if path.is_dir() { TextTokenizer::from_hf_dir(path) } else { TextTokenizer::from_gguf_path(path) };
    tokenizer.map_err(|source| ModelError::Tokenizer { path: path.display().to_string(), source })
}

/// Checks that every id `tokenizer` can produce has a row in an embedding
/// of `vocab_size` rows (the weights may have more: padding).
pub fn check_vocab(tokenizer: &TextTokenizer, vocab_size: usize) -> Result<(), ModelError> {
    if tokenizer.vocab_size() > vocab_size {
        return Err(ModelError::Mismatch(format!("tokenizer has {} tokens but the embedding only {vocab_size} rows", tokenizer.vocab_size())));
    }
    Ok(())
}

/// A model's weights and its tokenizer together, for running text through
/// the model on this thread, without an engine.
pub struct ModelWithTokenizer {
    /// What the user called it (`--model`).
    pub name: String,
    pub path: PathBuf,
    pub transformer: Transformer,
    pub tokenizer: TextTokenizer,
    /// Seconds the tokenizer and weights took to load.
    pub load_seconds: f64,
}

impl ModelWithTokenizer {
    /// Resolves a known name or a path and loads tokenizer and weights.
    pub fn load(model: &str, opts: LoadOptions) -> Result<ModelWithTokenizer, ModelError> {
        let path = crate::registry::resolve(model)?;
        Self::load_path(model, &path, opts)
    }

    /// The tokenizer first: it is quick to read, and a file that is no
    /// model at all fails there before any weights are read.
    pub fn load_path(name: &str, path: &Path, opts: LoadOptions) -> Result<ModelWithTokenizer, ModelError> {
        let start = Instant::now();
        let tokenizer = load_tokenizer(path)?;
        let LoadedModel { name, path, transformer } = LoadedModel::load_path(name, path, opts)?;
        check_vocab(&tokenizer, transformer.config.vocab_size)?;
        Ok(ModelWithTokenizer { name, path, transformer, tokenizer, load_seconds: start.elapsed().as_secs_f64() })
    }

    /// Token ids of a raw text prompt, with BOS when the model wants it.
    /// Special-token text (e.g. `<|fim_prefix|>`) is parsed as special tokens.
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>, crate::tokenizer::TokenizerError> {
        let mut ids = Vec::new();
        if self.tokenizer.add_bos() {
            ids.extend(self.tokenizer.bos_id());
        }
        ids.extend(self.tokenizer.encode(text, true)?);
        Ok(ids)
    }

    /// Token ids of a chat rendered with the model's own template. The
    /// template writes any BOS itself, so none is added here.
    pub fn encode_chat(&self, messages: &[ChatMessage]) -> Result<Vec<u32>, crate::tokenizer::TokenizerError> {
        let text = self.tokenizer.apply_chat_template(messages, true)?;
        self.tokenizer.encode(&text, true)
    }
}
