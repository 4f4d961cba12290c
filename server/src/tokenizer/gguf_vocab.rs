//! Tokenizer metadata read from a GGUF file (`tokenizer.ggml.*`).

use super::error::{Result, TokenizerError};

pub const KEY_MODEL: &str = "tokenizer.ggml.model";
pub const KEY_PRE: &str = "tokenizer.ggml.pre";
pub const KEY_TOKENS: &str = "tokenizer.ggml.tokens";
pub const KEY_MERGES: &str = "tokenizer.ggml.merges";
pub const KEY_TOKEN_TYPE: &str = "tokenizer.ggml.token_type";
pub const KEY_BOS: &str = "tokenizer.ggml.bos_token_id";
pub const KEY_EOS: &str = "tokenizer.ggml.eos_token_id";
pub const KEY_EOT: &str = "tokenizer.ggml.eot_token_id";
pub const KEY_EOM: &str = "tokenizer.ggml.eom_token_id";
pub const KEY_PAD: &str = "tokenizer.ggml.padding_token_id";
pub const KEY_UNK: &str = "tokenizer.ggml.unknown_token_id";
pub const KEY_ADD_BOS: &str = "tokenizer.ggml.add_bos_token";
pub const KEY_ADD_EOS: &str = "tokenizer.ggml.add_eos_token";
pub const KEY_CHAT_TEMPLATE: &str = "tokenizer.chat_template";
pub const KEY_SCORES: &str = "tokenizer.ggml.scores";
pub const KEY_ADD_SPACE_PREFIX: &str = "tokenizer.ggml.add_space_prefix";

/// llama.cpp token types (`tokenizer.ggml.token_type`).
pub mod token_type {
    pub const NORMAL: i32 = 1;
    pub const UNKNOWN: i32 = 2;
    pub const CONTROL: i32 = 3;
    pub const USER_DEFINED: i32 = 4;
    pub const UNUSED: i32 = 5;
    pub const BYTE: i32 = 6;
}

/// Everything the tokenizer needs from GGUF metadata, owned, so it can also be
/// built by hand (tests, other containers).
#[derive(Debug, Clone, Default)]
pub struct GgufVocab {
    /// `tokenizer.ggml.model` (`gpt2` for byte-level BPE).
    pub model: String,
    /// `tokenizer.ggml.pre`.
    pub pre: Option<String>,
    pub tokens: Vec<String>,
    /// Per-token type; `None` means all normal.
    pub token_types: Option<Vec<i32>>,
    /// `"left right"` merge strings in rank order (byte-level BPE).
    pub merges: Vec<String>,
    /// Per-token scores (SentencePiece: pieces of higher score merge first).
    pub scores: Vec<f32>,
    /// SentencePiece: a space is put before the text (`None`: the model's default).
    pub add_space_prefix: Option<bool>,
    pub bos_id: Option<u32>,
    pub eos_id: Option<u32>,
    pub eot_id: Option<u32>,
    pub eom_id: Option<u32>,
    pub pad_id: Option<u32>,
    pub unk_id: Option<u32>,
    pub add_bos: Option<bool>,
    pub add_eos: Option<bool>,
    pub chat_template: Option<String>,
}

impl GgufVocab {
    /// Read the `tokenizer.*` keys of an open GGUF file.
    pub fn from_gguf(file: &gguf::GgufFile) -> Result<Self> {
        let model = file.get_str(KEY_MODEL).ok_or(TokenizerError::MissingKey(KEY_MODEL))?.to_string();
        let pre = file.get_str(KEY_PRE).map(str::to_string);
        let tokens: Vec<String> = file.get_str_array(KEY_TOKENS).ok_or(TokenizerError::MissingKey(KEY_TOKENS))?.into_iter().map(str::to_string).collect();
        let merges: Vec<String> = match file.get_str_array(KEY_MERGES) {
            Some(m) => m.into_iter().map(str::to_string).collect(),
            None => Vec::new(), // build() reports a missing key for BPE models
        };
        let scores = match file.get_array(KEY_SCORES) {
            None => Vec::new(), // build() reports a missing key for SentencePiece models
            Some(values) => values
                .iter()
                .enumerate()
                .map(|(i, v)| {
                    v.as_f64()
                        .map(|x| x as f32)
                        .ok_or_else(|| TokenizerError::InvalidKey { key: KEY_SCORES, detail: format!("element {i} is {v:?}, expected a float") })
                })
                .collect::<Result<Vec<f32>>>()?,
        };
        let token_types = match file.get_array(KEY_TOKEN_TYPE) {
            None => None,
            Some(values) => {
                let mut out = Vec::with_capacity(values.len());
                for (i, v) in values.iter().enumerate() {
                    let x = v
                        .as_i64()
                        .and_then(|x| i32::try_from(x).ok())
                        .ok_or_else(|| TokenizerError::InvalidKey { key: KEY_TOKEN_TYPE, detail: format!("element {i} is {v:?}, expected an int32") })?;
                    out.push(x);
                }
                Some(out)
            }
        };
        let id = |key: &'static str| -> Result<Option<u32>> {
            match file.get_u64(key) {
                None => Ok(None),
                Some(v) => u32::try_from(v).map(Some).map_err(|_| TokenizerError::InvalidKey { key, detail: format!("{v} does not fit a token id") }),
            }
        };
        Ok(GgufVocab {
            model,
            pre,
            tokens,
            token_types,
            merges,
            scores,
            add_space_prefix: file.get_bool(KEY_ADD_SPACE_PREFIX),
            bos_id: id(KEY_BOS)?,
            eos_id: id(KEY_EOS)?,
            eot_id: id(KEY_EOT)?,
            eom_id: id(KEY_EOM)?,
            pad_id: id(KEY_PAD)?,
            unk_id: id(KEY_UNK)?,
            add_bos: file.get_bool(KEY_ADD_BOS),
            add_eos: file.get_bool(KEY_ADD_EOS),
            chat_template: file
                .get_str(KEY_CHAT_TEMPLATE)
                .map(str::to_string)
                .or_else(|| super::chat::family_template(file.architecture()?).map(str::to_string)),
        })
    }
}
