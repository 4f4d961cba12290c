//! A projection `y = x W^T (+ b)` whose weight is stored dense or in MLX's
//! affine quantized form.
use mlx::{Array, QuantizedWeights};

/// Rows beyond which a CPU product expands the weights once for BLAS instead
/// of streaming them through the decode kernel in chunks.
const CPU_KERNEL_MAX_ROWS: usize = 128;

/// Whether `x @ W^T` goes through the CPU's decode kernel in one call.
fn on_cpu_kernel(x: &Array, q: &QuantizedWeights) -> bool {
    let rows = x.size() / x.dim(-1).max(1);
    mlx::default_device() == mlx::Device::Cpu
        && q.scales.dtype() == mlx::Dtype::F32
        && x.dtype() == mlx::Dtype::F32
        && rows <= mlx::cpu_quantized_matmul_max_rows().min(CPU_KERNEL_MAX_ROWS)
}

/// `x @ W^T` for quantized `W`, by the fastest route for the device and
/// the number of activation rows.
fn quantized_product(x: &Array, q: &QuantizedWeights) -> mlx::Result<Array> {
    if mlx::default_device() == mlx::Device::Gpu {
        return mlx::quantized_matmul(x, q);
    }
    let in_features = x.dim(-1);
    let rows = x.size() / in_features.max(1);
    if rows > CPU_KERNEL_MAX_ROWS || q.scales.dtype() != mlx::Dtype::F32 {
        // Prefill: compute-bound, so expand once (float32 scales on every
        // core) and let BLAS do the GEMM.
        let w = match q.scales.dtype() {
            mlx::Dtype::F32 if x.dtype() == mlx::Dtype::F32 => mlx::cpu_dequantize(q)?,
            mlx::Dtype::F32 => mlx::cpu_dequantize(q)?.astype(x.dtype())?,
            _ => mlx::dequantize(q, x.dtype())?,
        };
        return dense_product(x, &w);
    }
    // Decode (and batched decode): memory-bound; the kernel reads each
    // quantized row once per chunk of up to `max_rows` activation rows.
    let chunk = mlx::cpu_quantized_matmul_max_rows();
    if rows <= chunk {
        return mlx::cpu_quantized_matmul(x, q);
    }
    let flat = x.reshape(&[rows as i32, in_features as i32])?;
    let parts = (0..rows)
        .step_by(chunk)
        .map(|s| mlx::cpu_quantized_matmul(&flat.slice(&[s as i32, 0], &[(s + chunk).min(rows) as i32, in_features as i32])?, q))
        .collect::<mlx::Result<Vec<_>>>()?;
    let mut shape: Vec<i32> = x.shape().iter().map(|&d| d as i32).collect();
    *shape.last_mut().expect("x has an axis") = -1;
    mlx::concatenate(&parts.iter().collect::<Vec<_>>(), 0)?.reshape(&shape)
}

/// `x @ W^T` for dense `W` (on a CPU with the panel kernel, float32 weights
/// are held as [`Weight::Panels`] instead and never come here).
fn dense_product(x: &Array, w: &Array) -> mlx::Result<Array> {
    // A transposed view: MLX hands BLAS the transpose flag, no copy.
    x.matmul(&w.transpose(&[1, 0])?)
}

#[derive(Clone, Debug)]
pub enum Weight {
    /// `[out, in]`, in the model's compute dtype.
    Dense(Array),
    /// `[out, in]` packed along `in`.
    Quantized(QuantizedWeights),
    /// A dense float32 `[out, in]` laid out once for the CPU's panel kernel
    /// (`[ceil(out / 48), in, 48]`, see `mlx::cpu_panel_matmul`): every
    /// product, one row or a prefill chunk, reads it in order. BLAS would
    /// copy (pack) the whole weight at every call, which with a few dozen
    /// rows costs as much as the product.
    Panels { panels: Array, out_features: usize },
}

#[derive(Clone, Debug)]
pub struct Linear {
    pub weight: Weight,
    pub bias: Option<Array>,
}

impl Linear {
    pub fn forward(&self, x: &Array) -> mlx::Result<Array> {
        let y = match &self.weight {
            Weight::Dense(w) => dense_product(x, w)?,
            Weight::Quantized(q) => quantized_product(x, q)?,
            Weight::Panels { panels, out_features } => mlx::cpu_panel_matmul(x, panels, *out_features)?,
        };
        match &self.bias {
            Some(b) => y.add(b),
            None => Ok(y),
        }
    }

    /// `residual + self(rms_norm(x))`, each part only where given (`norm`:
    /// the norm's weight and eps). On the CPU's quantized decode kernel the
    /// norm, the bias and the add ride in the product's own graph node (a
    /// decode step builds a few hundred nodes, each costing host time);
    /// elsewhere they are MLX's ops. The values are the same either way.
    pub fn forward_fused(&self, x: &Array, norm: Option<(&Array, f32)>, residual: Option<&Array>) -> mlx::Result<Array> {
        if let Weight::Quantized(q) = &self.weight {
            let f32_or_none = |a: Option<&Array>| a.is_none_or(|a| a.dtype() == mlx::Dtype::F32);
            if on_cpu_kernel(x, q) && f32_or_none(norm.map(|(w, _)| w)) && f32_or_none(self.bias.as_ref()) && f32_or_none(residual) {
                return mlx::cpu_quantized_matmul_fused(x, q, mlx::QmmFusion { norm, bias: self.bias.as_ref(), residual });
            }
        }
        let normed = match norm {
            Some((w, eps)) => Some(mlx::fast::rms_norm(x, w, eps)?),
            None => None,
        };
        let y = self.forward(normed.as_ref().unwrap_or(x))?;
        match residual {
            Some(r) => r.add(&y),
            None => Ok(y),
        }
    }

    /// Rows of the output dimension.
    pub fn out_features(&self) -> usize {
        match &self.weight {
            Weight::Dense(w) => w.dim(0),
            Weight::Quantized(q) => q.packed.dim(0),
            Weight::Panels { out_features, .. } => *out_features,
        }
    }

    pub fn nbytes(&self) -> usize {
        let w = match &self.weight {
            Weight::Dense(w) => w.nbytes(),
            Weight::Quantized(q) => q.packed.nbytes() + q.scales.nbytes() + q.biases.nbytes(),
            Weight::Panels { panels, .. } => panels.nbytes(),
        };
        w + self.bias.as_ref().map_or(0, Array::nbytes)
    }

    /// Lays the weight out for the CPU's panel kernel (evaluated) when it is
    /// dense float32 and this CPU runs the kernel; else leaves it as it is.
    pub fn lay_out_for_cpu(&mut self) -> mlx::Result<()> {
        let Weight::Dense(w) = &self.weight else { return Ok(()) };
        if w.dtype() != mlx::Dtype::F32 || !mlx::cpu_panels_supported() {
            return Ok(());
        }
        let out_features = w.dim(0);
        let panels = mlx::cpu_pack_panels(w)?;
        panels.eval()?;
        self.weight = Weight::Panels { panels, out_features };
        Ok(())
    }

    /// Stacks projections that read the same input into one (along `out`),
    /// so q/k/v or gate/up run as one matmul. All parts must share a form.
    pub fn fuse(parts: &[Linear]) -> mlx::Result<Linear> {
        let weight = match &parts[0].weight {
            Weight::Dense(_) => {
                let ws: Vec<&Array> = parts
                    .iter()
                    .filter_map(|p| match &p.weight {
                        Weight::Dense(w) => Some(w),
                        _ => None,
                    })
                    .collect();
                if ws.len() != parts.len() {
                    return Err(mlx::Error { op: "fuse", message: "mixed dense and quantized parts".into() });
                }
                Weight::Dense(mlx::concatenate(&ws, 0)?)
            }
            Weight::Quantized(first) => {
                let qs: Vec<&QuantizedWeights> = parts
                    .iter()
                    .filter_map(|p| match &p.weight {
                        Weight::Quantized(q) => Some(q),
                        _ => None,
                    })
                    .collect();
                if qs.len() != parts.len() || qs.iter().any(|q| q.bits != first.bits || q.group_size != first.group_size) {
                    return Err(mlx::Error { op: "fuse", message: "parts differ in quantization".into() });
                }
                let cat = |f: fn(&QuantizedWeights) -> &Array| mlx::concatenate(&qs.iter().map(|q| f(q)).collect::<Vec<_>>(), 0);
                Weight::Quantized(QuantizedWeights {
                    packed: cat(|q| &q.packed)?,
                    scales: cat(|q| &q.scales)?,
                    biases: cat(|q| &q.biases)?,
                    group_size: first.group_size,
                    bits: first.bits,
                })
            }
            Weight::Panels { .. } => return Err(mlx::Error { op: "fuse", message: "projections are fused before they are laid out in panels".into() }),
        };
        let bias = if parts.iter().all(|p| p.bias.is_some()) {
            Some(mlx::concatenate(&parts.iter().filter_map(|p| p.bias.as_ref()).collect::<Vec<_>>(), 0)?)
        } else if parts.iter().any(|p| p.bias.is_some()) {
            return Err(mlx::Error { op: "fuse", message: "only some parts have a bias".into() });
        } else {
            None
        };
        Ok(Linear { weight, bias })
    }
}
