//! Error type of the tokenizer layer.

use std::path::PathBuf;

/// Everything that can go wrong while loading a tokenizer, encoding/decoding
/// text or rendering a chat template. Messages name the offending key, file,
/// pre-tokenizer or template so they can be shown to an operator as-is.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("GGUF metadata key `{0}` is missing")]
    MissingKey(&'static str),

    #[error("GGUF metadata key `{key}` is invalid: {detail}")]
    InvalidKey { key: &'static str, detail: String },

    #[error("failed to open GGUF file {path}: {detail}")]
    Gguf { path: PathBuf, detail: String },

    #[error("unsupported tokenizer model `{0}` (tokenizer.ggml.model); supported: byte-level BPE (`gpt2`), SentencePiece-style BPE (`llama`)")]
    UnsupportedModel(String),

    #[error("unknown pre-tokenizer `{name}` (tokenizer.ggml.pre); supported: {supported}")]
    UnknownPreTokenizer { name: String, supported: String },

    #[error("bad BPE merge #{index} `{merge}`: {reason}")]
    BadMerge { index: usize, merge: String, reason: String },

    #[error("{what} token id {id} is out of range (vocabulary has {vocab_size} tokens)")]
    TokenIdOutOfRange { what: &'static str, id: u64, vocab_size: usize },

    #[error("failed to read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("invalid {path}: {detail}")]
    InvalidFile { path: PathBuf, detail: String },

    #[error("unsupported tokenizer.json decoder: {0}")]
    UnsupportedDecoder(String),

    #[error("tokenizer error: {0}")]
    Tokenizers(String),

    #[error("this model has no chat template (no tokenizer.chat_template in the GGUF / chat_template in tokenizer_config.json)")]
    NoChatTemplate,

    #[error("chat template failed to compile: {0}")]
    TemplateSyntax(String),

    #[error("chat template raised an exception: {0}")]
    TemplateRaised(String),

    #[error("chat template failed to render: {0}")]
    TemplateRender(String),
}

impl From<tokenizers::Error> for TokenizerError {
    fn from(e: tokenizers::Error) -> Self {
        TokenizerError::Tokenizers(e.to_string())
    }
}

pub type Result<T, E = TokenizerError> = std::result::Result<T, E>;
