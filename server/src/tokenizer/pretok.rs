//! Pre-tokenizer table: `tokenizer.ggml.pre` name -> regex split sequence.
//!
//! The regexes follow llama.cpp's `llm_tokenizer_bpe` table (src/llama-vocab.cpp).
//! llama.cpp applies the expressions one after the other: every expression
//! splits each piece produced by the previous one, and both the matches and
//! the text between matches are kept as pieces.  That is exactly a sequence of
//! Hugging Face `Split(regex, behavior = Isolated)` pre-tokenizers followed by
//! a non-regex `ByteLevel` step, which is how we build it.

use tokenizers::normalizers::{unicode::NFC, NormalizerWrapper};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::SplitDelimiterBehavior;

use super::error::{Result, TokenizerError};

/// GPT-2's word regex (without the trailing `|\s+` that HF adds: llama.cpp
/// keeps unmatched text as its own piece, which gives the same split).
pub const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";

/// Llama 3 (tiktoken cl100k-style); `(?i:...)` contractions spelled out as llama.cpp does.
pub const LLAMA3: &str =
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Qwen2: like Llama 3 but single digits.
pub const QWEN2: &str =
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Qwen3.5: Qwen2 with combining marks kept with letters.
pub const QWEN35: &str =
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Single digits (first step of the StarCoder / SmolLM family).
pub const DIGIT: &str = r"\p{N}";

/// llama.cpp's fallback ("default") BPE pre-tokenizer.
pub const DEFAULT: [&str; 4] = [r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"];

/// Falcon.
pub const FALCON: [&str; 3] = [r"[\p{P}\$\+<=>\^~\|`]+", GPT2, r"[0-9][0-9][0-9]"];

/// How a family pre-tokenizes and which extra options llama.cpp sets for it.
#[derive(Debug, Clone)]
pub struct PreTokenizerSpec {
    /// Canonical family name (for logs/reports).
    pub family: &'static str,
    /// Regexes applied in sequence (`Split`, behavior Isolated).
    pub regexes: Vec<&'static str>,
    /// Look a whole pre-tokenized word up in the vocab before merging
    /// (llama.cpp `ignore_merges`, HF BPE `ignore_merges`).
    pub ignore_merges: bool,
    /// llama.cpp's default for `add_bos` when the GGUF has no `add_bos_token` key.
    pub default_add_bos: bool,
    /// Apply Unicode NFC before pre-tokenization.  The HF tokenizers of the
    /// Qwen2 family declare an NFC normalizer (llama.cpp skips it; for text
    /// already in NFC, the usual case, both agree).
    pub nfc: bool,
}

/// Names accepted for `tokenizer.ggml.pre`, for error messages.
pub const SUPPORTED_NAMES: &[&str] = &[
    "default",
    "gpt-2",
    "phi-2",
    "mpt",
    "olmo",
    "jina-es",
    "jina-de",
    "jina-v2-es",
    "jina-v2-de",
    "jina-v1-en",
    "jina-v2-code",
    "roberta-bpe",
    "gigachat",
    "mellum",
    "modern-bert",
    "llama3",
    "llama-v3",
    "llama-bpe",
    "falcon3",
    "falcon-h1",
    "pixtral",
    "midm-2.0",
    "lfm2",
    "dbrx",
    "smaug-bpe",
    "glm4",
    "chatglm-bpe",
    "qwen2",
    "deepseek-r1-qwen",
    "stablelm2",
    "qwen35",
    "smollm",
    "starcoder",
    "refact",
    "command-r",
    "codeshell",
    "exaone",
    "minerva",
    "falcon",
];

/// Resolve a `tokenizer.ggml.pre` value. `None`/empty means llama.cpp's "default".
pub fn spec_for(pre: Option<&str>) -> Result<PreTokenizerSpec> {
    let name = pre.unwrap_or("").trim();
    let spec = |family, regexes: Vec<&'static str>| PreTokenizerSpec { family, regexes, ignore_merges: false, default_add_bos: false, nfc: false };
    Ok(match name {
        "" | "default" => spec("default", DEFAULT.to_vec()),
        "gpt-2" | "phi-2" | "mpt" | "olmo" | "jina-es" | "jina-de" | "jina-v2-es" | "jina-v2-de" | "jina-v1-en" | "jina-v2-code" | "roberta-bpe"
        | "gigachat" | "mellum" | "modern-bert" => spec("gpt-2", vec![GPT2]),
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0" | "lfm2" => {
            PreTokenizerSpec { ignore_merges: true, default_add_bos: true, ..spec("llama3", vec![LLAMA3]) }
        }
        "dbrx" | "smaug-bpe" | "glm4" | "chatglm-bpe" => spec("llama3-regex", vec![LLAMA3]),
        "qwen2" | "deepseek-r1-qwen" | "stablelm2" => PreTokenizerSpec { nfc: name != "stablelm2", ..spec("qwen2", vec![QWEN2]) },
        "qwen35" => PreTokenizerSpec { nfc: true, ..spec("qwen35", vec![QWEN35]) },
        "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva" => spec("starcoder", vec![DIGIT, GPT2]),
        "falcon" => spec("falcon", FALCON.to_vec()),
        other => return Err(TokenizerError::UnknownPreTokenizer { name: other.to_string(), supported: SUPPORTED_NAMES.join(", ") }),
    })
}

impl PreTokenizerSpec {
    /// Build the HF pre-tokenizer: `Split(re, Isolated)`* then byte-level mapping.
    pub fn build(&self) -> Result<PreTokenizerWrapper> {
        let mut steps: Vec<PreTokenizerWrapper> = Vec::with_capacity(self.regexes.len() + 1);
        for re in &self.regexes {
            let split = Split::new(SplitPattern::Regex((*re).to_string()), SplitDelimiterBehavior::Isolated, false)
                .map_err(|e| TokenizerError::Tokenizers(format!("pre-tokenizer regex `{re}` failed to compile: {e}")))?;
            steps.push(split.into());
        }
        steps.push(ByteLevel::new(false, false, false).into());
        Ok(Sequence::new(steps).into())
    }

    pub fn normalizer(&self) -> Option<NormalizerWrapper> {
        self.nfc.then(|| NFC.into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_supported_name_resolves_and_compiles() {
        for name in SUPPORTED_NAMES {
            let spec = spec_for(Some(name)).unwrap();
            spec.build().unwrap_or_else(|e| panic!("{name}: {e}"));
        }
        assert_eq!(spec_for(None).unwrap().family, "default");
    }

    #[test]
    fn unknown_name_is_a_clear_error() {
        let err = spec_for(Some("frobnicator-9")).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("unknown pre-tokenizer `frobnicator-9`"), "{msg}");
        assert!(msg.contains("qwen2") && msg.contains("smollm"), "{msg}");
    }
}
