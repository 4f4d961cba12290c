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
//! Which checkpoints a row keeps ([`RecurrentState::thin`]): a state costs
//! as much as many blocks of KV (Qwen3.5-0.8B: 18 recurrent layers of 1 MiB
//! in float32, the KV of ~750 positions), so not every boundary. Kept: the
//! newest [`RECENT_CHECKPOINTS`] (an agent's next prompt carries the last
//! reply re-rendered or re-tokenized, so its match ends a few tokens short
//! of the stored turn: the boundary below that is one of the last two),
//! and the last boundary at or below the turn's prompt end, its *anchor*
//! (a reply the next prompt renders differently from its first token on,
//! such as one whose reasoning the chat template drops, diverges right
//! after the prompt, however long the reply was). So an entry holds at
//! most four states: its own and three checkpoints.
use mlx::Array;

/// Positions between two checkpoints: the paged KV's block
/// (`engine/prefix/blocks.rs` checks they agree), so a checkpoint is
/// where a block ends.
pub const CHECKPOINT_INTERVAL: usize = 64;

/// The newest checkpoints a state keeps besides its anchor's (see the
/// module notes).
pub const RECENT_CHECKPOINTS: usize = 2;

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
    /// checkpoint at the last boundary at or below it is kept.
    anchor: usize,
}

impl RecurrentState {
    /// The state of `layers` recurrent layers before any token.
    pub fn new(layers: usize) -> RecurrentState {
        RecurrentState { layers: vec![None; layers], rolled_back: false, checkpoints: Vec::new(), anchor: 0 }
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
    /// be captured, for a step of `n` tokens after the first `len`: where
    /// the step passes a block boundary.
    pub fn capture_points(&self, len: usize, n: usize) -> Vec<usize> {
        let first = (len / CHECKPOINT_INTERVAL + 1) * CHECKPOINT_INTERVAL;
        (first..=len + n).step_by(CHECKPOINT_INTERVAL).map(|at| at - len).collect()
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
                self.checkpoints.push(Checkpoint { len, layers: vec![None; self.layers.len()] });
                at
            }
        };
        self.checkpoints[at].layers[layer] = Some(state);
    }

    /// Sets where the prompt of the turn this state is computed for ends:
    /// the checkpoint at the last boundary at or below it is kept.
    pub fn set_anchor(&mut self, prompt_len: usize) {
        self.anchor = prompt_len;
    }

    /// Keeps the checkpoints the module notes name, of a state at `len`:
    /// the newest [`RECENT_CHECKPOINTS`] and the anchor's; the others go.
    pub fn thin(&mut self, len: usize) {
        self.checkpoints.retain(|c| c.len <= len);
        let anchor = self.anchor / CHECKPOINT_INTERVAL * CHECKPOINT_INTERVAL;
        let recent_from = self.checkpoints.len().saturating_sub(RECENT_CHECKPOINTS);
        let mut i = 0;
        self.checkpoints.retain(|c| {
            i += 1;
            i > recent_from || (anchor > 0 && c.len == anchor)
        });
    }

    /// Back to the state after the first `len` tokens: a checkpoint's
    /// (those after it go, as they are of the continuation cut off).
    /// Whether there was one; if not, the state is rolled back.
    pub fn rewind(&mut self, len: usize) -> bool {
        let found = self.checkpoints.iter().find(|c| c.len == len && c.is_complete()).map(|c| c.layers.clone());
        match found {
            Some(layers) if !self.rolled_back => {
                self.layers = layers;
                self.checkpoints.retain(|c| c.len <= len);
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

    /// The lengths below `len` (the cache's) the state can be rewound to.
    pub fn checkpoint_lens(&self, len: usize) -> Vec<usize> {
        match self.rolled_back {
            true => Vec::new(),
            false => self.checkpoints.iter().filter(|c| c.len < len && c.is_complete()).map(|c| c.len).collect(),
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
    /// token), then each checkpoint's length and layers.
    pub fn parts(&self) -> (&[Option<LayerState>], Vec<(usize, &Layers)>) {
        (&self.layers, self.checkpoints.iter().map(|c| (c.len, &c.layers[..])).collect())
    }

    /// A state of the same layers made of `parts` read back from a file;
    /// `None` when the layer counts or the lengths' order do not fit.
    pub fn from_parts(&self, layers: Vec<Option<LayerState>>, checkpoints: Vec<(usize, Vec<Option<LayerState>>)>) -> Option<RecurrentState> {
        let n = self.layers.len();
        let fits = layers.len() == n && checkpoints.iter().all(|(_, l)| l.len() == n) && checkpoints.windows(2).all(|w| w[0].0 < w[1].0);
        let checkpoints = checkpoints.into_iter().map(|(len, layers)| Checkpoint { len, layers }).collect();
        fits.then_some(RecurrentState { layers, rolled_back: false, checkpoints, anchor: 0 })
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
            for t in s.capture_points(at, n) {
                s.record(0, at + t, layer((at + t) as f32));
            }
            s.set_layer(0, layer((at + n) as f32));
            at += n;
            s.thin(at);
        }
        s
    }

    #[test]
    fn capture_points_are_where_a_step_passes_a_boundary() {
        let s = RecurrentState::new(1);
        assert_eq!(s.capture_points(0, 200), [64, 128, 192]);
        assert_eq!(s.capture_points(60, 4), [4]);
        assert_eq!(s.capture_points(64, 63), Vec::<usize>::new());
        assert_eq!(s.capture_points(127, 1), [1]);
    }

    #[test]
    fn keeps_the_newest_checkpoints_and_the_anchor() {
        for step in [1, 7, 64, 500] {
            let s = run(700, step, 300);
            assert_eq!(s.checkpoint_lens(700), [256, 576, 640], "step {step}");
        }
        // A state rewound to a checkpoint is that checkpoint's; the later ones go.
        let mut s = run(700, 9, 300);
        assert!(s.rewind(576));
        assert_eq!((value(&s), s.checkpoint_lens(576)), (576.0, vec![256]));
        assert!(s.rewind(256));
        assert_eq!(value(&s), 256.0);
        // Anywhere else: rolled back, for good.
        assert!(!s.rewind(200));
        assert!(s.layer(0).is_err() && s.checkpoint_lens(256).is_empty() && !s.rewind(256));
    }

    #[test]
    fn bytes_count_each_held_state_once() {
        let s = run(128, 128, 0);
        // The checkpoint at 128 is the state itself; the one at 64 is its own.
        assert_eq!(s.nbytes(128), 2 * 2 * 4);
    }
}
