//! A step's token masks: for every constrained row that samples this step,
//! the allowed set at each position it verifies. They are made on a thread
//! of their own while the step's forward is built and evaluated (the
//! forward does not need them, only the draws after it), so their host time
//! hides behind the forward's; before the forward, [`cut_forbidden_drafts`]
//! only checks drafts token by token, which is far cheaper than a mask.
//! Rows are independent, so their masks are made side by side on the host's
//! cores, and they go to the device as bits (one upload of 4.7k words a
//! position for a 152k-token vocabulary), where [`MaskExpander`] turns them
//! into the allowed sets the logits are filtered by. On an H200 at 32
//! constrained streams, serial masks with a float bias row each built on
//! the host took 12 ms of a 21 ms step (docs/performance.md, "Structured
//! outputs").
use mlx::{Array, Dtype};

use tether_sched::constraint::{TokenConstraint, TokenMask};
use tether_sched::Work;

use super::row::Row;

/// One per sampled position of a constrained row: the next token, then one
/// after each draft.
pub(super) type RowMasks = Vec<TokenMask>;

/// Cuts each constrained row's drafts at the first one its grammar forbids
/// (it could never be accepted, so the forward need not verify it). Returns
/// the rows whose matcher failed, with why.
pub(super) fn cut_forbidden_drafts(rows: &mut [Row], work: &mut [Option<Work>]) -> Vec<(usize, String)> {
    let mut failed = Vec::new();
    for (i, (row, w)) in rows.iter_mut().zip(work.iter_mut()).enumerate() {
        let (Some(c), Some(Work::Decode { drafts })) = (&mut row.progress.constraint, w) else { continue };
        if drafts.is_empty() {
            continue;
        }
        match c.valid_prefix(drafts) {
            Ok(n) => drafts.truncate(n),
            Err(e) => failed.push((i, e)),
        }
    }
    failed
}

/// The masks of one step, made on a thread of their own while the step's
/// forward is built and evaluated. The rows' matchers go with the thread
/// and come back to their rows in [`MasksInFlight::finish`].
pub(super) struct MasksInFlight {
    thread: std::thread::JoinHandle<Vec<MadeMasks>>,
}

/// (running row, its matcher, its masks or why its matcher failed)
type MadeMasks = (usize, Box<dyn TokenConstraint>, Result<RowMasks, String>);

impl MasksInFlight {
    /// Starts the masks of every row of `work` that is constrained and
    /// samples this step (before the rows take their input: a prompt chunk
    /// samples when it reads the rest); `None` when there is none.
    pub fn start(rows: &mut [Row], work: &[Option<Work>]) -> Option<MasksInFlight> {
        let mut jobs = Vec::new();
        for (i, (row, w)) in rows.iter_mut().zip(work).enumerate() {
            let drafts = match w {
                Some(Work::Decode { drafts }) => drafts.clone(),
                Some(w @ Work::Prefill { .. }) if row.progress.samples_after(w) => Vec::new(),
                _ => continue,
            };
            if let Some(c) = row.progress.constraint.take() {
                jobs.push((i, c, drafts));
            }
        }
        if jobs.is_empty() {
            return None;
        }
        let thread = std::thread::spawn(move || {
            side_by_side(jobs, |(i, mut c, drafts)| {
                let masks = constrain(c.as_mut(), &drafts);
                (i, c, masks)
            })
        });
        Some(MasksInFlight { thread })
    }

    pub fn is_finished(&self) -> bool {
        self.thread.is_finished()
    }

    /// Waits for the masks and gives each matcher back to its row: each
    /// row's masks, or why its matcher failed (that row only).
    pub fn finish(self, rows: &mut [Row]) -> Vec<(usize, Result<RowMasks, String>)> {
        let made = self.thread.join().expect("the mask thread panicked");
        made.into_iter()
            .map(|(i, c, masks)| {
                rows[i].progress.constraint = Some(c);
                (i, masks)
            })
            .collect()
    }
}

/// A row's masks: its next token's, then after each draft, walking the
/// drafts through the matcher, which is rolled back after, so it holds
/// emitted tokens only. Past a draft the masks forbid (the drafts were cut
/// by [`TokenConstraint::valid_prefix`], so only where it and the mask
/// disagree), the last mask repeats: that draft is rejected whatever is
/// drawn after it, so those positions' draws are never used.
fn constrain(c: &mut dyn TokenConstraint, drafts: &[u32]) -> Result<Vec<TokenMask>, String> {
    let mut masks = vec![c.allowed()?];
    let mut walked = 0;
    for &draft in drafts {
        if walked + 1 == masks.len() && masks[walked].allows(draft) && !c.is_finished() {
            c.consume(&[draft])?;
            walked += 1;
            masks.push(c.allowed()?);
        } else {
            masks.push(masks[masks.len() - 1].clone());
        }
    }
    c.rollback(walked)?;
    if masks.iter().any(TokenMask::is_empty) {
        return Err("the grammar allows no token here".into());
    }
    Ok(masks)
}

/// `f` over `jobs` on up to as many threads as the host has cores, results
/// in the jobs' order. One job runs on the calling thread, without a spawn.
fn side_by_side<T: Send, R: Send>(jobs: Vec<T>, f: impl Fn(T) -> R + Sync) -> Vec<R> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = cores.min(jobs.len());
    if threads <= 1 {
        return jobs.into_iter().map(f).collect();
    }
    let per_thread = jobs.len().div_ceil(threads);
    let mut chunks: Vec<Vec<T>> = Vec::with_capacity(threads);
    let mut jobs = jobs.into_iter().peekable();
    while jobs.peek().is_some() {
        chunks.push(jobs.by_ref().take(per_thread).collect());
    }
    let f = &f;
    std::thread::scope(|s| {
        let mut chunks = chunks.into_iter();
        let first = chunks.next().unwrap_or_default();
        let handles: Vec<_> = chunks.map(|chunk| s.spawn(move || chunk.into_iter().map(f).collect::<Vec<R>>())).collect();
        let mut out: Vec<R> = first.into_iter().map(f).collect();
        for h in handles {
            out.extend(h.join().expect("a mask thread panicked"));
        }
        out
    })
}

/// The device side of the masks: `[positions, vocab]` booleans, true where
/// a token is allowed. On a GPU every constrained position's bits go up in
/// one `[positions, words]` upload and are expanded there, by gathering each
/// token's word and testing its bit (the per-token word index and bit shift
/// are made once per logits width). On the CPU those four element-wise ops
/// would run on one core while the other waits (at 32 constrained streams
/// of a 152k-token vocabulary, a tenth of the step), so the host expands the
/// bits into the booleans itself, a byte at a time through a table.
#[derive(Default)]
pub(super) struct MaskExpander {
    /// (width, word index of each token, bit of each token within its word)
    tables: Option<(usize, Array, Array)>,
}

impl MaskExpander {
    /// `[sum of positions, vocab]` booleans for `masks` (rows in order, each
    /// row's positions in order): true where a token is allowed. Ids past a
    /// mask's words (a model's padding rows) are never allowed.
    pub fn allowed(&mut self, masks: &[&RowMasks], vocab: usize) -> mlx::Result<Array> {
        match mlx::default_device() {
            mlx::Device::Cpu => Self::expanded_on_host(masks, vocab),
            mlx::Device::Gpu => self.expanded_on_device(masks, vocab),
        }
    }

    fn expanded_on_host(masks: &[&RowMasks], vocab: usize) -> mlx::Result<Array> {
        // Byte value -> its 8 bits as 8 booleans, lowest bit first.
        static BYTE_BITS: std::sync::OnceLock<[[bool; 8]; 256]> = std::sync::OnceLock::new();
        let table = BYTE_BITS.get_or_init(|| std::array::from_fn(|b| std::array::from_fn(|i| b >> i & 1 == 1)));
        let positions: usize = masks.iter().map(|m| m.len()).sum();
        let mut allowed = vec![false; positions * vocab];
        let jobs: Vec<(&TokenMask, &mut [bool])> = masks.iter().flat_map(|m| m.iter()).zip(allowed.chunks_mut(vocab.max(1))).collect();
        side_by_side(jobs, |(mask, out)| {
            let bytes = mask.words.iter().flat_map(|w| w.to_le_bytes());
            for (chunk, byte) in out.chunks_mut(8).zip(bytes) {
                chunk.copy_from_slice(&table[byte as usize][..chunk.len()]);
            }
        });
        Array::from_bool(&allowed, &[positions, vocab])
    }

    fn expanded_on_device(&mut self, masks: &[&RowMasks], vocab: usize) -> mlx::Result<Array> {
        if self.tables.as_ref().is_none_or(|(w, _, _)| *w != vocab) {
            let ids: Vec<u32> = (0..vocab as u32).collect();
            let word: Vec<u32> = ids.iter().map(|t| t / 32).collect();
            let bit: Vec<u32> = ids.iter().map(|t| t % 32).collect();
            self.tables = Some((vocab, Array::from_u32(&word, &[vocab])?, Array::from_u32(&bit, &[vocab])?));
        }
        let (_, word, bit) = self.tables.as_ref().expect("made above");
        let words_per_position = vocab.div_ceil(32);
        let positions: usize = masks.iter().map(|m| m.len()).sum();
        let mut bits = Vec::with_capacity(positions * words_per_position);
        for mask in masks.iter().flat_map(|m| m.iter()) {
            let have = mask.words.len().min(words_per_position);
            bits.extend_from_slice(&mask.words[..have]);
            bits.resize(bits.len() + words_per_position - have, 0);
        }
        let bits = Array::from_u32(&bits, &[positions, words_per_position])?;
        let one = Array::scalar(1.0, Dtype::U32)?;
        bits.take(word, 1)?.right_shift(bit)?.bitwise_and(&one)?.equal(&one)
    }
}

#[cfg(test)]
mod tests {
    use super::side_by_side;

    /// Both expansions (the CPU's on the host, the GPU's as MLX ops, which
    /// run on whatever device is the default) give the masks' sets.
    #[test]
    fn expanded_masks_are_the_host_masks() {
        use super::{MaskExpander, TokenMask};
        let vocab = 70;
        let a = TokenMask { words: vec![0b1011, 1 << 5, u32::MAX] };
        let b = TokenMask { words: vec![0, 0, 1 << 3] };
        let c = TokenMask { words: vec![u32::MAX] };
        let rows = [vec![a.clone(), b.clone()], vec![c.clone()]];
        let refs: Vec<&Vec<TokenMask>> = rows.iter().collect();
        let on_host = MaskExpander::expanded_on_host(&refs, vocab).unwrap();
        let on_device = MaskExpander::default().expanded_on_device(&refs, vocab).unwrap();
        for allowed in [on_host, on_device] {
            assert_eq!(allowed.shape(), [3, vocab]);
            let got = allowed.astype(mlx::Dtype::U32).unwrap().to_vec_u32().unwrap();
            for (p, mask) in [&a, &b, &c].iter().enumerate() {
                for t in 0..vocab {
                    assert_eq!(got[p * vocab + t] == 1, mask.allows(t as u32), "position {p} token {t}");
                }
            }
        }
    }

    #[test]
    fn side_by_side_keeps_the_jobs_order() {
        for n in [0, 1, 2, 3, 7, 33, 100] {
            let out = side_by_side((0..n).collect(), |x: u64| x * x);
            assert_eq!(out, (0..n).map(|x| x * x).collect::<Vec<_>>());
        }
    }

    /// Positions past a forbidden draft repeat the last mask (their draws
    /// are never used), and the matcher ends where it began.
    #[test]
    fn masks_follow_the_drafts_the_grammar_allows() {
        use super::constrain;
        use tether_sched::constraint::{testing::Exactly, ConstraintSpec};
        let mut c = Exactly(vec![1, 2, 3]).start().unwrap();
        let allows_only = |m: &super::TokenMask| (0..32).filter(|&t| m.allows(t)).collect::<Vec<_>>();
        let masks = constrain(c.as_mut(), &[1, 5, 2]).unwrap();
        assert_eq!(masks.iter().map(allows_only).collect::<Vec<_>>(), [vec![1], vec![2], vec![2], vec![2]]);
        assert_eq!(c.forced(), [1, 2, 3]);
        let masks = constrain(c.as_mut(), &[1, 2]).unwrap();
        assert_eq!(masks.iter().map(allows_only).collect::<Vec<_>>(), [vec![1], vec![2], vec![3]]);
        assert_eq!(c.valid_prefix(&[1, 2, 4]).unwrap(), 2);
        assert_eq!(c.forced(), [1, 2, 3]);
    }
}
