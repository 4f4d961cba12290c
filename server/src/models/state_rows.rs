//! State rows: what a hybrid model's recurrent layers (Qwen3.5's Gated
//! DeltaNet) keep of a row's history, beside its attention layers' KV.
//!
//! A recurrent layer folds every token into a fixed-size state instead of
//! keeping one key and value per position: the last `kernel - 1` inputs of
//! its short causal convolution, and one `[key_dim, value_dim]` matrix per
//! value head. The state lives in the row's [`KvCache`](super::KvCache), so
//! it goes wherever the row's KV goes (a prefix-cache entry, a lent
//! history) and a clone shares it copy-on-write like the KV buffers.
//!
//! The key decision: a state holds one position only. KV can be cut back
//! to any earlier length; a state cannot be unwound, so a cache holding
//! one is *rolled back* the moment it is truncated below its length (a
//! rejected draft, a prefix hit shorter than the entry) and refuses to run
//! on from there: its row fails rather than continue from wrong state, and
//! the prefix cache never serves it (its earliest truncation is then
//! unreachable). The engine keeps drafts off for such rows and takes
//! prefix hits only at an entry's exact length. Snapshots per draft
//! position and checkpoints at block boundaries are what would lift both
//! limits (issue #53).
use mlx::Array;

/// One recurrent layer's state of one row.
#[derive(Clone)]
pub struct LayerState {
    /// `[kernel - 1, channels]`: the convolution's last inputs, oldest first.
    pub conv: Array,
    /// `[value_heads, key_dim, value_dim]`: the delta rule's memory.
    pub delta: Array,
}

/// Every recurrent layer's state of one row, at the cache's length.
#[derive(Clone)]
pub struct RecurrentState {
    /// Per recurrent layer (in layer order); `None` before its first token.
    layers: Vec<Option<LayerState>>,
    /// Set when the cache was cut back below where the state is: it no
    /// longer matches any length the cache holds.
    rolled_back: bool,
}

impl RecurrentState {
    /// The state of `layers` recurrent layers before any token.
    pub fn new(layers: usize) -> RecurrentState {
        RecurrentState { layers: vec![None; layers], rolled_back: false }
    }

    /// The same layers before any token.
    pub fn emptied(&self) -> RecurrentState {
        RecurrentState::new(self.layers.len())
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

    /// The cache was cut back: the state no longer matches it.
    pub fn roll_back(&mut self) {
        self.rolled_back = true;
    }

    pub fn is_rolled_back(&self) -> bool {
        self.rolled_back
    }

    /// The arrays a step wrote, to evaluate with it.
    pub fn buffers(&self) -> impl Iterator<Item = &Array> {
        self.layers.iter().flatten().flat_map(|s| [&s.conv, &s.delta])
    }

    /// Bytes held.
    pub fn nbytes(&self) -> usize {
        self.buffers().map(Array::nbytes).sum()
    }
}
