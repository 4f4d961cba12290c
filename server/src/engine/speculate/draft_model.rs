//! Drafts from a small model that shares the target's tokenizer (e.g.
//! Qwen2.5-Coder-0.5B drafting for 1.5B). Each speculating row keeps its own
//! KV cache in the draft model, kept in step with the target's: before
//! proposing, the draft cache catches up on the row's history (the whole
//! prompt the first time), then decodes greedily, all rows batched; after
//! verification it rolls back to the tokens the target kept.
use std::path::PathBuf;

use mlx::{Array, Dtype};

use crate::models::{KvCache, LoadOptions, RowInput, Transformer};

/// Which model drafts, loaded on the engine thread beside the target.
#[derive(Clone, Debug)]
pub struct DraftModelSpec {
    pub path: PathBuf,
    pub options: LoadOptions,
}

pub struct DraftModel {
    pub model: Transformer,
}

/// One row's part in a draft round.
pub struct DraftRow<'a> {
    /// Prompt, generated tokens and the pending token.
    pub history: &'a [u32],
    pub cache: &'a mut KvCache,
    /// Tokens to propose (at least 1).
    pub depth: usize,
}

impl DraftModel {
    /// Loads the draft and checks it can draft for a target of `target_vocab` tokens.
    pub fn load(spec: &DraftModelSpec, target_vocab: usize) -> anyhow::Result<DraftModel> {
        let model = crate::models::load_transformer(&spec.path, spec.options)?;
        anyhow::ensure!(
            model.config.vocab_size == target_vocab,
            "the draft model {} has {} tokens in its vocabulary, the target {}: they must share a tokenizer",
            spec.path.display(),
            model.config.vocab_size,
            target_vocab
        );
        // A draft's cache is cut back after every verification; recurrent
        // state cannot be (see `models/state_rows.rs`).
        anyhow::ensure!(
            model.config.hybrid.is_none(),
            "the draft model {} ({}) keeps recurrent state, which cannot roll back rejected drafts yet",
            spec.path.display(),
            model.config.arch.name()
        );
        Ok(DraftModel { model })
    }

    /// Proposes `depth` greedy tokens for every row: one forward over every
    /// row's catch-up tokens, then one single-token forward per further
    /// draft position (rows whose depth is reached drop out). The whole
    /// graph is evaluated once; the tokens are read back in one transfer.
    pub fn propose(&self, rows: &mut [DraftRow<'_>]) -> mlx::Result<Vec<Vec<u32>>> {
        let max_depth = rows.iter().map(|r| r.depth).max().unwrap_or(0);
        let mut drafted: Vec<Vec<Array>> = rows.iter().map(|_| Vec::new()).collect();
        let mut last: Vec<Option<Array>> = rows.iter().map(|_| None).collect();
        for step in 0..max_depth {
            let mut inputs = Vec::new();
            let mut who = Vec::new();
            for (r, row) in rows.iter_mut().enumerate() {
                if step >= row.depth {
                    continue;
                }
                let ids = match &last[r] {
                    Some(prev) => prev.reshape(&[1, 1])?,
                    None => {
                        let catch_up: Vec<i32> = row.history[row.cache.len()..].iter().map(|&t| t as i32).collect();
                        Array::from_i32(&catch_up, &[1, catch_up.len()])?
                    }
                };
                inputs.push(RowInput { ids, cache: &mut *row.cache, n_logits: 1 });
                who.push(r);
            }
            let logits = self.model.forward_batch(&mut inputs)?;
            drop(inputs);
            for (r, l) in who.into_iter().zip(logits) {
                let token = l.argmax(-1, false)?.astype(Dtype::I32)?;
                drafted[r].push(token.clone());
                last[r] = Some(token);
            }
        }
        let all: Vec<&Array> = drafted.iter().flatten().collect();
        if all.is_empty() {
            return Ok(rows.iter().map(|_| Vec::new()).collect());
        }
        let flat = mlx::concatenate(&all, 0)?.to_vec_i32()?;
        let mut at = 0;
        Ok(drafted
            .iter()
            .map(|d| {
                let out = flat[at..at + d.len()].iter().map(|&t| t as u32).collect();
                at += d.len();
                out
            })
            .collect())
    }
}

/// Where a row's draft cache must be cut back to after a verification:
/// it holds the `history_len` tokens of the history plus the first
/// `depth - 1` drafts (the last draft is proposed, never fed); the target
/// kept `accepted` of the drafts.
pub fn draft_cache_keep(history_len: usize, depth: usize, accepted: usize) -> usize {
    history_len + accepted.min(depth.saturating_sub(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draft_cache_keeps_what_the_target_kept() {
        // 10 tokens of history, 4 drafts fed 3 of them: all kept -> 13 (the
        // fourth is fed at the next catch-up).
        assert_eq!(draft_cache_keep(10, 4, 4), 13);
        assert_eq!(draft_cache_keep(10, 4, 2), 12);
        assert_eq!(draft_cache_keep(10, 4, 0), 10);
        assert_eq!(draft_cache_keep(10, 1, 1), 10);
    }
}
