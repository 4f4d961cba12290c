//! How the rows whose caches live in a [`KvBatch`] enter a step's flattened
//! token batch and its attention.
//!
//! A slot brings one token (decoding), its drafts too (verifying), a chunk
//! of its prompt, or nothing (idle or free). Slots attend together, in one
//! masked attention over `[slots, .., n, capacity]`, with every slot padded
//! to `n` queries. On a GPU that keeps a step's kernel count flat however
//! many rows run, but the attention of more than one query per slot goes
//! through matmuls that MLX's CUDA backend sets up anew, for milliseconds,
//! at every new shape (bench/results/gpu-h200-first-shape-cost.jsonl); so
//! `n` comes in a few sizes (1, 16, 32, 64, ...) and capacity in a few
//! classes, a run of steps repeats one shape, and the engine warms every
//! shape up before serving. Padded queries are not free either
//! (16-token chunks beside 8 decoding rows of a 1.5B model on an NVIDIA
//! H200: 8.4 ms steps at 16 queries a slot, 11 ms at 64). Those scores are materialised,
//! `slots x heads x n x capacity` of them: a slot whose chunk would push
//! them over a bound ([`SHARED_ATTENTION_SCORES`] by default) attends
//! alone, over its own keys only (unless it is the batch's only slot).
//!
//! A long prompt chunk beside decoding slots attends alone too whenever
//! that is cheaper than padding every slot to its length ([`alone_slots`]):
//! a 256-token chunk beside 8 decoding rows would otherwise make a 16-slot
//! batch compute 4,096 queries for 264 real ones. Alone, its queries are
//! padded only to a multiple of [`ALONE_QUERIES_MULTIPLE`] and it attends
//! over its slot's whole capacity under a mask, so its attention shape is
//! (queries, capacity class), a few hundred shapes the engine warms up,
//! not a new key length at every chunk.
//!
//! The per-token work (projections, MLP) need not be padded. When padding
//! would dominate (a 16-token chunk beside 15 decoding slots is 256 padded
//! rows for 31 real ones), only the real tokens go through it, and each
//! layer gathers them into the padded layout for attention and back out.
//! Two gathers per layer cost a GPU more than a few dozen padded rows, so
//! small paddings stay.
use mlx::{Array, Device};

use super::kv_batch::{capacity_class, KvBatch};

/// Padded rows a GPU computes more cheaply than it gathers them out (a
/// projection of 64 more rows is a small part of reading its weights).
const GPU_PADDING_WORTH_KEEPING: usize = 64;

/// Gathered, the real tokens are padded to a multiple of this many rows, so
/// the projections meet a few row counts, not every one (a new count is a
/// new matmul set-up on a GPU, ~4 ms); the warm-up runs these.
pub const GATHERED_ROWS_MULTIPLE: usize = 16;

/// Default bound on the scores of the shared attention (256 MB in float32).
pub const SHARED_ATTENTION_SCORES: usize = 1 << 26;

/// A slot attending alone pads its chunk to a multiple of this many
/// queries, so alone attentions come in few shapes (warmed up before serving).
pub const ALONE_QUERIES_MULTIPLE: usize = 16;

/// What a second attention in a step costs, in scores of the shared one:
/// its dozen kernels a layer take a GPU about as long as ~500 more queries
/// over 2,048 keys with 12 heads would (tens of microseconds a layer). Below
/// that much padding saved, a long chunk stays in the shared attention.
const ALONE_ATTENTION_SCORES: usize = 12 << 20;

/// The batched rows' part of a step.
pub struct BatchedRows<'a> {
    pub kv: &'a mut KvBatch,
    /// Per slot, its tokens this step (empty for an idle or free slot).
    pub tokens: Vec<Vec<i32>>,
    /// The tokens of a step built before their values are read back (the
    /// engine's lookahead): int32 `[live]`, one token for each slot that
    /// brings one, in slot order, as an unread array (the draws of the
    /// step before). `tokens` then holds one placeholder for each of them.
    pub fed: Option<Array>,
    /// Per slot, how many of its last tokens want logits: 0 for a prompt
    /// chunk that does not finish the prompt, 1 for a decode token, more to
    /// verify drafts.
    pub logits: Vec<usize>,
    /// Most scores the shared attention may hold (see the module notes).
    pub shared_scores: usize,
}

/// A step's inputs for the batched rows, shared by every layer.
pub(super) struct BatchStep {
    pub slots: usize,
    /// Queries per slot in the shared attention.
    pub n: usize,
    /// Whether the shared attention runs (some slot that does not attend
    /// alone has tokens).
    pub shared: bool,
    /// `[1, tokens]` int32: the batched part of the step's token ids.
    pub ids: Array,
    /// Tokens of the batched part in the flattened batch.
    pub tokens: usize,
    /// Per slot, where its tokens start in the batched part.
    starts: Vec<usize>,
    /// Per slot, how many of its tokens are real.
    pub real: Vec<usize>,
    /// int32 `[slots, 1, n, 1]`: where each slot's shared-attention rows are written.
    pub positions: Array,
    /// `[slots, 1, n, capacity]` additive.
    pub mask: Array,
    /// The same two for sliding-window layers, which index each slot's
    /// positions from its first (see [`KvBatch`]); `None` without them.
    pub window: Option<(Array, Array)>,
    /// int32 `[slots]`: each slot's first position.
    pub offsets: Array,
    /// Slots that attend alone this step.
    pub alone: Vec<AloneSlot>,
    /// Index maps between the batched part's rows and the attention's
    /// (`None`: the batched part is the shared attention's padded layout).
    layout: Option<Layout>,
}

/// A slot whose chunk attends over its own keys (see the module notes).
pub(super) struct AloneSlot {
    pub slot: usize,
    /// Its first row in the batched part.
    pub start: usize,
    /// Its real tokens (the first of its rows).
    pub tokens: usize,
    /// Its rows in the batched part and queries in its attention: `tokens`
    /// padded to a multiple of [`ALONE_QUERIES_MULTIPLE`] (exactly `tokens`
    /// in a batch with window layers, which attend over their own keys).
    pub queries: usize,
    /// Its length before the step: where its tokens go.
    pub offset: usize,
    /// `[1, 1, queries, capacity]` additive: query `i` sees the slot's keys up
    /// to `offset + i` (`None` in a batch with window layers).
    pub mask: Option<Array>,
}

struct Layout {
    /// int32 `[slots * n]`: for each row of the shared attention, the row of
    /// the batched part it takes (its own token, or any for padding: its
    /// outputs are dropped and its cache writes land past the slot's length).
    to_shared: Array,
    /// int32 `[tokens]`: for each row of the batched part, its row among the
    /// attention outputs (the shared attention's, then each alone slot's).
    to_flat: Array,
}

impl BatchStep {
    pub fn prepare(b: &mut BatchedRows<'_>, heads: usize) -> mlx::Result<BatchStep> {
        let slots = b.kv.slots();
        let real: Vec<usize> = b.tokens.iter().map(Vec::len).collect();
        let most = real.iter().copied().max().unwrap_or(0);
        if slots == 0 || real.len() != slots || b.logits.len() != slots || most == 0 || real.iter().zip(&b.logits).any(|(&r, &l)| l > r) {
            return Err(mlx::Error { op: "forward", message: format!("bad batched rows: {slots} slots, tokens {real:?}, logits {:?}", b.logits) });
        }
        let lens: Vec<usize> = (0..slots).map(|s| b.kv.len(s)).collect();
        let longest = (0..slots).map(|s| lens[s] + real[s]).max().unwrap_or(0);
        // The capacity this step will have (at most: the class holding the
        // longest slot and a padding row), which bounds the shared scores.
        let capacity = b.kv.capacity().max(capacity_class(longest + 1));
        let fits = (b.shared_scores / (slots * heads * capacity).max(1)).max(1);
        let windows = widest_window(b.kv).is_some();
        let queries = |r: usize| if windows { r } else { alone_queries(r) };
        let is_alone = alone_slots(&real, fits, ALONE_ATTENTION_SCORES / (heads * capacity).max(1), queries);
        let shared_most = (0..slots).filter(|&s| !is_alone[s]).map(|s| real[s]).max().unwrap_or(0);
        let shared = shared_most > 0;
        let n = queries_per_slot(shared_most.max(1));
        let shared_tokens: usize = (0..slots).filter(|&s| !is_alone[s]).map(|s| real[s]).sum();
        let any_alone = is_alone.iter().any(|&a| a);
        // Rows of each slot in the batched part: an alone slot's padding rides along.
        let spans: Vec<usize> = (0..slots).map(|s| if is_alone[s] { queries(real[s]) } else { real[s] }).collect();

        let (ids, starts, layout) = if any_alone || gathers(slots, n, shared_tokens, mlx::default_device()) {
            let total: usize = spans.iter().sum();
            let rows = total.next_multiple_of(GATHERED_ROWS_MULTIPLE);
            let mut ids = Vec::with_capacity(rows);
            for (tokens, &span) in b.tokens.iter().zip(&spans) {
                ids.extend_from_slice(tokens);
                ids.extend(std::iter::repeat_n(0, span - tokens.len()));
            }
            ids.resize(rows, 0);
            let starts: Vec<usize> = spans.iter().scan(0, |at, &r| Some(std::mem::replace(at, *at + r))).collect();
            let to_shared: Vec<i32> =
                (0..slots * n).map(|p| (p / n, p % n)).map(|(s, i)| if !is_alone[s] && i < real[s] { (starts[s] + i) as i32 } else { 0 }).collect();
            // Attention outputs: the shared attention's slots * n rows (if it
            // runs), then each alone slot's rows in slot order.
            let mut alone_base = if shared { slots * n } else { 0 };
            let mut to_flat = Vec::with_capacity(rows);
            for s in 0..slots {
                if is_alone[s] {
                    to_flat.extend((0..spans[s]).map(|i| (alone_base + i) as i32));
                    alone_base += spans[s];
                } else {
                    to_flat.extend((0..real[s]).map(|i| (s * n + i) as i32));
                }
            }
            to_flat.resize(rows, 0);
            let layout = Layout { to_shared: Array::from_i32(&to_shared, &[slots * n])?, to_flat: Array::from_i32(&to_flat, &[rows])? };
            (ids, starts, Some(layout))
        } else {
            let mut ids = Vec::with_capacity(slots * n);
            for tokens in &b.tokens {
                ids.extend_from_slice(tokens);
                // Padding: any valid id (see `Layout::to_shared`).
                ids.extend(std::iter::repeat_n(0, n - tokens.len()));
            }
            (ids, (0..slots).map(|s| s * n).collect(), None)
        };
        let alone_slots: Vec<usize> = (0..slots).filter(|&s| is_alone[s]).collect();
        // The shared attention writes every slot's n rows: an alone slot's
        // (all padding there) past its chunk, which it writes itself.
        let write_from: Vec<usize> = (0..slots).map(|s| lens[s] + if is_alone[s] { real[s] } else { 0 }).collect();
        let shared_real: Vec<usize> = (0..slots).map(|s| if is_alone[s] { 0 } else { real[s] }).collect();
        let needed = (0..slots).map(|s| if shared { KvBatch::padded_room(write_from[s], shared_real[s], n) } else { lens[s] + real[s] }).max().unwrap_or(0);
        b.kv.ensure_capacity(needed)?;
        let positions = b.kv.write_positions(&write_from, &shared_real, n)?;
        let mask = b.kv.step_mask(&positions)?;
        let window = match widest_window(b.kv) {
            Some(size) => {
                let ends: Vec<usize> =
                    (0..slots).map(|s| if shared { KvBatch::padded_room(write_from[s], shared_real[s], n) } else { lens[s] + real[s] }).collect();
                b.kv.make_window_room(&ends)?;
                let positions = b.kv.window_write_positions(&write_from, &shared_real, n)?;
                let mask = b.kv.window_step_mask(&positions, size)?;
                Some((positions, mask))
            }
            None => None,
        };
        // After any growth above: an alone slot's mask spans the capacity its keys have.
        let alone = alone_slots
            .into_iter()
            .map(|s| {
                let mask = if windows { None } else { Some(b.kv.alone_mask(lens[s], spans[s])?) };
                Ok(AloneSlot { slot: s, start: starts[s], tokens: real[s], queries: spans[s], offset: lens[s], mask })
            })
            .collect::<mlx::Result<Vec<_>>>()?;
        let tokens = ids.len();
        let ids = Array::from_i32(&ids, &[1, tokens])?;
        let ids = match &b.fed {
            Some(fed) => fed_ids(&ids, fed, &starts, &real)?,
            None => ids,
        };
        Ok(BatchStep { slots, n, shared, ids, tokens, starts, real, positions, mask, window, offsets: b.kv.offsets()?, alone, layout })
    }

    /// The batched part's `[1, tokens, width]` activations in the shared
    /// attention's layout, `[1, slots * n, width]`.
    pub fn to_shared(&self, x: &Array) -> mlx::Result<Array> {
        match &self.layout {
            Some(l) => x.take(&l.to_shared, 1),
            None => Ok(x.clone()),
        }
    }

    /// The attention outputs (the shared attention's, then each alone
    /// slot's, `[1, rows, width]` each) as the batched part's rows.
    pub fn to_flat(&self, outputs: &[Array]) -> mlx::Result<Array> {
        let joined = match outputs {
            [one] => one.clone(),
            _ => mlx::concatenate(&outputs.iter().collect::<Vec<_>>(), 1)?,
        };
        match &self.layout {
            Some(l) => joined.take(&l.to_flat, 1),
            None => Ok(joined),
        }
    }

    /// Per slot, (first position, count) in the batched part of the tokens
    /// whose logits are wanted: a slot's last `logits[s]` real tokens.
    pub fn logit_spans<'a>(&'a self, logits: &'a [usize]) -> impl Iterator<Item = (usize, usize)> + 'a {
        (0..self.slots).map(move |s| (self.starts[s] + self.real[s] - logits[s], logits[s]))
    }
}

/// The widest window of a batch's sliding-window layers, if it has any.
/// `ids` with the fed tokens in place of the placeholders: the first
/// token of each slot that brings any (`real`), at its start in the
/// batched part, takes the next of `fed` (see [`BatchedRows::fed`]).
fn fed_ids(ids: &Array, fed: &Array, starts: &[usize], real: &[usize]) -> mlx::Result<Array> {
    let at: Vec<i32> = starts.iter().zip(real).filter(|(_, &r)| r > 0).map(|(&s, _)| s as i32).collect();
    if at.len() != fed.size() || real.iter().any(|&r| r > 1) {
        return Err(mlx::Error { op: "forward", message: format!("{} fed tokens for slots bringing {real:?}", fed.size()) });
    }
    let n = at.len() as i32;
    ids.put_along_axis(&Array::from_i32(&at, &[1, at.len()])?, &fed.astype(mlx::Dtype::I32)?.reshape(&[1, n])?, 1)
}

fn widest_window(kv: &KvBatch) -> Option<usize> {
    (0..kv.layer_count()).filter_map(|l| kv.window(l)).max()
}

/// Most queries per slot of the shared attention's smallest multi-query
/// shape: a draft verification (up to 15 drafts) and the small chunks of
/// prompts that share a widened allowance (`widened_chunk_max` in the
/// scheduler) fit it, so they all share it; longer chunks may attend alone.
pub const SMALL_QUERIES: usize = 16;

/// Queries per slot of a shared attention whose busiest slot brings
/// `tokens`: one for decoding, else the next of 16, 32, 64, ...: at most
/// twice the tokens, and few enough sizes to warm every shape up.
pub fn queries_per_slot(tokens: usize) -> usize {
    match tokens {
        0..=1 => 1,
        _ => tokens.next_power_of_two().max(SMALL_QUERIES),
    }
}

/// Queries of a slot attending alone with `tokens` real ones (see [`ALONE_QUERIES_MULTIPLE`]).
pub fn alone_queries(tokens: usize) -> usize {
    tokens.next_multiple_of(ALONE_QUERIES_MULTIPLE)
}

/// Which slots of a step attend alone, given each slot's real tokens:
/// those whose padded queries would push the shared scores past their bound
/// (more than `fits` queries a slot), and the long chunks (more than
/// [`SMALL_QUERIES`]) too when the padding they spare the other slots costs
/// more than the attentions they add (`overhead` queries of the shared
/// attention each). `queries` gives an alone slot's queries. The batch's
/// only slot gains nothing alone: the same scores, at a shape of its own.
fn alone_slots(real: &[usize], fits: usize, overhead: usize, queries: impl Fn(usize) -> usize) -> Vec<bool> {
    let slots = real.len();
    if slots <= 1 {
        return vec![false; slots];
    }
    // In units of one query over the capacity, the same for every option.
    let cost = |alone: &[bool]| {
        let shared_most = (0..slots).filter(|&s| !alone[s]).map(|s| real[s]).max().unwrap_or(0);
        let shared = if shared_most > 0 { slots * queries_per_slot(shared_most) } else { 0 };
        let attentions = usize::from(shared_most > 0) + alone.iter().filter(|&&a| a).count();
        let own: usize = (0..slots).filter(|&s| alone[s]).map(|s| queries(real[s])).sum();
        shared + own + attentions.saturating_sub(1) * overhead
    };
    let forced: Vec<bool> = real.iter().map(|&r| r > 1 && queries_per_slot(r) > fits).collect();
    let with_long: Vec<bool> = real.iter().zip(&forced).map(|(&r, &f)| f || r > SMALL_QUERIES).collect();
    if cost(&with_long) < cost(&forced) {
        with_long
    } else {
        forced
    }
}

/// Whether a step of `slots` slots of `n` tokens, `real` of them real, runs
/// its per-token work on the real tokens only. On a CPU every padded row is
/// compute; on a GPU a few dozen are cheaper than the gathers.
fn gathers(slots: usize, n: usize, real: usize, device: Device) -> bool {
    let padding = slots * n - real;
    let worth_keeping = match device {
        Device::Gpu => GPU_PADDING_WORTH_KEEPING,
        Device::Cpu => 0,
    };
    padding > real.max(worth_keeping)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn padding_is_gathered_out_once_it_outweighs_the_real_tokens() {
        // Decode of 8 full slots: nothing to gather.
        assert!(!gathers(8, 1, 8, Device::Cpu));
        // A 16-token chunk beside 15 decoding slots: 256 rows, 31 real.
        assert!(gathers(16, 16, 31, Device::Cpu));
        assert!(gathers(16, 16, 31, Device::Gpu));
        // A 2-token verification beside 7 decoding slots, padded to 16 queries: 128 rows for 9.
        assert!(gathers(8, 16, 9, Device::Gpu));
        assert!(!gathers(2, 16, 17, Device::Gpu));
        // Four slots all reading 16-token chunks: nothing padded.
        assert!(!gathers(4, 16, 64, Device::Cpu));
    }

    #[test]
    fn a_long_chunk_beside_decoding_slots_attends_alone() {
        let exact = |r: usize| r;
        // 8 decoding rows in 16 slots beside a 256-token chunk: padding all
        // to 256 queries is 4,096 of them; alone, 16 + 256 + the overhead.
        let mut real = vec![0; 16];
        real[..8].fill(1);
        real[8] = 256;
        let alone = alone_slots(&real, usize::MAX, 500, exact);
        assert_eq!(alone.iter().filter(|&&a| a).count(), 1);
        assert!(alone[8]);
        // A 32-token chunk saves less padding than a second attention costs.
        real[8] = 32;
        assert!(alone_slots(&real, usize::MAX, 500, exact).iter().all(|&a| !a));
        // Four 128-token chunks beside one decoding row share the attention:
        // four more attentions would cost more than padding 3 slots.
        let real = [128, 128, 128, 128, 1, 0, 0, 0];
        assert!(alone_slots(&real, usize::MAX, 500, exact).iter().all(|&a| !a));
        // The only busy slot of a batch with free slots attends alone (the
        // shared attention then does not run at all).
        let real = [340, 0];
        assert_eq!(alone_slots(&real, usize::MAX, 500, exact), [true, false]);
        // A lone slot never does; the scores' bound still sends chunks alone.
        assert_eq!(alone_slots(&[512], 1, 500, exact), [false]);
        assert_eq!(alone_slots(&[2, 1, 1, 1], 1, 500, exact), [true, false, false, false]);
    }

    #[test]
    fn queries_come_in_few_sizes() {
        let sizes: Vec<usize> = [1, 2, 16, 17, 64, 65, 256, 330].into_iter().map(queries_per_slot).collect();
        assert_eq!(sizes, [1, 16, 16, 32, 64, 128, 256, 512]);
    }
}
