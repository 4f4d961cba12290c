//! Builds a [`Transformer`] from a GGUF file (llama, qwen2, qwen3, gemma3, qwen35 and gemma4 architectures).
use gguf::{GgufFile, TensorInfo};
use mlx::Dtype;

use super::config::{Activation, Architecture, ModelConfig};
use super::embedding::Embedding;
use super::linear::{Linear, Weight};
use super::qwen3::QkNorm;
use super::transformer::{LayerWeights, LoadedLayer, Transformer};
use super::weights::{affine_to_mlx, dense, five_bit_codes_here, WeightFormat};
use super::LoadError;
use super::{gemma3, gemma4, llama, qwen35};

/// Reads the hyperparameters under the file's `general.architecture` prefix.
pub fn read_config(file: &GgufFile) -> Result<ModelConfig, LoadError> {
    let arch_name = file.architecture().ok_or_else(|| LoadError::Invalid("missing general.architecture".into()))?;
    let arch = Architecture::parse(arch_name).ok_or_else(|| LoadError::UnsupportedArchitecture(arch_name.to_string()))?;
    let key = |suffix: &str| format!("{arch_name}.{suffix}");
    // A value some families give per layer (Gemma 4's head and MLP
    // widths) reads as its first here; the family reads the rest.
    let int = |suffix: &str| -> Result<usize, LoadError> {
        let first = || file.get_array(&key(suffix))?.first()?.as_u64();
        file.get_u64(&key(suffix)).or_else(first).map(|v| v as usize).ok_or_else(|| LoadError::Invalid(format!("missing {}", key(suffix))))
    };
    let d_model = int("embedding_length")?;
    let n_heads = int("attention.head_count")?;
    let n_kv_heads = int("attention.head_count_kv").unwrap_or(n_heads);
    let embedding = tensor(file, "token_embd.weight")?;
    let head_dim = file.get_u64(&key("attention.key_length")).map(|v| v as usize).unwrap_or(d_model / n_heads.max(1));
    let mut config = ModelConfig {
        arch,
        n_layers: int("block_count")?,
        d_model,
        d_ff: int("feed_forward_length")?,
        n_heads,
        n_kv_heads,
        head_dim,
        vocab_size: embedding.shape()[0],
        context_length: int("context_length")?,
        rms_eps: file.get_f32(&key("attention.layer_norm_rms_epsilon")).unwrap_or(1e-6),
        rope_theta: file.get_f32(&key("rope.freq_base")).unwrap_or(10000.0),
        // Llama 3.x GGUFs carry their scaling as per-pair factors instead
        // (`rope_freqs.weight`, read by `load`).
        rope_scaling: None,
        rope_traditional: false,
        qkv_bias: file.tensor("blk.0.attn_q.bias").is_some(),
        qk_norm: file.tensor("blk.0.attn_q_norm.weight").is_some(),
        tied_embeddings: file.tensor("output.weight").is_none(),
        embedding_scale: 1.0,
        activation: Activation::Silu,
        post_norms: false,
        sliding_window: None,
        rope_dims: None,
        hybrid: None,
        layer_plan: None,
    };
    // What each family sets beyond the fields every file names.
    match arch {
        Architecture::Llama => llama::gguf_args(&mut config),
        Architecture::Gemma3 => gemma3::gguf_args(file, arch_name, &mut config)?,
        Architecture::Qwen35 => qwen35::gguf_args(file, arch_name, &mut config)?,
        Architecture::Gemma4 => gemma4::gguf_args(file, arch_name, &mut config)?,
        Architecture::Qwen2 | Architecture::Qwen3 => {}
    }
    config.validate().map_err(LoadError::Invalid)?;
    Ok(config)
}

fn tensor<'a>(file: &'a GgufFile, name: &str) -> Result<&'a TensorInfo, LoadError> {
    file.tensor(name).ok_or_else(|| LoadError::MissingTensor(name.to_string()))
}

/// Reads a file's tensors into the model's dtype and weight form.
pub(super) struct Loader<'a> {
    file: &'a GgufFile,
    dtype: Dtype,
    format: WeightFormat,
    /// Whether 5-bit codes stay 5 bits wide (else they are stored as 8).
    five_bit: bool,
}

impl Loader<'_> {
    pub(super) fn dtype(&self) -> Dtype {
        self.dtype
    }

    /// Projections that share an input as one (see [`fuse_or_dense`]).
    pub(super) fn fuse(&self, parts: &[Linear], names: &[&str]) -> Result<Linear, LoadError> {
        fuse_or_dense(self, parts.to_vec(), names)
    }

    /// Whether the file holds tensor `name`.
    pub(super) fn has(&self, name: &str) -> bool {
        self.file.tensor(name).is_some()
    }

    /// A table of `rows` rows gathered by token: in its quantized form
    /// when rows can be gathered from it, else dense.
    pub(super) fn embedding(&self, name: &str, rows: usize, cols: usize) -> Result<Embedding, LoadError> {
        let t = tensor(self.file, name)?;
        check_shape(t, &[rows, cols])?;
        Ok(match self.quantized(t, rows, cols)?.filter(Embedding::can_gather) {
            Some(q) => Embedding::Quantized(q),
            None => Embedding::Dense(self.dense(name, &[rows, cols])?),
        })
    }

    pub(super) fn dense(&self, name: &str, expect: &[usize]) -> Result<mlx::Array, LoadError> {
        let t = tensor(self.file, name)?;
        check_shape(t, expect)?;
        let data = self.file.dequantize_f32(t)?;
        Ok(dense(&data, &t.shape(), self.dtype)?)
    }

    pub(super) fn linear(&self, name: &str, out: usize, inp: usize) -> Result<Linear, LoadError> {
        let t = tensor(self.file, &format!("{name}.weight"))?;
        check_shape(t, &[out, inp])?;
        let weight = match self.quantized(t, out, inp)? {
            Some(q) => Weight::Quantized(q),
            None => Weight::Dense(self.dense(&format!("{name}.weight"), &[out, inp])?),
        };
        let bias_name = format!("{name}.bias");
        let bias = match self.file.tensor(&bias_name) {
            Some(_) => Some(self.dense(&bias_name, &[out])?),
            None => None,
        };
        Ok(Linear { weight, bias })
    }

    fn quantized(&self, t: &TensorInfo, out: usize, inp: usize) -> Result<Option<mlx::QuantizedWeights>, LoadError> {
        if self.format != WeightFormat::Quantized {
            return Ok(None);
        }
        let Some(aq) = self.file.affine(t)? else { return Ok(None) };
        Ok(affine_to_mlx(out, inp, &aq, self.dtype, self.five_bit)?)
    }
}

fn check_shape(t: &TensorInfo, expect: &[usize]) -> Result<(), LoadError> {
    if t.shape() != expect {
        return Err(LoadError::Invalid(format!("tensor {} has shape {:?}, expected {:?}", t.name, t.shape(), expect)));
    }
    Ok(())
}

/// Loads the whole model onto the default device.
pub fn load(file: &GgufFile, dtype: Dtype, format: WeightFormat) -> Result<Transformer, LoadError> {
    let config = read_config(file)?;
    let c = &config;
    let loader = Loader { file, dtype, format, five_bit: five_bit_codes_here() && dtype == Dtype::F32 };
    let (d, ff, hd) = (c.d_model, c.d_ff, c.head_dim);
    // The table stays in its quantized form when rows can be gathered from
    // it (the tied head then reads the same arrays).
    let embed_t = tensor(file, "token_embd.weight")?;
    let embedding = loader.embedding("token_embd.weight", c.vocab_size, d)?;
    let query_scale = gemma3::query_norm_scale(c);
    let rope_periods = llama::gguf_rope_periods(file, c)?;
    let gemma4_ropes = (c.arch == Architecture::Gemma4).then(|| gemma4::Ropes::new(c, rope_periods.clone()));
    let kv_index = c.kv_indices();
    let mut layers = Vec::with_capacity(c.n_layers);
    for i in 0..c.n_layers {
        let family_layer = match &gemma4_ropes {
            Some(ropes) => Some(LoadedLayer::Built(Box::new(gemma4::gguf_layer(&loader, c, i, ropes, &kv_index)?))),
            None if c.arch == Architecture::Qwen35 => Some(qwen35::gguf_layer(&loader, c, i)?),
            None => None,
        };
        if let Some(layer) = family_layer {
            layers.push(layer);
            mlx::eval(&linear_arrays(&layers.last().expect("just pushed").linears()))?;
            continue;
        }
        let p = format!("blk.{i}");
        let q = loader.linear(&format!("{p}.attn_q"), c.n_heads * hd, d)?;
        let k = loader.linear(&format!("{p}.attn_k"), c.n_kv_heads * hd, d)?;
        let v = loader.linear(&format!("{p}.attn_v"), c.n_kv_heads * hd, d)?;
        let gate = loader.linear(&format!("{p}.ffn_gate"), ff, d)?;
        let up = loader.linear(&format!("{p}.ffn_up"), ff, d)?;
        let qk_norm = match c.qk_norm {
            true => {
                let q = loader.dense(&format!("{p}.attn_q_norm.weight"), &[hd])?;
                let q = if query_scale != 1.0 { q.multiply(&mlx::Array::scalar(query_scale, dtype)?)? } else { q };
                Some(QkNorm { q, k: loader.dense(&format!("{p}.attn_k_norm.weight"), &[hd])? })
            }
            false => None,
        };
        let post_norm = |name: &str| -> Result<Option<mlx::Array>, LoadError> {
            if !c.post_norms {
                return Ok(None);
            }
            Ok(Some(loader.dense(&format!("{p}.{name}.weight"), &[d])?))
        };
        layers.push(LoadedLayer::Attention(LayerWeights {
            attn_gate: None,
            post_attn_norm: post_norm("post_attention_norm")?,
            post_ffn_norm: post_norm("post_ffw_norm")?,
            qk_norm,
            attn_norm: loader.dense(&format!("{p}.attn_norm.weight"), &[d])?,
            qkv: fuse_or_dense(&loader, vec![q, k, v], &[&format!("{p}.attn_q"), &format!("{p}.attn_k"), &format!("{p}.attn_v")])?,
            attn_out: loader.linear(&format!("{p}.attn_output"), d, c.n_heads * hd)?,
            ffn_norm: loader.dense(&format!("{p}.ffn_norm.weight"), &[d])?,
            gate_up: fuse_or_dense(&loader, vec![gate, up], &[&format!("{p}.ffn_gate"), &format!("{p}.ffn_up")])?,
            down: loader.linear(&format!("{p}.ffn_down"), d, ff)?,
        }));
        // Materialise layer by layer so host copies are freed as we go.
        mlx::eval(&linear_arrays(&layers.last().expect("just pushed").linears()))?;
    }
    let final_norm = loader.dense("output_norm.weight", &[d])?;
    let lm_head = if c.tied_embeddings {
        // The head reads the (smaller) quantized form of the table when it
        // is exact, even where the gathers need the dense one.
        let weight = match &embedding {
            Embedding::Quantized(q) => Weight::Quantized(q.clone()),
            Embedding::Dense(table) => match loader.quantized(embed_t, c.vocab_size, d)? {
                Some(q) => Weight::Quantized(q),
                None => Weight::Dense(table.clone()),
            },
        };
        Linear { weight, bias: None }
    } else {
        loader.linear("output", c.vocab_size, d)?
    };
    let per_layer_input = gemma4::gguf_per_layer_input(&loader, c)?;
    let mut t = Transformer::assemble(config, dtype, embedding, layers, final_norm, lm_head, rope_periods);
    t.per_layer_input = per_layer_input;
    mlx::eval(&t.embedding.arrays().into_iter().chain([&t.final_norm]).collect::<Vec<_>>())?;
    Ok(t)
}

/// Fuses projections that share an input. When the parts came out quantized
/// at different widths (Q5_0 next to Q8_0), they are reloaded with 5-bit
/// codes as 8-bit ones; when some came out quantized and others dense (e.g.
/// Q4_K next to Q6_K), all are reloaded dense.
fn fuse_or_dense(loader: &Loader<'_>, parts: Vec<Linear>, names: &[&str]) -> Result<Linear, LoadError> {
    let all_quantized = parts.iter().all(|p| matches!(p.weight, Weight::Quantized(_)));
    let all_same = parts.iter().all(|p| matches!(p.weight, Weight::Dense(_))) || all_quantized;
    if all_same {
        if let Ok(fused) = Linear::fuse(&parts) {
            return Ok(fused);
        }
    }
    let reload = |with: &Loader<'_>| -> Result<Vec<Linear>, LoadError> {
        names
            .iter()
            .map(|n| {
                let t = tensor(loader.file, &format!("{n}.weight"))?;
                let [out, inp] = t.shape()[..] else { return Err(LoadError::Invalid(format!("{n} is not a matrix"))) };
                with.linear(n, out, inp)
            })
            .collect()
    };
    if all_quantized && loader.five_bit {
        let eight_bit = Loader { five_bit: false, ..*loader };
        if let Ok(fused) = Linear::fuse(&reload(&eight_bit)?) {
            return Ok(fused);
        }
    }
    let dense_loader = Loader { format: WeightFormat::Dense, ..*loader };
    Ok(Linear::fuse(&reload(&dense_loader)?)?)
}

fn linear_arrays<'a>(ls: &[&'a Linear]) -> Vec<&'a mlx::Array> {
    let mut out = Vec::new();
    for l in ls {
        match &l.weight {
            Weight::Dense(w) | Weight::Panels { panels: w, .. } => out.push(w),
            Weight::Quantized(q) => out.extend([&q.packed, &q.scales, &q.biases]),
        }
        out.extend(l.bias.as_ref());
    }
    out
}
