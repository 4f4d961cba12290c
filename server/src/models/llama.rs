//! Llama (and Mistral, and the decoder every other family here starts
//! from): RMS-normed pre-norm blocks, grouped-query attention with RoPE, a
//! SwiGLU MLP, no biases. Everything it runs is in `layers.rs`; what is
//! Llama's own is how its RoPE is read: the GGUF layout of its query/key
//! rows, and Llama 3.x's scaled RoPE.
use gguf::GgufFile;
use mlx::Array;
use serde_json::Value;

use super::config::ModelConfig;
use super::LoadError;

// ---- Args ----

/// Llama's settings in a GGUF file: llama.cpp's converter permutes Llama's
/// Q/K rows for adjacent-pair RoPE (qwen2 and the others keep the
/// split-half, NeoX layout, as do HF checkpoints of Llama itself).
pub(super) fn gguf_args(c: &mut ModelConfig) {
    c.rope_traditional = true;
}

/// Llama 3's RoPE scaling (`rope_scaling` with `rope_type: "llama3"`): the
/// slow-turning pairs (periods longer than the original context over
/// `low_freq_factor`) turn `factor` times slower, the fast ones (shorter than
/// the context over `high_freq_factor`) are kept, and those between blend
/// the two, so a model trained on `original_context` positions reaches
/// `factor` times as far.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Llama3RopeScaling {
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_context: f64,
}

impl Llama3RopeScaling {
    /// Each pair's rotation period (position / period = angle) for a head of
    /// `dims` rotated dimensions: `base^(2i / dims)`, scaled as above.
    pub fn periods(&self, base: f64, dims: usize) -> Vec<f32> {
        let (low_wavelength, high_wavelength) = (self.original_context / self.low_freq_factor, self.original_context / self.high_freq_factor);
        (0..dims / 2)
            .map(|i| {
                let inv = base.powf(-2.0 * i as f64 / dims as f64);
                let wavelength = 2.0 * std::f64::consts::PI / inv;
                let scaled = if wavelength < high_wavelength {
                    inv
                } else if wavelength > low_wavelength {
                    inv / self.factor
                } else {
                    let smooth = (self.original_context / wavelength - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor);
                    (1.0 - smooth) * inv / self.factor + smooth * inv
                };
                (1.0 / scaled) as f32
            })
            .collect()
    }
}

/// `rope_scaling` of a Hugging Face `config.json`: none, or Llama 3's;
/// other kinds are refused rather than run unscaled (which would be
/// silently wrong). Read for every family, so none runs a scaling it lacks.
pub(super) fn hf_rope_scaling(v: &Value) -> Result<Option<Llama3RopeScaling>, LoadError> {
    if v.is_null() {
        return Ok(None);
    }
    let kind = v["rope_type"].as_str().or_else(|| v["type"].as_str()).unwrap_or("");
    match kind {
        "default" => Ok(None),
        "llama3" => {
            let num = |k: &str, default: Option<f64>| {
                v[k].as_f64().or(default).ok_or_else(|| LoadError::Invalid(format!("config.json: rope_scaling.{k} is missing")))
            };
            Ok(Some(Llama3RopeScaling {
                factor: num("factor", None)?,
                low_freq_factor: num("low_freq_factor", Some(1.0))?,
                high_freq_factor: num("high_freq_factor", Some(4.0))?,
                original_context: num("original_max_position_embeddings", Some(8192.0))?,
            }))
        }
        other => Err(LoadError::Invalid(format!("config.json: rope_scaling type {other:?} is not supported (supported: llama3)"))),
    }
}

// ---- Attention ----

/// The per-pair RoPE periods `[head_dim / 2]` of a scaled RoPE, if the
/// model has one: Llama 3.x GGUFs carry their scaling as per-pair factors
/// of the base periods (`rope_freqs.weight`), HF checkpoints as
/// `rope_scaling` (read into `config.rope_scaling`).
pub(super) fn gguf_rope_periods(file: &GgufFile, c: &ModelConfig) -> Result<Option<Array>, LoadError> {
    let Some(t) = file.tensor("rope_freqs.weight") else { return Ok(None) };
    let hd = c.head_dim;
    if t.shape() != [hd / 2] {
        return Err(LoadError::Invalid(format!("tensor {} has shape {:?}, expected {:?}", t.name, t.shape(), [hd / 2])));
    }
    let factors = file.dequantize_f32(t)?;
    let periods: Vec<f32> = factors.iter().enumerate().map(|(i, f)| ((c.rope_theta as f64).powf(2.0 * i as f64 / hd as f64) * *f as f64) as f32).collect();
    Ok(Some(Array::from_f32(&periods, &[hd / 2])?))
}

/// [`gguf_rope_periods`] for an HF checkpoint.
pub(super) fn hf_rope_periods(c: &ModelConfig) -> mlx::Result<Option<Array>> {
    match c.rope_scaling {
        Some(s) => Ok(Some(Array::from_f32(&s.periods(c.rope_theta as f64, c.head_dim), &[c.head_dim / 2])?)),
        None => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_llama3_rope_scaling_is_read_and_others_are_refused() {
        assert_eq!(hf_rope_scaling(&Value::Null).unwrap(), None);
        assert_eq!(hf_rope_scaling(&serde_json::json!({"rope_type": "default"})).unwrap(), None);
        let llama3 = hf_rope_scaling(&serde_json::json!({"rope_type": "llama3", "factor": 8.0})).unwrap().unwrap();
        assert_eq!((llama3.factor, llama3.low_freq_factor, llama3.high_freq_factor, llama3.original_context), (8.0, 1.0, 4.0, 8192.0));
        assert!(hf_rope_scaling(&serde_json::json!({"type": "yarn", "factor": 4.0})).is_err());
        assert!(hf_rope_scaling(&serde_json::json!({"rope_type": "llama3"})).is_err(), "factor is required");
    }

    #[test]
    fn scaling_slows_the_slow_pairs_and_keeps_the_fast_ones() {
        let s = Llama3RopeScaling { factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0, original_context: 8192.0 };
        let (base, dims) = (500_000.0, 64);
        let periods = s.periods(base, dims);
        let unscaled = |i: usize| base.powf(2.0 * i as f64 / dims as f64) as f32;
        assert_eq!(periods[0], unscaled(0), "the fastest pair turns as before");
        let last = dims / 2 - 1;
        assert!((periods[last] / unscaled(last) - 8.0).abs() < 1e-3, "the slowest pair turns `factor` times slower");
    }
}
