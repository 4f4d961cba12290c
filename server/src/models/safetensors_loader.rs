//! Builds a [`Transformer`] from an HF-style directory: `config.json` plus one
//! or more `.safetensors` files. Dense checkpoints (any float dtype) and MLX
//! community quantized ones (`quantization: {group_size, bits}` in the config,
//! `.weight`/`.scales`/`.biases` per projection) both load.
use std::collections::HashMap;
use std::path::Path;

use mlx::{Array, Dtype, QuantizedWeights};
use serde_json::Value;

use super::config::{Activation, Architecture, ModelConfig};
use super::embedding::Embedding;
use super::linear::{Linear, Weight};
use super::qwen3::QkNorm;
use super::transformer::{LayerWeights, LoadedLayer, Transformer};
use super::LoadError;
use super::{gemma3, llama, qwen2, qwen3};

pub fn read_config(dir: &Path) -> Result<(ModelConfig, Option<(i32, i32)>), LoadError> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|e| LoadError::Io(path.display().to_string(), e))?;
    let v: Value = serde_json::from_str(&text).map_err(|e| LoadError::Invalid(format!("config.json: {e}")))?;
    let arch_name = v["architectures"].get(0).and_then(Value::as_str).or_else(|| v["model_type"].as_str()).unwrap_or("");
    let arch = Architecture::parse(arch_name).ok_or_else(|| LoadError::UnsupportedArchitecture(arch_name.to_string()))?;
    if arch == Architecture::Gemma3 {
        gemma3::hf_args()?;
    }
    let int = |k: &str| v[k].as_u64().map(|x| x as usize).ok_or_else(|| LoadError::Invalid(format!("config.json: missing {k}")));
    let d_model = int("hidden_size")?;
    let n_heads = int("num_attention_heads")?;
    let mut config = ModelConfig {
        arch,
        n_layers: int("num_hidden_layers")?,
        d_model,
        d_ff: int("intermediate_size")?,
        n_heads,
        n_kv_heads: int("num_key_value_heads").unwrap_or(n_heads),
        head_dim: int("head_dim").unwrap_or(d_model / n_heads.max(1)),
        vocab_size: int("vocab_size")?,
        context_length: int("max_position_embeddings").unwrap_or(4096),
        rms_eps: v["rms_norm_eps"].as_f64().unwrap_or(1e-6) as f32,
        rope_theta: v["rope_theta"].as_f64().unwrap_or(10000.0) as f32,
        rope_scaling: llama::hf_rope_scaling(&v["rope_scaling"])?,
        rope_traditional: false,
        qkv_bias: false,
        qk_norm: false,
        tied_embeddings: v["tie_word_embeddings"].as_bool().unwrap_or(false),
        embedding_scale: 1.0,
        activation: Activation::Silu,
        post_norms: false,
        sliding_window: None,
        rope_dims: None,
        hybrid: None,
        layer_plan: None,
    };
    // What each family sets beyond the fields every config names.
    match arch {
        Architecture::Qwen2 => qwen2::hf_args(&mut config),
        Architecture::Qwen3 => qwen3::hf_args(&mut config),
        Architecture::Llama | Architecture::Gemma3 => {}
        Architecture::Qwen35 => return Err(LoadError::Invalid("Qwen3.5 loads from its GGUF file; Hugging Face folders of it are not supported yet".into())),
        Architecture::Gemma4 => return Err(LoadError::Invalid("Gemma 4 loads from its GGUF file; Hugging Face folders of it are not supported yet".into())),
    }
    config.validate().map_err(LoadError::Invalid)?;
    let quant = v.get("quantization").map(|q| (q["group_size"].as_i64().unwrap_or(64) as i32, q["bits"].as_i64().unwrap_or(4) as i32));
    Ok((config, quant))
}

struct Tensors {
    map: HashMap<String, Array>,
    dtype: Dtype,
    quant: Option<(i32, i32)>,
}

impl Tensors {
    fn take(&mut self, name: &str) -> Result<Array, LoadError> {
        self.map.remove(name).ok_or_else(|| LoadError::MissingTensor(name.to_string()))
    }

    fn float(&mut self, name: &str) -> Result<Array, LoadError> {
        Ok(self.take(name)?.astype(self.dtype)?)
    }

    fn quantized(&mut self, prefix: &str) -> Result<Option<QuantizedWeights>, LoadError> {
        let Some((group_size, bits)) = self.quant else { return Ok(None) };
        // The CPU kernels' 5-bit codes are laid out their own way (see
        // mlx::pack_5bit_codes), not as MLX packs them: refuse, never misread.
        if bits == 5 && mlx::default_device() == mlx::Device::Cpu {
            return Err(LoadError::Invalid("MLX's 5-bit quantization has no CPU kernel here; use a 4- or 8-bit folder or the GGUF".into()));
        }
        if !self.map.contains_key(&format!("{prefix}.scales")) {
            return Ok(None);
        }
        Ok(Some(QuantizedWeights {
            packed: self.take(&format!("{prefix}.weight"))?,
            scales: self.float(&format!("{prefix}.scales"))?,
            biases: self.float(&format!("{prefix}.biases"))?,
            group_size,
            bits,
        }))
    }

    fn linear(&mut self, prefix: &str) -> Result<Linear, LoadError> {
        let weight = match self.quantized(prefix)? {
            Some(q) => Weight::Quantized(q),
            None => Weight::Dense(self.float(&format!("{prefix}.weight"))?),
        };
        let bias_name = format!("{prefix}.bias");
        let bias = if self.map.contains_key(&bias_name) { Some(self.float(&bias_name)?) } else { None };
        Ok(Linear { weight, bias })
    }
}

pub fn load(dir: &Path, dtype: Dtype) -> Result<Transformer, LoadError> {
    let (config, quant) = read_config(dir)?;
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .map_err(|e| LoadError::Io(dir.display().to_string(), e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(LoadError::Invalid(format!("no .safetensors files in {}", dir.display())));
    }
    let mut map = HashMap::new();
    for f in &files {
        let (tensors, _meta) = mlx::load_safetensors(f)?;
        map.extend(tensors);
    }
    let mut t = Tensors { map, dtype, quant };
    let embed_q = t.quantized("model.embed_tokens")?;
    let embedding = match &embed_q {
        Some(q) if Embedding::can_gather(q) => Embedding::Quantized(q.clone()),
        Some(q) => Embedding::Dense(mlx::dequantize(q, dtype)?),
        None => Embedding::Dense(t.float("model.embed_tokens.weight")?),
    };
    let mut layers = Vec::with_capacity(config.n_layers);
    for i in 0..config.n_layers {
        let p = format!("model.layers.{i}");
        let qkv = [t.linear(&format!("{p}.self_attn.q_proj"))?, t.linear(&format!("{p}.self_attn.k_proj"))?, t.linear(&format!("{p}.self_attn.v_proj"))?];
        let gate_up = [t.linear(&format!("{p}.mlp.gate_proj"))?, t.linear(&format!("{p}.mlp.up_proj"))?];
        let qk_norm = match config.qk_norm {
            true => Some(QkNorm { q: t.float(&format!("{p}.self_attn.q_norm.weight"))?, k: t.float(&format!("{p}.self_attn.k_norm.weight"))? }),
            false => None,
        };
        layers.push(LoadedLayer::Attention(LayerWeights {
            attn_gate: None,
            post_attn_norm: None,
            post_ffn_norm: None,
            qk_norm,
            attn_norm: t.float(&format!("{p}.input_layernorm.weight"))?,
            qkv: Linear::fuse(&qkv)?,
            attn_out: t.linear(&format!("{p}.self_attn.o_proj"))?,
            ffn_norm: t.float(&format!("{p}.post_attention_layernorm.weight"))?,
            gate_up: Linear::fuse(&gate_up)?,
            down: t.linear(&format!("{p}.mlp.down_proj"))?,
        }));
    }
    let final_norm = t.float("model.norm.weight")?;
    let lm_head = if config.tied_embeddings {
        // Keep the quantized table for the head: same bytes per token as the checkpoint.
        let weight = match (&embedding, embed_q) {
            (Embedding::Quantized(q), _) => Weight::Quantized(q.clone()),
            (Embedding::Dense(_), Some(q)) => Weight::Quantized(q),
            (Embedding::Dense(table), None) => Weight::Dense(table.clone()),
        };
        Linear { weight, bias: None }
    } else {
        t.linear("lm_head")?
    };
    if embedding.vocab() != config.vocab_size {
        return Err(LoadError::Invalid(format!("embedding has {} rows, config says vocab {}", embedding.vocab(), config.vocab_size)));
    }
    let rope_periods = llama::hf_rope_periods(&config)?;
    Ok(Transformer::assemble(config, dtype, embedding, layers, final_norm, lm_head, rope_periods))
}
