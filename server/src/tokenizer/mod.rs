//! Tokenizer layer: text <-> token ids, chat templates, streaming detokenization.
//!
//! * [`TextTokenizer`] — built from GGUF metadata ([`TextTokenizer::from_gguf`],
//!   [`TextTokenizer::from_gguf_path`], [`TextTokenizer::from_gguf_vocab`]) or from a
//!   Hugging Face directory with `tokenizer.json` ([`TextTokenizer::from_hf_dir`]).
//!   Encoding runs on the `tokenizers` crate (byte-level BPE with llama.cpp's
//!   pre-tokenizer regexes for the GGUF's `tokenizer.ggml.pre`); decoding walks a
//!   per-id byte table.
//! * [`ChatTemplate`] — Jinja chat templates (minijinja + Python string methods).
//! * [`StreamDecoder`] — incremental, UTF-8-safe detokenization.

mod bytes;
mod chat;
mod error;
mod extend;
mod gguf_vocab;
mod hf;
mod pretok;
mod spm;
mod stream;

#[cfg(test)]
pub(crate) mod tests;

use std::collections::HashMap;
use std::path::Path;
use std::sync::OnceLock;

use tokenizers::models::bpe::BPE;
use tokenizers::{AddedToken, Tokenizer};

pub use bytes::TokenKind;
pub use chat::{python_json, ChatMessage, ChatTemplate, RenderOptions};
pub use error::{Result, TokenizerError};
pub use extend::PieceEncoding;
pub use gguf_vocab::{token_type, GgufVocab};
pub use pretok::{spec_for as pre_tokenizer_spec, PreTokenizerSpec, SUPPORTED_NAMES as SUPPORTED_PRE_TOKENIZERS};
pub use stream::StreamDecoder;

use bytes::TokenBytes;

/// Token texts that end generation when present in the vocabulary as special
/// (control / user-defined) tokens, in addition to the eos/eot/eom ids from the
/// metadata.  The FIM separators follow llama.cpp, which also stops on them.
pub const EOG_TOKEN_TEXTS: &[&str] =
    &["<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"];

/// A text tokenizer for one model.  Cheap to share behind an `Arc`; all methods
/// take `&self` and are thread-safe.
pub struct TextTokenizer {
    /// Extracts every added token (control tokens included): `parse_special = true`.
    with_special: Tokenizer,
    /// Same, but control tokens are left to BPE as plain text: `parse_special = false`.
    /// (User-defined added tokens are still matched, as in llama.cpp.)
    without_special: Tokenizer,
    bytes: TokenBytes,
    /// Text -> id for special tokens (control + user-defined), by their literal text.
    special_ids: HashMap<String, u32>,
    bos_id: Option<u32>,
    eos_id: Option<u32>,
    add_bos: bool,
    add_eos: bool,
    eos_ids: Vec<u32>,
    bos_token: Option<String>,
    eos_token: Option<String>,
    chat_template_source: Option<String>,
    chat_template: OnceLock<std::result::Result<ChatTemplate, String>>,
    /// SentencePiece-style HF tokenizers drop one leading space of the output.
    strip_leading_space: bool,
    /// Pre-tokenizer family ("qwen2", "starcoder", ... or "tokenizer.json").
    pre_family: String,
    /// Whether texts may be encoded in pieces (see `extend.rs`), once known.
    encodes_in_pieces: OnceLock<bool>,
}

impl std::fmt::Debug for TextTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextTokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("pre", &self.pre_family)
            .field("bos_id", &self.bos_id)
            .field("add_bos", &self.add_bos)
            .field("eos_ids", &self.eos_ids)
            .field("has_chat_template", &self.chat_template_source.is_some())
            .finish()
    }
}

/// Fields shared by the GGUF and HF constructors.
pub(crate) struct Parts {
    pub tokenizer: Tokenizer,
    pub bytes: TokenBytes,
    pub bos_id: Option<u32>,
    pub eos_id: Option<u32>,
    pub extra_eos: Vec<u32>,
    pub add_bos: bool,
    pub add_eos: bool,
    pub chat_template: Option<String>,
    pub strip_leading_space: bool,
    pub pre_family: String,
}

impl TextTokenizer {
    /// Open a GGUF file and build its tokenizer.
    pub fn from_gguf_path(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let file = gguf::GgufFile::open(path).map_err(|e| TokenizerError::Gguf { path: path.to_path_buf(), detail: e.to_string() })?;
        Self::from_gguf(&file)
    }

    /// Build from the `tokenizer.*` metadata of an open GGUF file.
    pub fn from_gguf(file: &gguf::GgufFile) -> Result<Self> {
        Self::from_gguf_vocab(GgufVocab::from_gguf(file)?)
    }

    /// Build from GGUF tokenizer metadata: byte-level BPE
    /// (`tokenizer.ggml.model = "gpt2"`) or SentencePiece-style BPE with
    /// byte fallback (`"llama"`, see `spm.rs`).
    pub fn from_gguf_vocab(v: GgufVocab) -> Result<Self> {
        use gguf_vocab::*;
        let n = v.tokens.len();
        if n == 0 {
            return Err(TokenizerError::InvalidKey { key: KEY_TOKENS, detail: "empty token list".into() });
        }
        if let Some(tt) = &v.token_types {
            if tt.len() != n {
                return Err(TokenizerError::InvalidKey { key: KEY_TOKEN_TYPE, detail: format!("{} entries but {} tokens", tt.len(), n) });
            }
        }
        let model = match v.model.as_str() {
            "gpt2" => byte_level_model(&v)?,
            "llama" => spm::model(&v)?,
            _ => return Err(TokenizerError::UnsupportedModel(v.model)),
        };
        let mut tokenizer = model.tokenizer;
        let ttype = |i: usize| v.token_types.as_ref().map_or(token_type::NORMAL, |t| t[i]);
        let mut control = Vec::new();
        let mut user = Vec::new();
        let mut table = TokenBytes::with_capacity(n);
        for (i, t) in v.tokens.iter().enumerate() {
            match ttype(i) {
                token_type::CONTROL | token_type::UNKNOWN => {
                    control.push(AddedToken::from(t.clone(), true).normalized(false));
                    table.push_with(TokenKind::Control, |o| o.extend_from_slice(t.as_bytes()));
                }
                token_type::USER_DEFINED => {
                    user.push(AddedToken::from(t.clone(), false).normalized(false));
                    table.push_with(TokenKind::UserDefined, |o| o.extend_from_slice(t.as_bytes()));
                }
                token_type::UNUSED => table.push_with(TokenKind::Unused, |_| {}),
                token_type::BYTE => table.push_with(TokenKind::Normal, |o| match bytes::parse_byte_token(t) {
                    Some(b) => o.push(b),
                    None => (model.decode_piece)(t, o),
                }),
                _ => table.push_with(TokenKind::Normal, |o| (model.decode_piece)(t, o)),
            }
        }
        tokenizer.add_special_tokens(&control);
        tokenizer.add_tokens(&user);

        for (what, id) in [("bos", v.bos_id), ("eos", v.eos_id), ("eot", v.eot_id), ("eom", v.eom_id)] {
            if let Some(id) = id {
                if id as usize >= n {
                    return Err(TokenizerError::TokenIdOutOfRange { what, id: id as u64, vocab_size: n });
                }
            }
        }
        let add_bos = v.add_bos.unwrap_or(model.default_add_bos);
        if add_bos && v.bos_id.is_none() {
            return Err(TokenizerError::InvalidKey { key: KEY_ADD_BOS, detail: format!("add_bos is true but {KEY_BOS} is not set") });
        }
        let add_eos = v.add_eos.unwrap_or(false);
        if add_eos && v.eos_id.is_none() {
            return Err(TokenizerError::InvalidKey { key: KEY_ADD_EOS, detail: format!("add_eos is true but {KEY_EOS} is not set") });
        }
        Self::assemble(Parts {
            tokenizer,
            bytes: table,
            bos_id: v.bos_id,
            eos_id: v.eos_id,
            extra_eos: [v.eot_id, v.eom_id].into_iter().flatten().collect(),
            add_bos,
            add_eos,
            chat_template: v.chat_template,
            strip_leading_space: model.strip_leading_space,
            pre_family: model.family,
        })
    }

    /// Build from a Hugging Face model directory: `tokenizer.json` plus, when
    /// present, `tokenizer_config.json` (chat template, bos/eos, add_bos_token),
    /// `chat_template.jinja` and `generation_config.json` (extra eos ids).
    pub fn from_hf_dir(dir: impl AsRef<Path>) -> Result<Self> {
        hf::from_hf_dir(dir.as_ref())
    }

    pub(crate) fn assemble(p: Parts) -> Result<Self> {
        let mut special_ids = HashMap::new();
        for id in 0..p.bytes.len() as u32 {
            if matches!(p.bytes.kind(id), Some(TokenKind::Control | TokenKind::UserDefined)) {
                if let Some(b) = p.bytes.get(id) {
                    if let Ok(s) = std::str::from_utf8(b) {
                        special_ids.entry(s.to_string()).or_insert(id);
                    }
                }
            }
        }
        let mut eos_ids: Vec<u32> = p.eos_id.into_iter().chain(p.extra_eos).collect();
        for text in EOG_TOKEN_TEXTS {
            if let Some(&id) = special_ids.get(*text) {
                eos_ids.push(id);
            }
        }
        eos_ids.sort_unstable();
        eos_ids.dedup();

        let text_of = |id: Option<u32>| id.and_then(|id| p.bytes.get(id)).map(|b| String::from_utf8_lossy(b).into_owned());
        let bos_token = text_of(p.bos_id);
        let eos_token = text_of(p.eos_id);

        let with_special = p.tokenizer;
        let mut without_special = with_special.clone();
        without_special.set_encode_special_tokens(true);
        Ok(TextTokenizer {
            with_special,
            without_special,
            bytes: p.bytes,
            special_ids,
            bos_id: p.bos_id,
            eos_id: p.eos_id,
            add_bos: p.add_bos,
            add_eos: p.add_eos,
            eos_ids,
            bos_token,
            eos_token,
            chat_template_source: p.chat_template,
            chat_template: OnceLock::new(),
            strip_leading_space: p.strip_leading_space,
            pre_family: p.pre_family,
            encodes_in_pieces: OnceLock::new(),
        })
    }

    /// Encode text to ids.  Never adds BOS/EOS (see [`Self::add_bos`]).
    /// With `parse_special`, control-token text such as `<|im_start|>` becomes its
    /// single id; without it, such text is tokenized as ordinary characters.
    /// User-defined added tokens (e.g. Qwen's `<tool_call>`) are always matched.
    pub fn encode(&self, text: &str, parse_special: bool) -> Result<Vec<u32>> {
        let tok = if parse_special { &self.with_special } else { &self.without_special };
        let enc = tok.encode_fast(text, false)?;
        Ok(enc.get_ids().to_vec())
    }

    /// Encode and prepend BOS / append EOS as the model's metadata asks.
    pub fn encode_with_special_tokens(&self, text: &str, parse_special: bool) -> Result<Vec<u32>> {
        let mut ids = Vec::new();
        if self.add_bos {
            ids.extend(self.bos_id);
        }
        ids.extend(self.encode(text, parse_special)?);
        if self.add_eos {
            ids.extend(self.eos_id);
        }
        Ok(ids)
    }

    /// Decode ids to text.  `skip_special` drops control tokens (`<|im_end|>`…);
    /// user-defined tokens are always kept.  Unknown ids and unused slots decode to
    /// nothing; bytes that are not valid UTF-8 become U+FFFD.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> String {
        let bytes = self.decode_bytes(ids, skip_special);
        let mut s = match String::from_utf8(bytes) {
            Ok(s) => s,
            Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
        };
        if self.strip_leading_space && s.starts_with(' ') {
            s.remove(0);
        }
        s
    }

    /// The raw bytes of a sequence of ids (no UTF-8 validation).
    pub fn decode_bytes(&self, ids: &[u32], skip_special: bool) -> Vec<u8> {
        let mut out = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            out.extend_from_slice(self.bytes.decode_piece(id, skip_special));
        }
        out
    }

    /// The raw bytes one id stands for (`None` if out of range).
    pub fn token_bytes(&self, id: u32) -> Option<&[u8]> {
        self.bytes.get(id)
    }

    /// What kind of token `id` is (`None` if out of range).
    pub fn token_kind(&self, id: u32) -> Option<TokenKind> {
        self.bytes.kind(id)
    }

    /// Is `id` a control/special token (skipped by `decode(.., true)`)?
    pub fn is_special(&self, id: u32) -> bool {
        matches!(self.bytes.kind(id), Some(TokenKind::Control))
    }

    /// Id of a token by its text: special tokens by their literal text
    /// (`"<|im_end|>"`), ordinary tokens by their vocabulary spelling (for
    /// byte-level BPE, `"Ġthe"` for " the").
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.special_ids.get(text).copied().or_else(|| self.with_special.token_to_id(text))
    }

    /// Vocabulary spelling of an id (`"Ġthe"`, `"<|im_end|>"`).
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.with_special.id_to_token(id)
    }

    /// Number of token ids (the model's embedding rows for GGUF).
    pub fn vocab_size(&self) -> usize {
        self.bytes.len().max(self.with_special.get_vocab_size(true))
    }

    pub fn bos_id(&self) -> Option<u32> {
        self.bos_id
    }

    pub fn eos_id(&self) -> Option<u32> {
        self.eos_id
    }

    /// Whether a prompt should start with BOS (`tokenizer.ggml.add_bos_token`).
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    /// Whether a prompt should end with EOS (`tokenizer.ggml.add_eos_token`).
    pub fn add_eos(&self) -> bool {
        self.add_eos
    }

    /// End-of-generation ids, sorted: eos, eot, eom and the ids of
    /// [`EOG_TOKEN_TEXTS`] present in the vocabulary as special tokens.
    pub fn eos_ids(&self) -> &[u32] {
        &self.eos_ids
    }

    /// Does `id` end generation?
    pub fn is_eos(&self, id: u32) -> bool {
        self.eos_ids.binary_search(&id).is_ok()
    }

    pub fn bos_token(&self) -> Option<&str> {
        self.bos_token.as_deref()
    }

    pub fn eos_token(&self) -> Option<&str> {
        self.eos_token.as_deref()
    }

    /// Pre-tokenizer family in use ("qwen2", "starcoder", "llama3", "gpt-2",
    /// "default", ... or "tokenizer.json").
    pub fn pre_tokenizer(&self) -> &str {
        &self.pre_family
    }

    /// The raw Jinja source of the model's chat template, if any.
    pub fn chat_template_source(&self) -> Option<&str> {
        self.chat_template_source.as_deref()
    }

    /// The compiled chat template (compiled once, on first use).
    pub fn chat_template(&self) -> Result<&ChatTemplate> {
        let src = self.chat_template_source.as_deref().ok_or(TokenizerError::NoChatTemplate)?;
        self.chat_template
            .get_or_init(|| {
                ChatTemplate::new(src, self.bos_token.as_deref(), self.eos_token.as_deref()).map_err(|e| match e {
                    TokenizerError::TemplateSyntax(m) => m,
                    other => other.to_string(),
                })
            })
            .as_ref()
            .map_err(|m| TokenizerError::TemplateSyntax(m.clone()))
    }

    /// Render `messages` with the model's chat template.
    pub fn apply_chat_template(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        self.chat_template()?.render(messages, add_generation_prompt)
    }

    /// A fresh incremental decoder (see [`StreamDecoder`]).
    pub fn stream_decoder(&self, skip_special: bool) -> StreamDecoder {
        StreamDecoder::new(skip_special)
    }

    pub(crate) fn token_bytes_table(&self) -> &TokenBytes {
        &self.bytes
    }

    pub(crate) fn strips_leading_space(&self) -> bool {
        self.strip_leading_space
    }

    /// The underlying `tokenizers` tokenizer (special tokens parsed).
    pub fn hf_tokenizer(&self) -> &Tokenizer {
        &self.with_special
    }
}

/// A GGUF vocabulary's subword model, before its added tokens, and how the
/// model spells pieces.
pub(crate) struct VocabModel {
    /// The `tokenizers` pipeline: normalizer, pre-tokenizer, BPE.
    pub tokenizer: Tokenizer,
    /// The bytes a normal piece stands for, appended to the buffer.
    pub decode_piece: fn(&str, &mut Vec<u8>),
    pub default_add_bos: bool,
    pub strip_leading_space: bool,
    /// Reported as the pre-tokenizer family.
    pub family: String,
}

/// Byte-level BPE from `tokenizer.ggml.merges`, behind llama.cpp's
/// pre-tokenizer regexes for `tokenizer.ggml.pre`.
fn byte_level_model(v: &GgufVocab) -> Result<VocabModel> {
    use gguf_vocab::*;
    let spec = pretok::spec_for(v.pre.as_deref())?;
    if v.merges.is_empty() {
        return Err(TokenizerError::MissingKey(KEY_MERGES));
    }
    // Vocabulary (later duplicates win, as in llama.cpp's token_to_id).
    let mut vocab = tokenizers::models::bpe::Vocab::with_capacity(v.tokens.len());
    for (i, t) in v.tokens.iter().enumerate() {
        vocab.insert(t.clone(), i as u32);
    }
    let mut merges = Vec::with_capacity(v.merges.len());
    for (index, m) in v.merges.iter().enumerate() {
        let bad = |reason: String| TokenizerError::BadMerge { index, merge: m.clone(), reason };
        // Like llama.cpp: the first space at byte index >= 1 separates the pair.
        let split = m.bytes().skip(1).position(|b| b == b' ').map(|p| p + 1);
        let Some(pos) = split else {
            return Err(bad("expected two tokens separated by a space".into()));
        };
        let (a, b) = (&m[..pos], &m[pos + 1..]);
        if b.is_empty() {
            return Err(bad("expected two tokens separated by a space".into()));
        }
        for part in [a, b] {
            if !vocab.contains_key(part) {
                return Err(bad(format!("`{part}` is not in the vocabulary")));
            }
        }
        if !vocab.contains_key(&format!("{a}{b}")) {
            return Err(bad(format!("merged token `{a}{b}` is not in the vocabulary")));
        }
        merges.push((a.to_string(), b.to_string()));
    }
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .ignore_merges(spec.ignore_merges)
        .build()
        .map_err(|e| TokenizerError::Tokenizers(format!("building BPE model: {e}")))?;
    let mut tokenizer = Tokenizer::new(bpe);
    tokenizer.with_normalizer(spec.normalizer());
    tokenizer.with_pre_tokenizer(Some(spec.build()?));
    tokenizer.with_decoder(Some(tokenizers::decoders::byte_level::ByteLevel::default()));
    Ok(VocabModel {
        tokenizer,
        decode_piece: bytes::byte_level_decode,
        default_add_bos: spec.default_add_bos,
        strip_leading_space: false,
        family: spec.family.to_string(),
    })
}

// The server shares one tokenizer across connections.
const _: () = {
    fn assert_send_sync<T: Send + Sync>() {}
    #[allow(dead_code)]
    fn check() {
        assert_send_sync::<TextTokenizer>();
        assert_send_sync::<ChatTemplate>();
        assert_send_sync::<StreamDecoder>();
    }
};
