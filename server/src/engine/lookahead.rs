//! Lookahead: the next decode step handed to the device before this one's
//! tokens are read back.
//!
//! A decode step costs host time (building the graph, launching its
//! kernels) and device time, and read back in series they add up: on an
//! NVIDIA H100 a one-row step of a 1.5B model is ~0.5 ms of building and
//! ~2 ms of evaluation, most of it the host launching kernels while the
//! device waits. So when a step is plain decoding (every row in a batch
//! slot, one token, no drafts, no grammar), the runner builds the step
//! after it from its draws while they are still unread arrays (the batch
//! gathers their embeddings on the device, see `BatchedRows::fed`) and
//! queues it behind this one, then reads this one's tokens. The host's work
//! for step n+1 then overlaps the device's for step n.
//!
//! The lookahead is a guess that every row decodes again. It leaves no
//! state behind: its rows' KV lengths are put back as soon as it is built
//! (what it wrote lies past them, where a slot keeps only dead positions),
//! and nothing else of a row is touched. The next step uses it only if its
//! work is exactly that for the rows it names (some may have ended or sit
//! the step out), each still at the position it was built for; otherwise
//! it is dropped, and the step is built as usual. Its draws are the
//! position-keyed draws a plain step would make (`Sampler::draw` at the
//! same generated index), so tokens are the same with or without it.
use tether_sched::{RequestId, Work};

use super::row::Row;
use super::runner::{Draws, LogitsAt, Scheduled};
use crate::models::{KvBatch, RowKv};

/// A decode step built and queued before the step it follows was read.
pub(super) struct Lookahead {
    rows: Vec<AheadRow>,
    /// Whether it ran in the GPU's fused kernels.
    pub fused: bool,
}

/// One row of a lookahead: where it stood when built, and its draws.
struct AheadRow {
    id: RequestId,
    slot: usize,
    /// The slot's length the step wrote at (the row's length once the step
    /// it follows is applied).
    len: usize,
    /// The row's generated count once the step it follows is applied.
    generated: usize,
    tokens: mlx::Array,
    logits: Option<mlx::Array>,
}

/// Whether a row of a step leaves it plain decoding, as a lookahead needs:
/// it decodes one token (and so samples it) in a batch slot, without
/// drafts, grammar (so without masks) or a drafter.
pub(super) fn plain_decode(row: &Row, work: Option<&Work>) -> bool {
    matches!(work, Some(Work::Decode { drafts }) if drafts.is_empty())
        && matches!(row.kv, RowKv::Slot(_))
        && row.progress.constraint.is_none()
        && row.drafter.is_none()
}

/// Whether a plain decoding row goes on after this step's token, if no
/// stop ends it: a row on its last token is left out of the lookahead.
pub(super) fn decodes_after(row: &Row) -> bool {
    row.progress.generation_room() > 0
}

impl Lookahead {
    /// A lookahead of the rows of `scheduled` (each [`plain_decode`]),
    /// from its lazy `draws` (one per row, in the same order), each row's
    /// slot then at length `lens[i]` (step n written), and the step's own
    /// lazy draws `ahead` (for step n+1).
    pub fn new(running: &[Row], scheduled: &[Scheduled], lens: &[usize], ahead: Vec<Draws>, fused: bool) -> Lookahead {
        let rows = scheduled
            .iter()
            .zip(lens)
            .zip(ahead)
            .map(|((s, &len), d)| {
                let row = &running[s.row];
                let LogitsAt::Slot(slot) = s.logits_at else { unreachable!("lookahead rows are batch slots") };
                AheadRow { id: row.id(), slot, len, generated: row.progress.generated + 1, tokens: d.tokens, logits: d.logits }
            })
            .collect();
        Lookahead { rows, fused }
    }

    /// Whether this lookahead is `work`: every row with work decodes one
    /// token without drafts, is one of its rows, in the same slot, at the
    /// length and generated count it was built for.
    pub fn serves(&self, work: &[Option<Work>], running: &[Row], batch: &KvBatch) -> bool {
        let mut any = false;
        for (row, w) in running.iter().zip(work) {
            let Some(w) = w else { continue };
            any = true;
            let Work::Decode { drafts } = w else { return false };
            let Some(a) = self.rows.iter().find(|a| a.id == row.id()) else { return false };
            let same_slot = matches!(&row.kv, RowKv::Slot(lease) if lease.slot() == a.slot);
            if !drafts.is_empty() || !same_slot || batch.len(a.slot) != a.len || row.progress.generated != a.generated {
                return false;
            }
        }
        any
    }

    /// Takes the step up where it stands on the device: the served rows'
    /// slots keep what it wrote again, and their draws and schedule come
    /// back, in running order (for a `work` it [`serves`](Self::serves)).
    pub fn resume(mut self, work: &[Option<Work>], running: &[Row], batch: &mut KvBatch) -> (Vec<Draws>, Vec<Scheduled>) {
        let mut advance = vec![0; batch.slots()];
        let (mut draws, mut scheduled) = (Vec::new(), Vec::new());
        for (i, row) in running.iter().enumerate() {
            if work[i].is_none() {
                continue;
            }
            let at = self.rows.iter().position(|a| a.id == row.id()).expect("served rows are the lookahead's");
            let a = self.rows.swap_remove(at);
            advance[a.slot] = 1;
            draws.push(Draws { row: i, tokens: a.tokens, logits: a.logits });
            scheduled.push(Scheduled { row: i, samples: true, logits_at: LogitsAt::Slot(a.slot), masks: None });
        }
        batch.advance(&advance);
        (draws, scheduled)
    }
}
