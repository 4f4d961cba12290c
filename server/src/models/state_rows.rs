//! State rows: what a hybrid model's recurrent layers (Qwen3.5's Gated
//! DeltaNet) keep of a row's history, beside its attention layers' KV.
//!
//! A recurrent layer folds every token into a fixed-size state instead of
//! keeping one key and value per position: the last `kernel - 1` inputs of
//! its short causal convolution, and one `[key_dim, value_dim]` matrix per
//! value head. The state lives in the row's [`KvCache`](super::KvCache), so
//! it goes wherever the row's KV goes (a prefix-cache entry, a lent
//! history, a tier's file) and a clone shares it copy-on-write like the KV
//! buffers.
//!
//! The key decision: a state holds one position only. KV can be cut back
//! to any earlier length; a state cannot be unwound. So the state also
//! keeps a few *checkpoints*: every layer's state as it was after a
//! [`CHECKPOINT_INTERVAL`]-token block boundary (the paged KV's block),
//! captured inside the step that passes it (the recurrent layers' prompt
//! pass yields its state there: [`capture_points`](RecurrentState::capture_points)).
//! Cutting the cache back to a checkpoint's length restores it
//! ([`rewind`](RecurrentState::rewind)); cutting it anywhere else marks the
//! state *rolled back*: it refuses to run on (its row fails rather than
//! continue from wrong state), and the prefix cache never serves it.
//!
//! Drafts use the same mechanism: a step that verifies drafts wants logits
//! at each of its positions, and the state is captured after each of them
//! too (*snapshots*, kept for that step only), so a rejected draft rewinds
//! to the state after the last accepted token.
//!
//! Which checkpoints a row keeps ([`RecurrentState::thin`]): a state costs
//! as much as many blocks of KV (Qwen3.5-0.8B: 18 recurrent layers of 1 MiB
//! in float32, the KV of ~750 positions), so not every boundary. Kept: the
//! newest [`RECENT_CHECKPOINTS`] (an agent's next prompt carries the last
//! reply re-rendered or re-tokenized, so its match ends a few tokens short
//! of the stored turn: the boundary below that is one of the last two),
//! and one more, off the boundaries, exactly where the turn's prompt ends,
//! its *anchor*: a reply the next prompt renders or tokenizes differently
//! from its first token on (one whose reasoning the chat template drops,
//! a text reply whose tokens re-encode otherwise) diverges right there,
//! however long the reply was, and resumes with nothing to read again.
//! So an entry holds at most four states: its own and three checkpoints.
use mlx::Array;

/// Positions between two checkpoints: the paged KV's block
/// (`engine/prefix/blocks.rs` checks they agree), so a checkpoint is
/// where a block ends.
pub const CHECKPOINT_INTERVAL: usize = 64;

/// The newest checkpoints a state keeps besides its anchor's (see the
/// module notes).
pub const RECENT_CHECKPOINTS: usize = 2;

/// The most states a row holds between steps: its own and its checkpoints
/// (the newest [`RECENT_CHECKPOINTS`] and the anchor's), what admission
/// reserves. A step verifying drafts holds one more per draft until the
/// next step.
pub const MAX_STATES: usize = 1 + RECENT_CHECKPOINTS + 1;

/// One recurrent layer's state of one row.
#[derive(Clone)]
pub struct LayerState {
    /// `[kernel - 1, channels]`: the convolution's last inputs, oldest first.
    pub conv: Array,
    /// `[value_heads, key_dim, value_dim]`: the delta rule's memory.
    pub delta: Array,
}

/// Per recurrent layer, its state (`None` before its first token).
pub type Layers = [Option<LayerState>];

/// Every recurrent layer's state after the first `len` tokens.
#[derive(Clone)]
struct Checkpoint {
    len: usize,
    /// A draft position's snapshot (off the block boundaries), kept only
    /// until the step after the one that took it.
    snapshot: bool,
    /// Per recurrent layer; a layer's is filled when its step passes `len`.
    layers: Vec<Option<LayerState>>,
}

impl Checkpoint {
    fn is_complete(&self) -> bool {
        self.layers.iter().all(Option::is_some)
    }
}

/// Every recurrent layer's state of one row, at the cache's length, and
/// checkpoints of it at earlier block boundaries.
#[derive(Clone)]
pub struct RecurrentState {
    /// Per recurrent layer (in layer order); `None` before its first token.
    layers: Vec<Option<LayerState>>,
    /// Set when the cache was cut back below where the state is, to no
    /// checkpoint: it no longer matches any length the cache holds.
    rolled_back: bool,
    /// Earlier states, by length, oldest first.
    checkpoints: Vec<Checkpoint>,
    /// Where the prompt of the turn being computed ends (0: not set): the
    /// state there is captured and kept.
    anchor: usize,
    /// The length the last step started from: snapshots at or below it are
    /// of earlier steps.
    step_start: usize,
}

impl RecurrentState {
    /// The state of `layers` recurrent layers before any token.
    pub fn new(layers: usize) -> RecurrentState {
        RecurrentState { layers: vec![None; layers], rolled_back: false, checkpoints: Vec::new(), anchor: 0, step_start: 0 }
    }

    /// The same layers before any token.
    pub fn emptied(&self) -> RecurrentState {
        RecurrentState::new(self.layers.len())
    }

    /// How many recurrent layers it holds the state of.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Layer `layer`'s state (`None` before its first token); an error once
    /// rolled back.
    pub fn layer(&self, layer: usize) -> mlx::Result<Option<&LayerState>> {
        if self.rolled_back {
            return Err(mlx::Error {
                op: "recurrent_state",
                message: "the row's recurrent state was rolled back and cannot run on; its prompt must be computed afresh".into(),
            });
        }
        Ok(self.layers[layer].as_ref())
    }

    /// Replaces layer `layer`'s state with the one a step computed.
    pub fn set_layer(&mut self, layer: usize, state: LayerState) {
        self.layers[layer] = Some(state);
    }

    /// The counts of a step's tokens (1-based) after which the state is to
    /// be captured, for a step of `n` tokens after the first `len` that
    /// wants logits at its last `n_logits`: where the step passes a block
    /// boundary or the anchor and, when it verifies drafts (logits at more
    /// than its last token), after each token whose logits it wants (where
    /// a rejected draft can cut it back to). Ascending.
    pub fn capture_points(&mut self, len: usize, n: usize, n_logits: usize) -> Vec<usize> {
        self.step_start = len;
        let first = (len / CHECKPOINT_INTERVAL + 1) * CHECKPOINT_INTERVAL;
        let boundaries = (first..=len + n).step_by(CHECKPOINT_INTERVAL).map(|at| at - len);
        let anchor = (len < self.anchor && self.anchor <= len + n).then(|| self.anchor - len);
        let drafts = if n_logits > 1 { n + 1 - n_logits.min(n)..n + 1 } else { 0..0 };
        let mut points: Vec<usize> = boundaries.chain(anchor).chain(drafts).collect();
        points.sort_unstable();
        points.dedup();
        points
    }

    /// Layer `layer`'s state after the first `len` tokens, as a step
    /// captured it at one of its [`capture_points`](Self::capture_points).
    pub fn record(&mut self, layer: usize, len: usize, state: LayerState) {
        let at = match self.checkpoints.iter().position(|c| c.len >= len) {
            Some(i) if self.checkpoints[i].len == len => i,
            at => {
                // A new length: this step recomputed it; anything stored
                // past it is of another continuation.
                let at = at.unwrap_or(self.checkpoints.len());
                self.checkpoints.truncate(at);
                let snapshot = !len.is_multiple_of(CHECKPOINT_INTERVAL) && len != self.anchor;
                self.checkpoints.push(Checkpoint { len, snapshot, layers: vec![None; self.layers.len()] });
                at
            }
        };
        self.checkpoints[at].layers[layer] = Some(state);
    }

    /// Sets where the prompt of the turn this state is computed for ends:
    /// the state there is captured and kept.
    pub fn set_anchor(&mut self, prompt_len: usize) {
        self.anchor = prompt_len;
    }

    /// Keeps the checkpoints the module notes name, of a state at `len`:
    /// the newest [`RECENT_CHECKPOINTS`] and the anchor's, and the last
    /// step's snapshots; the others go (an earlier turn's anchor ages like
    /// any checkpoint).
    pub fn thin(&mut self, len: usize) {
        let (step_start, anchor) = (self.step_start, self.anchor);
        self.checkpoints.retain(|c| c.len <= len && !(c.snapshot && c.len <= step_start));
        let is_anchor = |c: &Checkpoint| anchor > 0 && c.len == anchor;
        let others = self.checkpoints.iter().filter(|c| !c.snapshot && !is_anchor(c)).count();
        let recent_from = others.saturating_sub(RECENT_CHECKPOINTS);
        let mut i = 0;
        self.checkpoints.retain(|c| {
            let other = !c.snapshot && !is_anchor(c);
            i += usize::from(other);
            !other || i > recent_from
        });
    }

    /// Back to the state after the first `len` tokens: a checkpoint's or
    /// a snapshot's (those after it go, as they are of the continuation cut
    /// off, and so do the snapshots: the state is past them). Whether there
    /// was one; if not, the state is rolled back.
    pub fn rewind(&mut self, len: usize) -> bool {
        let found = self.checkpoints.iter().find(|c| c.len == len && c.is_complete()).map(|c| c.layers.clone());
        match found {
            Some(layers) if !self.rolled_back => {
                self.layers = layers;
                self.checkpoints.retain(|c| c.len <= len && !c.snapshot);
                true
            }
            _ => {
                self.rolled_back = true;
                false
            }
        }
    }

    pub fn is_rolled_back(&self) -> bool {
        self.rolled_back
    }

    /// The lengths below `len` (the cache's) the state can be rewound to
    /// for a prefix-cache hit: its checkpoints (not the snapshots of a
    /// step's drafts).
    pub fn checkpoint_lens(&self, len: usize) -> Vec<usize> {
        match self.rolled_back {
            true => Vec::new(),
            false => self.checkpoints.iter().filter(|c| c.len < len && !c.snapshot && c.is_complete()).map(|c| c.len).collect(),
        }
    }

    /// The arrays it holds (a step's writes, to evaluate with it), its
    /// checkpoints' included.
    pub fn buffers(&self) -> impl Iterator<Item = &Array> {
        let checkpoints = self.checkpoints.iter().flat_map(|c| c.layers.iter().flatten());
        self.layers.iter().flatten().chain(checkpoints).flat_map(|s| [&s.conv, &s.delta])
    }

    /// Bytes held by a state at `len`: its own and its checkpoints' (one at
    /// `len` is the state itself).
    pub fn nbytes(&self, len: usize) -> usize {
        let checkpoints = self.checkpoints.iter().filter(|c| c.len != len).flat_map(|c| c.layers.iter().flatten());
        self.layers.iter().flatten().chain(checkpoints).map(|s| s.conv.nbytes() + s.delta.nbytes()).sum()
    }

    /// Its parts for a file: per layer its state (`None` before its first
    /// token), then each checkpoint's length and layers (not snapshots).
    pub fn parts(&self) -> (&[Option<LayerState>], Vec<(usize, &Layers)>) {
        (&self.layers, self.checkpoints.iter().filter(|c| !c.snapshot).map(|c| (c.len, &c.layers[..])).collect())
    }

    /// A state of the same layers made of `parts` read back from a file;
    /// `None` when the layer counts or the lengths' order do not fit.
    pub fn from_parts(&self, layers: Vec<Option<LayerState>>, checkpoints: Vec<(usize, Vec<Option<LayerState>>)>) -> Option<RecurrentState> {
        let n = self.layers.len();
        let fits = layers.len() == n && checkpoints.iter().all(|(_, l)| l.len() == n) && checkpoints.windows(2).all(|w| w[0].0 < w[1].0);
        let checkpoints = checkpoints.into_iter().map(|(len, layers)| Checkpoint { len, snapshot: false, layers }).collect();
        fits.then_some(RecurrentState { layers, rolled_back: false, checkpoints, anchor: 0, step_start: 0 })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layer(v: f32) -> LayerState {
        let a = Array::from_f32(&[v], &[1]).unwrap();
        LayerState { conv: a.clone(), delta: a }
    }

    fn value(s: &RecurrentState) -> f32 {
        s.layer(0).unwrap().unwrap().delta.to_vec_f32().unwrap()[0]
    }

    /// A one-layer state run `len` tokens in steps of `step`, each state
    /// naming its length, captured where the step passes a boundary.
    fn run(len: usize, step: usize, anchor: usize) -> RecurrentState {
        let mut s = RecurrentState::new(1);
        s.set_anchor(anchor);
        let mut at = 0;
        while at < len {
            let n = step.min(len - at);
            for t in s.capture_points(at, n, 1) {
                s.record(0, at + t, layer((at + t) as f32));
            }
            s.set_layer(0, layer((at + n) as f32));
            at += n;
            s.thin(at);
        }
        s
    }

    #[test]
    fn capture_points_are_where_a_step_passes_a_boundary_or_verifies_a_draft() {
        let mut s = RecurrentState::new(1);
        assert_eq!(s.capture_points(0, 200, 1), [64, 128, 192]);
        assert_eq!(s.capture_points(60, 4, 1), [4]);
        assert_eq!(s.capture_points(64, 63, 1), Vec::<usize>::new());
        assert_eq!(s.capture_points(127, 1, 1), [1]);
        assert_eq!(s.capture_points(62, 4, 4), [1, 2, 3, 4], "a token and 3 drafts");
        assert_eq!(s.capture_points(62, 10, 3), [2, 8, 9, 10]);
    }

    /// A step verifying drafts keeps a snapshot per position: a rejected
    /// draft rewinds to the last accepted one, and the snapshots go then
    /// or at the next step, never crowding out a checkpoint.
    #[test]
    fn a_rejected_draft_rewinds_to_the_last_accepted_position() {
        let mut s = run(300, 300, 0); // checkpoints at 256 and 192
        let step = |s: &mut RecurrentState, at: usize, n: usize| {
            for t in s.capture_points(at, n, n) {
                s.record(0, at + t, layer((at + t) as f32));
            }
            s.set_layer(0, layer((at + n) as f32));
            s.thin(at + n);
        };
        step(&mut s, 300, 5);
        assert_eq!(s.checkpoint_lens(305), [192, 256], "snapshots are not checkpoints");
        assert!(s.rewind(302), "two of four drafts accepted");
        assert_eq!((value(&s), s.checkpoint_lens(302)), (302.0, vec![192, 256]));
        step(&mut s, 302, 1);
        step(&mut s, 303, 4); // all accepted: the snapshots stay until the next step
        assert!(s.checkpoints.iter().any(|c| c.snapshot));
        step(&mut s, 307, 1);
        assert!(!s.checkpoints.iter().any(|c| c.snapshot), "the last step's only");
        assert_eq!((value(&s), s.checkpoint_lens(308)), (308.0, vec![192, 256]));
    }

    #[test]
    fn keeps_the_newest_checkpoints_and_the_anchor() {
        for step in [1, 7, 64, 500] {
            let s = run(700, step, 300);
            assert_eq!(s.checkpoint_lens(700), [300, 576, 640], "step {step}");
        }
        // A state rewound to a checkpoint is that checkpoint's; the later ones go.
        let mut s = run(700, 9, 300);
        assert!(s.rewind(576));
        assert_eq!((value(&s), s.checkpoint_lens(576)), (576.0, vec![300]));
        assert!(s.rewind(300));
        assert_eq!(value(&s), 300.0);
        // Anywhere else: rolled back, for good.
        assert!(!s.rewind(200));
        assert!(s.layer(0).is_err() && s.checkpoint_lens(300).is_empty() && !s.rewind(300));
    }

    #[test]
    fn bytes_count_each_held_state_once() {
        let s = run(128, 128, 0);
        // The checkpoint at 128 is the state itself; the one at 64 is its own.
        assert_eq!(s.nbytes(128), 2 * 2 * 4);
    }
}
