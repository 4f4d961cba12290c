//! SentencePiece-style BPE from GGUF metadata (`tokenizer.ggml.model =
//! "llama"`: Gemma, Llama 2, Mistral and their relatives).
//!
//! llama.cpp tokenizes these by score: spaces become `▁` (and one is put
//! before the text when `add_space_prefix`), the text starts as single
//! characters, and the adjacent pair whose joined text is the vocabulary
//! piece of highest score is joined, again and again (the leftmost pair on a
//! tie); a character no piece covers falls back to its UTF-8 bytes as
//! `<0xAB>` pieces. There are no merge rules in the file, only scores, and
//! no pre-tokenizer. The same procedure is byte-fallback BPE whose merge
//! rules are every split of every piece into two pieces, ranked by the
//! joined piece's score, which is how the `tokenizers` crate runs it here.

use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::normalizers::{Prepend, Replace, Sequence};
use tokenizers::{NormalizerWrapper, Tokenizer};

use super::error::{Result, TokenizerError};
use super::gguf_vocab::{token_type, GgufVocab, KEY_SCORES};
use super::{bytes, VocabModel};

/// SentencePiece's space marker.
const SPACE: &str = "\u{2581}";

/// The subword model of a SentencePiece-style GGUF vocabulary.
pub(super) fn model(v: &GgufVocab) -> Result<VocabModel> {
    let n = v.tokens.len();
    if v.scores.len() != n {
        return Err(TokenizerError::InvalidKey { key: KEY_SCORES, detail: format!("{} scores for {n} tokens", v.scores.len()) });
    }
    let mut vocab = Vocab::with_capacity(n);
    for (i, t) in v.tokens.iter().enumerate() {
        vocab.entry(t.clone()).or_insert(i as u32); // the first of duplicates, as llama.cpp's text_to_token
    }
    let merges = merges_by_score(v, &vocab);
    let unk = v.unk_id.and_then(|id| v.tokens.get(id as usize)).cloned();
    let mut builder = BPE::builder().vocab_and_merges(vocab, merges).byte_fallback(true);
    if let Some(unk) = unk {
        builder = builder.unk_token(unk);
    }
    let bpe = builder.build().map_err(|e| TokenizerError::Tokenizers(format!("building SentencePiece BPE model: {e}")))?;

    // llama.cpp's default for this model type is a space before the text.
    let space_prefix = v.add_space_prefix.unwrap_or(true);
    let mut normalizers: Vec<NormalizerWrapper> = Vec::new();
    if space_prefix {
        normalizers.push(Prepend::new(SPACE.into()).into());
    }
    normalizers.push(Replace::new(" ", SPACE).map_err(|e| TokenizerError::Tokenizers(e.to_string()))?.into());
    let mut tokenizer = Tokenizer::new(bpe);
    tokenizer.with_normalizer(Some(Sequence::new(normalizers)));
    Ok(VocabModel { tokenizer, decode_piece, default_add_bos: true, strip_leading_space: space_prefix, family: "sentencepiece".into() })
}

/// Every split of a piece into two pieces, ranked by the joined piece's
/// score (highest first; ties by the joined piece's id, then the split
/// point). Byte pieces (`<0xAB>`) are never joined from characters, and
/// pieces that are never matched by joining (control tokens) would not be
/// in llama.cpp either if their score put them last; they are kept so the
/// two agree on any text.
fn merges_by_score(v: &GgufVocab, vocab: &Vocab) -> Vec<(String, String)> {
    let kind = |i: usize| v.token_types.as_ref().map_or(token_type::NORMAL, |t| t[i]);
    let mut ranked: Vec<(f32, u32, usize, String, String)> = Vec::new();
    for (id, piece) in v.tokens.iter().enumerate() {
        if kind(id) == token_type::BYTE || vocab.get(piece) != Some(&(id as u32)) {
            continue;
        }
        for (at, _) in piece.char_indices().skip(1) {
            let (left, right) = piece.split_at(at);
            if vocab.contains_key(left) && vocab.contains_key(right) {
                ranked.push((v.scores[id], id as u32, at, left.to_string(), right.to_string()));
            }
        }
    }
    ranked.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    ranked.into_iter().map(|(_, _, _, left, right)| (left, right)).collect()
}

/// A normal piece's bytes: its text with `▁` read as a space.
fn decode_piece(piece: &str, out: &mut Vec<u8>) {
    bytes::sentencepiece_decode(piece, false, out)
}
