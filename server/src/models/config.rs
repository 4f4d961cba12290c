//! Hyperparameters of the decoder-only transformers Tether runs.

pub use super::gemma3::SlidingWindow;
pub use super::gemma4::LayerPlan;
pub use super::llama::Llama3RopeScaling;
pub use super::qwen35::Hybrid;

/// The architectures the forward pass implements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Architecture {
    Llama,
    Qwen2,
    /// Qwen3: RMS norms on each head's queries and keys before RoPE, no
    /// q/k/v biases, a head size of its own (not d_model / heads).
    Qwen3,
    /// Gemma 3: Qwen3's query/key norms, embeddings scaled by sqrt(d_model),
    /// norms after attention and after the MLP as well as before, GeGLU,
    /// and sliding-window layers interleaved with global ones.
    Gemma3,
    /// Qwen3.5: Gated DeltaNet (linear-attention) layers with a recurrent
    /// state per row, every few of them a full-attention layer whose output
    /// is gated per feature and whose RoPE turns only part of each head.
    Qwen35,
    /// Gemma 4: Gemma 3's blocks whose layers differ in head size, KV heads
    /// and MLP width by kind, the last ones reading earlier layers' KV,
    /// with per-layer inputs and capped logits (see `gemma4.rs`).
    Gemma4,
}

impl Architecture {
    pub fn parse(name: &str) -> Option<Architecture> {
        match name {
            "llama" | "LlamaForCausalLM" | "MistralForCausalLM" => Some(Architecture::Llama),
            "qwen2" | "Qwen2ForCausalLM" => Some(Architecture::Qwen2),
            "qwen3" | "Qwen3ForCausalLM" => Some(Architecture::Qwen3),
            "gemma3" | "gemma3_text" => Some(Architecture::Gemma3),
            "qwen35" => Some(Architecture::Qwen35),
            "gemma4" => Some(Architecture::Gemma4),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Architecture::Llama => "llama",
            Architecture::Qwen2 => "qwen2",
            Architecture::Qwen3 => "qwen3",
            Architecture::Gemma3 => "gemma3",
            Architecture::Qwen35 => "qwen35",
            Architecture::Gemma4 => "gemma4",
        }
    }

    /// Every architecture the forward pass implements, for error messages.
    pub const SUPPORTED: &'static str = "llama, qwen2, qwen3, gemma3, qwen35, gemma4";
}

/// The gate activation of the gated MLP: `act(gate) * up`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// SwiGLU (llama, qwen).
    Silu,
    /// GeGLU with GELU's tanh approximation (Gemma).
    GeluTanh,
}

#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub arch: Architecture,
    pub n_layers: usize,
    pub d_model: usize,
    pub d_ff: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub context_length: usize,
    pub rms_eps: f32,
    pub rope_theta: f32,
    /// Llama 3.x's RoPE scaling, when the checkpoint asks for it.
    pub rope_scaling: Option<Llama3RopeScaling>,
    /// Rotate adjacent pairs (2i, 2i+1) rather than the two halves of a head.
    /// llama-arch GGUF files store Q/K rows permuted for this layout; HF
    /// checkpoints of the same models use the split-half layout.
    pub rope_traditional: bool,
    /// q/k/v projections carry biases (Qwen2).
    pub qkv_bias: bool,
    /// Each head's queries and keys are RMS-normed before RoPE (Qwen3).
    pub qk_norm: bool,
    /// The output projection reuses the token embedding matrix.
    pub tied_embeddings: bool,
    /// Embeddings are multiplied by this before the first layer (Gemma: sqrt(d_model)).
    pub embedding_scale: f32,
    /// The MLP's gate activation.
    pub activation: Activation,
    /// Attention and MLP outputs are RMS-normed before they join the residual (Gemma).
    pub post_norms: bool,
    /// Sliding-window layers, if the model has them.
    pub sliding_window: Option<SlidingWindow>,
    /// Features of each head RoPE turns, from the first (`None`: all).
    pub rope_dims: Option<usize>,
    /// The recurrent layers of a hybrid model (Qwen3.5), if it has them.
    pub hybrid: Option<Hybrid>,
    /// Each layer's own sizes and KV source, where they differ (Gemma 4).
    pub layer_plan: Option<LayerPlan>,
}

impl ModelConfig {
    /// Bytes of KV cache one token occupies across all layers at `elem_bytes` per value.
    pub fn kv_bytes_per_token(&self, elem_bytes: usize) -> usize {
        2 * self.kv_shapes().iter().map(|(heads, dim)| heads * dim).sum::<usize>() * elem_bytes
    }

    /// Bytes of recurrent state one row holds, whatever its length (none
    /// without recurrent layers).
    pub fn state_bytes_per_row(&self, elem_bytes: usize) -> usize {
        self.hybrid.map_or(0, |h| self.recurrent_layers() * h.state_values() * elem_bytes)
    }

    /// Layers holding recurrent state (a hybrid model's).
    pub fn recurrent_layers(&self) -> usize {
        (0..self.n_layers).filter(|&l| self.is_recurrent(l)).count()
    }

    /// Whether layer `layer` keeps keys and values of its own: not a
    /// recurrent layer, nor one reading an earlier layer's (Gemma 4's KV-shared).
    pub fn holds_kv(&self, layer: usize) -> bool {
        !self.is_recurrent(layer) && self.layer_plan.as_ref().is_none_or(|p| p.layers[layer].kv_from.is_none())
    }

    /// Per layer holding KV, its (kv heads, head dim): what a row's cache holds.
    pub fn kv_shapes(&self) -> Vec<(usize, usize)> {
        let shape = |l: usize| match &self.layer_plan {
            Some(p) => (p.layers[l].kv_heads, p.layers[l].head_dim),
            None => (self.n_kv_heads, self.head_dim),
        };
        (0..self.n_layers).filter(|&l| self.holds_kv(l)).map(shape).collect()
    }

    /// Per layer, its index among the layers holding KV (`None`: it holds none).
    pub fn kv_indices(&self) -> Vec<Option<usize>> {
        let mut next = 0;
        (0..self.n_layers)
            .map(|l| {
                self.holds_kv(l).then(|| {
                    next += 1;
                    next - 1
                })
            })
            .collect()
    }

    /// Whether layer `layer` is a recurrent one (no KV: a state per row).
    pub fn is_recurrent(&self, layer: usize) -> bool {
        self.hybrid.is_some_and(|h| h.is_recurrent(layer))
    }

    /// Layers that keep keys and values (every one but the recurrent and
    /// KV-shared ones): a row's KV cache holds these, in order.
    pub fn kv_layers(&self) -> usize {
        (0..self.n_layers).filter(|&l| self.holds_kv(l)).count()
    }

    /// Layer `layer`'s attention window (`None`: the whole history).
    pub fn layer_window(&self, layer: usize) -> Option<usize> {
        self.sliding_window.filter(|w| w.is_local(layer)).map(|w| w.size)
    }

    /// Each KV layer's attention window.
    pub fn layer_windows(&self) -> Vec<Option<usize>> {
        (0..self.n_layers).filter(|&l| self.holds_kv(l)).map(|l| self.layer_window(l)).collect()
    }

    pub fn validate(&self) -> Result<(), String> {
        let checks = [
            (self.n_layers > 0, "block count is zero"),
            (self.kv_layers() > 0, "no layer attends"),
            (self.n_heads > 0 && self.n_kv_heads > 0, "head count is zero"),
            (self.n_heads.is_multiple_of(self.n_kv_heads.max(1)), "query heads are not a multiple of KV heads"),
            (self.head_dim > 0 && self.head_dim.is_multiple_of(2), "head dimension must be even for RoPE"),
            (self.rope_dims.is_none_or(|d| d > 0 && d <= self.head_dim && d.is_multiple_of(2)), "RoPE dimension count must be even and within the head"),
            (self.hybrid.is_none_or(|h| h.validate()), "recurrent layers' sizes do not fit together"),
            (self.vocab_size > 0, "vocabulary is empty"),
            (self.rms_eps > 0.0, "RMS norm epsilon must be positive"),
            (self.sliding_window.is_none_or(|w| w.size > 0 && w.global_every > 0), "sliding window or its layer pattern is zero"),
            (
                self.layer_plan.as_ref().is_none_or(|p| p.validate(self.n_layers, |l| self.layer_window(l).is_some())),
                "per-layer sizes or KV sources do not fit together",
            ),
        ];
        match checks.iter().find(|(ok, _)| !ok) {
            Some((_, why)) => Err(why.to_string()),
            None => Ok(()),
        }
    }
}
