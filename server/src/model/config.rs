//! Hyperparameters of the decoder-only transformers Tether runs.

/// The architectures the forward pass implements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Architecture {
    Llama,
    Qwen2,
}

impl Architecture {
    pub fn parse(name: &str) -> Option<Architecture> {
        match name {
            "llama" | "LlamaForCausalLM" | "MistralForCausalLM" => Some(Architecture::Llama),
            "qwen2" | "Qwen2ForCausalLM" => Some(Architecture::Qwen2),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Architecture::Llama => "llama",
            Architecture::Qwen2 => "qwen2",
        }
    }
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
    /// Rotate adjacent pairs (2i, 2i+1) rather than the two halves of a head.
    /// llama-arch GGUF files store Q/K rows permuted for this layout; HF
    /// checkpoints of the same models use the split-half layout.
    pub rope_traditional: bool,
    /// q/k/v projections carry biases (Qwen2).
    pub qkv_bias: bool,
    /// The output projection reuses the token embedding matrix.
    pub tied_embeddings: bool,
}

impl ModelConfig {
    /// Bytes of KV cache one token occupies across all layers at `elem_bytes` per value.
    pub fn kv_bytes_per_token(&self, elem_bytes: usize) -> usize {
        2 * self.n_layers * self.n_kv_heads * self.head_dim * elem_bytes
    }

    pub fn validate(&self) -> Result<(), String> {
        let checks = [
            (self.n_layers > 0, "block count is zero"),
            (self.n_heads > 0 && self.n_kv_heads > 0, "head count is zero"),
            (self.n_heads.is_multiple_of(self.n_kv_heads.max(1)), "query heads are not a multiple of KV heads"),
            (self.head_dim > 0 && self.head_dim.is_multiple_of(2), "head dimension must be even for RoPE"),
            (self.vocab_size > 0, "vocabulary is empty"),
            (self.rms_eps > 0.0, "RMS norm epsilon must be positive"),
        ];
        match checks.iter().find(|(ok, _)| !ok) {
            Some((_, why)) => Err(why.to_string()),
            None => Ok(()),
        }
    }
}
