//! The model's vocabulary as llguidance sees it: every token's bytes in a
//! trie, and the model's own tokenizer for the text a grammar forces.
use std::sync::Arc;

use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};

use crate::tokenizer::{TextTokenizer, TokenKind};

pub struct VocabEnv {
    tokenizer: Arc<TextTokenizer>,
    trie: TokTrie,
}

impl VocabEnv {
    /// The environment of `tokenizer` for a model with `vocab` logits per
    /// position (ids past the tokenizer's, a model's padding rows, get no
    /// bytes and so are never allowed). Control tokens are marked as
    /// special (llguidance's 0xFF prefix), so a grammar only produces them
    /// when it names them; every end-of-generation id may end an output.
    pub fn build(tokenizer: Arc<TextTokenizer>, vocab: usize) -> Result<TokEnv, String> {
        let vocab = vocab.max(tokenizer.vocab_size());
        let words: Vec<Vec<u8>> = (0..vocab as u32)
            .map(|id| match tokenizer.token_kind(id) {
                Some(TokenKind::Control) => {
                    let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    w.extend(tokenizer.token_bytes(id).unwrap_or_default());
                    w
                }
                Some(TokenKind::Normal | TokenKind::UserDefined) => tokenizer.token_bytes(id).unwrap_or_default().to_vec(),
                Some(TokenKind::Unused) | None => Vec::new(),
            })
            .collect();
        let eos = tokenizer.eos_ids().to_vec();
        let first_eos = *eos.first().ok_or("the model names no end-of-generation token, so no output could end")?;
        let info = TokRxInfo { tok_bos: tokenizer.bos_id(), ..TokRxInfo::new(vocab as u32, first_eos) };
        let trie = TokTrie::from(&info, &words).with_eos_tokens(&eos);
        Ok(Arc::new(VocabEnv { tokenizer, trie }))
    }
}

impl TokenizerEnv for VocabEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    /// The tokens the model itself would read for `s` (control-token text
    /// stays text), so forced tokens are the ones the model was trained on.
    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        match std::str::from_utf8(s).ok().and_then(|text| self.tokenizer.encode(text, false).ok()) {
            Some(ids) => ids,
            None => self.trie.greedy_tokenize(s),
        }
    }
}
