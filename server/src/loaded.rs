//! A model ready to serve: weights on the device plus the tokenizer and chat
//! template that came with them.
use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::model::{self, LoadOptions, Transformer};
use crate::tokenizer::{ChatMessage, TextTokenizer};

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error(transparent)]
    Fetch(#[from] crate::registry::FetchError),
    #[error("loading {path}: {source}")]
    Load { path: String, source: model::LoadError },
    #[error("tokenizer of {path}: {source}")]
    Tokenizer { path: String, source: crate::tokenizer::TokenizerError },
    #[error("model and tokenizer disagree: {0}")]
    Mismatch(String),
}

pub struct LoadedModel {
    /// What the user called it (`--model`).
    pub name: String,
    pub path: PathBuf,
    pub transformer: Transformer,
    pub tokenizer: TextTokenizer,
    pub load_seconds: f64,
}

impl LoadedModel {
    /// Resolves a known name or a path and loads weights and tokenizer.
    pub fn load(model: &str, opts: LoadOptions) -> Result<LoadedModel, ModelError> {
        let path = crate::registry::resolve(model)?;
        Self::load_path(model, &path, opts)
    }

    pub fn load_path(name: &str, path: &Path, opts: LoadOptions) -> Result<LoadedModel, ModelError> {
        let start = Instant::now();
        let shown = path.display().to_string();
        let tokenizer = if path.is_dir() { TextTokenizer::from_hf_dir(path) } else { TextTokenizer::from_gguf_path(path) }
            .map_err(|source| ModelError::Tokenizer { path: shown.clone(), source })?;
        let transformer = model::load_transformer(path, opts).map_err(|source| ModelError::Load { path: shown, source })?;
        if tokenizer.vocab_size() > transformer.config.vocab_size {
            return Err(ModelError::Mismatch(format!(
                "tokenizer has {} tokens but the embedding only {} rows",
                tokenizer.vocab_size(),
                transformer.config.vocab_size
            )));
        }
        Ok(LoadedModel { name: name.to_string(), path: path.to_path_buf(), transformer, tokenizer, load_seconds: start.elapsed().as_secs_f64() })
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
