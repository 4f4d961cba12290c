//! The safe `Array` handle and the ops the engine needs.
use cxx::UniquePtr;

use crate::ffi::bridge;
use crate::{Dtype, Error, Result};

/// An MLX array: a lazily evaluated, reference-counted, immutable tensor.
/// Cloning shares the underlying buffer (no copy). Not `Send`: see the crate docs.
pub struct Array {
    ptr: UniquePtr<bridge::Array>,
}

pub(crate) fn wrap(op: &'static str, r: std::result::Result<UniquePtr<bridge::Array>, cxx::Exception>) -> Result<Array> {
    match r {
        Ok(ptr) if !ptr.is_null() => Ok(Array { ptr }),
        Ok(_) => Err(Error::new(op, "returned a null array")),
        Err(e) => Err(Error::from_cxx(op, e)),
    }
}

pub(crate) fn unwrap_list(op: &'static str, list: &bridge::ArrayList) -> Result<Vec<Array>> {
    (0..bridge::list_len(list)).map(|i| wrap(op, bridge::list_get(list, i))).collect()
}

pub(crate) fn make_list(op: &'static str, arrays: &[&Array]) -> Result<UniquePtr<bridge::ArrayList>> {
    let mut list = bridge::list_new().map_err(|e| Error::from_cxx(op, e))?;
    for a in arrays {
        bridge::list_push(list.pin_mut(), a.raw()).map_err(|e| Error::from_cxx(op, e))?;
    }
    Ok(list)
}

fn shape_i32(op: &'static str, shape: &[usize]) -> Result<Vec<i32>> {
    shape.iter().map(|&d| i32::try_from(d).map_err(|_| Error::new(op, format!("dimension {d} too large")))).collect()
}

impl Clone for Array {
    fn clone(&self) -> Self {
        // Copying an mlx::core::array only bumps a reference count; it cannot fail
        // short of allocation failure, which aborts anyway.
        wrap("clone", bridge::clone_array(self.raw())).expect("cloning an MLX array handle")
    }
}

impl std::fmt::Debug for Array {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Array({:?}, {:?})", self.shape(), self.dtype())
    }
}

macro_rules! binary_ops {
    ($($(#[$doc:meta])* $name:ident => $op:literal),* $(,)?) => {
        $( $(#[$doc])* pub fn $name(&self, other: &Array) -> Result<Array> {
            wrap($op, bridge::binary(self.raw(), other.raw(), $op))
        } )*
    };
}

macro_rules! unary_ops {
    ($($name:ident => $op:literal),* $(,)?) => {
        $( pub fn $name(&self) -> Result<Array> { wrap($op, bridge::unary(self.raw(), $op)) } )*
    };
}

macro_rules! reductions {
    ($($name:ident => $op:literal),* $(,)?) => {
        $( pub fn $name(&self, axes: &[i32], keepdims: bool) -> Result<Array> {
            wrap($op, bridge::reduce(self.raw(), axes, keepdims, $op))
        } )*
    };
}

impl Array {
    pub(crate) fn raw(&self) -> &bridge::Array {
        // `wrap` never stores a null pointer.
        self.ptr.as_ref().expect("non-null by construction")
    }

    // ---- creation
    pub fn from_f32(data: &[f32], shape: &[usize]) -> Result<Array> {
        wrap("from_f32", bridge::from_f32(data, &shape_i32("from_f32", shape)?))
    }
    pub fn from_i32(data: &[i32], shape: &[usize]) -> Result<Array> {
        wrap("from_i32", bridge::from_i32(data, &shape_i32("from_i32", shape)?))
    }
    pub fn from_u32(data: &[u32], shape: &[usize]) -> Result<Array> {
        wrap("from_u32", bridge::from_u32(data, &shape_i32("from_u32", shape)?))
    }
    pub fn from_bool(data: &[bool], shape: &[usize]) -> Result<Array> {
        wrap("from_bool", bridge::from_bool(data, &shape_i32("from_bool", shape)?))
    }
    /// Builds a 16-bit float array (F16 or BF16) from raw bit patterns.
    pub fn from_f16_bits(data: &[u16], shape: &[usize], dtype: Dtype) -> Result<Array> {
        wrap("from_f16_bits", bridge::from_u16_bits(data, &shape_i32("from_f16_bits", shape)?, dtype as u8))
    }
    /// An array of `shape` and `dtype` from its raw bytes, row-contiguous
    /// in `dtype`'s own encoding (what [`to_bytes`](Self::to_bytes) gives): a copy.
    pub fn from_bytes(data: &[u8], shape: &[usize], dtype: Dtype) -> Result<Array> {
        wrap("from_bytes", bridge::from_raw_bytes(data, &shape_i32("from_bytes", shape)?, dtype as u8))
    }
    /// A 0-d array.
    pub fn scalar(v: f32, dtype: Dtype) -> Result<Array> {
        wrap("scalar", bridge::scalar_f32(v, dtype as u8))
    }
    pub fn zeros(shape: &[usize], dtype: Dtype) -> Result<Array> {
        wrap("zeros", bridge::zeros(&shape_i32("zeros", shape)?, dtype as u8))
    }
    pub fn full(shape: &[usize], v: f32, dtype: Dtype) -> Result<Array> {
        wrap("full", bridge::full(&shape_i32("full", shape)?, v, dtype as u8))
    }
    pub fn arange(start: f64, stop: f64, step: f64, dtype: Dtype) -> Result<Array> {
        wrap("arange", bridge::arange(start, stop, step, dtype as u8))
    }

    // ---- inspection
    pub fn shape(&self) -> Vec<usize> {
        bridge::shape(self.raw()).into_iter().map(|d| d as usize).collect()
    }
    /// Size of axis `axis` (negative counts from the end).
    pub fn dim(&self, axis: isize) -> usize {
        let s = self.shape();
        let i = if axis < 0 { s.len() as isize + axis } else { axis };
        s[i as usize]
    }
    pub fn ndim(&self) -> usize {
        self.shape().len()
    }
    pub fn size(&self) -> usize {
        self.shape().iter().product()
    }
    pub fn dtype(&self) -> Dtype {
        Dtype::from_code(bridge::dtype(self.raw()))
    }
    pub fn nbytes(&self) -> usize {
        bridge::nbytes(self.raw())
    }
    pub fn astype(&self, dtype: Dtype) -> Result<Array> {
        wrap("astype", bridge::astype(self.raw(), dtype as u8))
    }
    /// The same bytes read as `dtype`: the last axis scales by the ratio of
    /// the sizes (four uint8 become one float32). A reinterpretation, not a
    /// conversion (that is [`astype`](Self::astype)).
    pub fn view_as(&self, dtype: Dtype) -> Result<Array> {
        wrap("view_as", bridge::view_as(self.raw(), dtype as u8))
    }

    // ---- evaluation and readback
    pub fn eval(&self) -> Result<()> {
        bridge::eval_one(self.raw()).map_err(|e| Error::from_cxx("eval", e))
    }
    pub fn to_vec_f32(&self) -> Result<Vec<f32>> {
        bridge::to_f32_vec(self.raw()).map_err(|e| Error::from_cxx("to_vec_f32", e))
    }
    pub fn to_vec_i32(&self) -> Result<Vec<i32>> {
        bridge::to_i32_vec(self.raw()).map_err(|e| Error::from_cxx("to_vec_i32", e))
    }
    pub fn to_vec_u32(&self) -> Result<Vec<u32>> {
        bridge::to_u32_vec(self.raw()).map_err(|e| Error::from_cxx("to_vec_u32", e))
    }
    /// The array's raw bytes, row-contiguous, in its own dtype (evaluates it).
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let mut out = vec![0u8; self.nbytes()];
        bridge::copy_raw_bytes(self.raw(), &mut out).map_err(|e| Error::from_cxx("to_bytes", e))?;
        Ok(out)
    }
    /// Copies the array's raw bytes, row-contiguous, in its own dtype, into
    /// `out`, which must be exactly [`nbytes`](Self::nbytes) long (evaluates it).
    pub fn copy_bytes_into(&self, out: &mut [u8]) -> Result<()> {
        bridge::copy_raw_bytes(self.raw(), out).map_err(|e| Error::from_cxx("copy_bytes_into", e))
    }
    /// The single value of a one-element array.
    pub fn item_f32(&self) -> Result<f32> {
        let v = self.to_vec_f32()?;
        v.first().copied().filter(|_| v.len() == 1).ok_or_else(|| Error::new("item", format!("array has {} elements", v.len())))
    }

    // ---- elementwise (broadcasting)
    binary_ops! {
        add => "add", subtract => "subtract", multiply => "multiply", divide => "divide",
        maximum => "maximum", minimum => "minimum",
        greater => "greater", greater_equal => "greater_equal", less => "less",
        less_equal => "less_equal", equal => "equal",
        logical_and => "logical_and", logical_or => "logical_or",
        right_shift => "right_shift", bitwise_and => "bitwise_and",
    }
    unary_ops! {
        exp => "exp", log => "log", negative => "negative", sqrt => "sqrt", rsqrt => "rsqrt",
        abs => "abs", sigmoid => "sigmoid", tanh => "tanh", square => "square",
        logical_not => "logical_not", round => "round",
    }
    reductions! { sum => "sum", max => "max", min => "min", mean => "mean", logsumexp => "logsumexp" }

    /// `x * sigmoid(x)`, the SwiGLU gate activation.
    pub fn silu(&self) -> Result<Array> {
        self.multiply(&self.sigmoid()?)
    }
    pub fn softmax(&self, axis: i32, precise: bool) -> Result<Array> {
        wrap("softmax", bridge::softmax(self.raw(), axis, precise))
    }
    pub fn argmax(&self, axis: i32, keepdims: bool) -> Result<Array> {
        wrap("argmax", bridge::argmax(self.raw(), axis, keepdims))
    }
    pub fn argsort(&self, axis: i32) -> Result<Array> {
        wrap("argsort", bridge::argsort(self.raw(), axis))
    }
    pub fn sort(&self, axis: i32) -> Result<Array> {
        wrap("sort", bridge::sort(self.raw(), axis))
    }
    /// The `k` largest values along `axis` (unordered).
    pub fn topk(&self, k: i32, axis: i32) -> Result<Array> {
        wrap("topk", bridge::topk(self.raw(), k, axis))
    }
    pub fn argpartition(&self, kth: i32, axis: i32) -> Result<Array> {
        wrap("argpartition", bridge::argpartition(self.raw(), kth, axis))
    }
    pub fn cumsum(&self, axis: i32, reverse: bool, inclusive: bool) -> Result<Array> {
        wrap("cumsum", bridge::cumsum(self.raw(), axis, reverse, inclusive))
    }
    pub fn matmul(&self, other: &Array) -> Result<Array> {
        wrap("matmul", bridge::matmul(self.raw(), other.raw()))
    }

    // ---- shape and indexing
    /// `-1` in `shape` infers that dimension.
    pub fn reshape(&self, shape: &[i32]) -> Result<Array> {
        wrap("reshape", bridge::reshape(self.raw(), shape))
    }
    pub fn transpose(&self, axes: &[i32]) -> Result<Array> {
        wrap("transpose", bridge::transpose(self.raw(), axes))
    }
    pub fn expand_dims(&self, axis: i32) -> Result<Array> {
        wrap("expand_dims", bridge::expand_dims(self.raw(), axis))
    }
    pub fn squeeze(&self, axis: i32) -> Result<Array> {
        wrap("squeeze", bridge::squeeze(self.raw(), axis))
    }
    pub fn broadcast_to(&self, shape: &[i32]) -> Result<Array> {
        wrap("broadcast_to", bridge::broadcast_to(self.raw(), shape))
    }
    /// `self[start[0]..stop[0], start[1]..stop[1], ...]` over all axes.
    pub fn slice(&self, start: &[i32], stop: &[i32]) -> Result<Array> {
        let strides = vec![1; start.len()];
        wrap("slice", bridge::slice(self.raw(), start, stop, &strides))
    }
    /// A slice whose start is an int32 array (no graph rebuild per offset).
    pub fn slice_dynamic(&self, start: &Array, axes: &[i32], sizes: &[i32]) -> Result<Array> {
        wrap("slice_dynamic", bridge::slice_dynamic(self.raw(), start.raw(), axes, sizes))
    }
    /// A copy of `self` with `update` written at `start..stop`. MLX reuses
    /// `self`'s buffer in place when nothing else holds it.
    pub fn slice_update(&self, update: &Array, start: &[i32], stop: &[i32]) -> Result<Array> {
        wrap("slice_update", bridge::slice_update(self.raw(), update.raw(), start, stop))
    }
    pub fn slice_update_dynamic(&self, update: &Array, start: &Array, axes: &[i32]) -> Result<Array> {
        wrap("slice_update_dynamic", bridge::slice_update_dynamic(self.raw(), update.raw(), start.raw(), axes))
    }
    /// Gathers entries of `indices` along `axis` (e.g. embedding rows).
    pub fn take(&self, indices: &Array, axis: i32) -> Result<Array> {
        wrap("take", bridge::take(self.raw(), indices.raw(), axis))
    }
    pub fn take_along_axis(&self, indices: &Array, axis: i32) -> Result<Array> {
        wrap("take_along_axis", bridge::take_along_axis(self.raw(), indices.raw(), axis))
    }
    pub fn put_along_axis(&self, indices: &Array, values: &Array, axis: i32) -> Result<Array> {
        wrap("put_along_axis", bridge::put_along_axis(self.raw(), indices.raw(), values.raw(), axis))
    }
    /// A row-contiguous copy (or `self` if already so).
    pub fn contiguous(&self) -> Result<Array> {
        wrap("contiguous", bridge::contiguous(self.raw()))
    }
}

/// Evaluates all `arrays` together (one graph walk, shared subgraphs once).
pub fn eval(arrays: &[&Array]) -> Result<()> {
    let list = make_list("eval", arrays)?;
    bridge::eval_list(&list).map_err(|e| Error::from_cxx("eval", e))
}

/// Evaluates `arrays`, then cuts each from the graph that computed it, so
/// it keeps only its own data: an evaluated array otherwise holds its
/// inputs while it lives (a copy of a slice would keep the whole buffer
/// it was sliced from).
pub fn eval_detached(arrays: &[&Array]) -> Result<()> {
    eval(arrays)?;
    arrays.iter().try_for_each(|a| bridge::detach(a.raw()).map_err(|e| Error::from_cxx("detach", e)))
}

/// Starts evaluating `arrays` without waiting; a later `eval` or readback waits.
pub fn async_eval(arrays: &[&Array]) -> Result<()> {
    let list = make_list("async_eval", arrays)?;
    bridge::async_eval_list(&list).map_err(|e| Error::from_cxx("async_eval", e))
}

pub fn concatenate(arrays: &[&Array], axis: i32) -> Result<Array> {
    let list = make_list("concatenate", arrays)?;
    wrap("concatenate", bridge::concatenate(&list, axis))
}

pub fn stack(arrays: &[&Array], axis: i32) -> Result<Array> {
    let list = make_list("stack", arrays)?;
    wrap("stack", bridge::stack(&list, axis))
}

/// Elementwise `cond ? a : b`.
pub fn where_(cond: &Array, a: &Array, b: &Array) -> Result<Array> {
    wrap("where", bridge::where_(cond.raw(), a.raw(), b.raw()))
}

/// A matrix in MLX's affine quantized form: each group of `group_size`
/// consecutive values along a row is `scale * code + bias`, codes packed
/// little-endian into uint32 words.
#[derive(Clone, Debug)]
pub struct QuantizedWeights {
    pub packed: Array,
    pub scales: Array,
    pub biases: Array,
    pub group_size: i32,
    pub bits: i32,
}

/// Quantizes the last axis of `w` with MLX's affine scheme.
pub fn quantize(w: &Array, group_size: i32, bits: i32) -> Result<QuantizedWeights> {
    let list = bridge::quantize(w.raw(), group_size, bits).map_err(|e| Error::from_cxx("quantize", e))?;
    let mut parts = unwrap_list("quantize", &list)?.into_iter();
    match (parts.next(), parts.next(), parts.next()) {
        (Some(packed), Some(scales), Some(biases)) => Ok(QuantizedWeights { packed, scales, biases, group_size, bits }),
        _ => Err(Error::new("quantize", "expected packed weights, scales and biases")),
    }
}

pub fn dequantize(q: &QuantizedWeights, dtype: Dtype) -> Result<Array> {
    wrap("dequantize", bridge::dequantize(q.packed.raw(), q.scales.raw(), q.biases.raw(), q.group_size, q.bits, dtype as u8))
}

/// [`dequantize`] to float32 on the CPU, rows split over all cores (MLX's own
/// runs on one thread); the same values bit for bit. Needs float32 scales
/// and biases and 4, 5 ([`pack_5bit_codes`]) or 8 bits.
pub fn cpu_dequantize(q: &QuantizedWeights) -> Result<Array> {
    wrap("cpu_dequantize", bridge::cpu_dequantize(q.packed.raw(), q.scales.raw(), q.biases.raw(), q.group_size, q.bits))
}

/// `x @ w^T` for a quantized `w` of shape `[out, in]` (as nn.Linear stores it).
pub fn quantized_matmul(x: &Array, q: &QuantizedWeights) -> Result<Array> {
    wrap("quantized_matmul", bridge::quantized_matmul(x.raw(), q.packed.raw(), q.scales.raw(), q.biases.raw(), true, q.group_size, q.bits))
}

/// The CPU decode kernel for affine-quantized weights (4, 5 or 8 bits, float32
/// activations, scales and biases): reads each quantized row once and expands
/// it in registers, where MLX's own CPU kernel is compute-bound. Handles at
/// most [`cpu_quantized_matmul_max_rows`] rows of `x`.
pub fn cpu_quantized_matmul(x: &Array, q: &QuantizedWeights) -> Result<Array> {
    wrap("cpu_quantized_matmul", bridge::cpu_quantized_matmul(x.raw(), q.packed.raw(), q.scales.raw(), q.biases.raw(), q.group_size, q.bits))
}

/// What [`cpu_quantized_matmul_fused`] folds around the product.
#[derive(Clone, Copy, Default)]
pub struct QmmFusion<'a> {
    /// RMS-normalise `x` first (weight `[K]`, eps), as
    /// [`fast::rms_norm`](crate::fast::rms_norm) would.
    pub norm: Option<(&'a Array, f32)>,
    /// Add the projection's bias (`[N]`) to the product,
    pub bias: Option<&'a Array>,
    /// then this residual (the output's shape).
    pub residual: Option<&'a Array>,
}

/// [`cpu_quantized_matmul`] with what surrounds it in a decoder layer folded
/// into the same graph node (see [`QmmFusion`]): the same values as the
/// separate ops, one node instead of up to four.
pub fn cpu_quantized_matmul_fused(x: &Array, q: &QuantizedWeights, fusion: QmmFusion<'_>) -> Result<Array> {
    let op = "cpu_quantized_matmul_fused";
    let norm = make_list(op, &fusion.norm.iter().map(|(w, _)| *w).collect::<Vec<_>>())?;
    let bias = make_list(op, &fusion.bias.into_iter().collect::<Vec<_>>())?;
    let residual = make_list(op, &fusion.residual.into_iter().collect::<Vec<_>>())?;
    let eps = fusion.norm.map_or(0.0, |(_, e)| e);
    wrap(op, bridge::cpu_quantized_matmul_fused(x.raw(), q.packed.raw(), q.scales.raw(), q.biases.raw(), q.group_size, q.bits, &norm, eps, &bias, &residual))
}

/// Tether's 5-bit codes for the CPU kernels (MLX has no 5-bit form they
/// read): `codes` is `[rows, cols]`, each below 32, `cols` a multiple of 64;
/// groups must be 32 wide. Each step of 64 codes becomes 40 bytes: 32 bytes
/// of low nibbles (code `2i` of the step in the low nibble of byte `i`,
/// `2i + 1` in the high one), then the fifth bits, bit `i` of the next 64
/// for code `2i` and bit `32 + i` for code `2i + 1`. Returns the words of
/// the `[rows, cols * 5 / 32]` uint32 array, or `None` for another shape.
pub fn pack_5bit_codes(codes: &[u8], cols: usize) -> Option<Vec<u32>> {
    if cols == 0 || !cols.is_multiple_of(64) || !codes.len().is_multiple_of(cols) || codes.iter().any(|&c| c >= 32) {
        return None;
    }
    let mut bytes = Vec::with_capacity(codes.len() * 5 / 8);
    for step in codes.chunks_exact(64) {
        bytes.extend(step.chunks_exact(2).map(|pair| (pair[0] & 0xF) | ((pair[1] & 0xF) << 4)));
        let fifth = step.iter().enumerate().fold(0u64, |acc, (r, &c)| acc | (u64::from(c >> 4) << ((r & 1) * 32 + r / 2)));
        bytes.extend(fifth.to_le_bytes());
    }
    Some(bytes.chunks_exact(4).map(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]])).collect())
}

/// Whether [`cpu_quantized_matmul`] reads 5-bit codes at speed on this CPU
/// (it needs AVX-512 VNNI); elsewhere store them as 8-bit ones.
pub fn cpu_five_bit_codes_fast() -> bool {
    bridge::cpu_five_bit_codes_fast()
}

/// Rows of activations [`cpu_quantized_matmul`] accepts in one call.
pub fn cpu_quantized_matmul_max_rows() -> usize {
    bridge::cpu_quantized_matmul_max_rows() as usize
}

/// `w` (`[out, in]`, float32) laid out in panels for [`cpu_panel_matmul`]:
/// `[ceil(out / 48), in, 48]`, panel `p` holding rows `48 p..` transposed.
/// Lazy; evaluate it once at load.
pub fn cpu_pack_panels(w: &Array) -> Result<Array> {
    wrap("cpu_pack_panels", bridge::cpu_pack_panels(w.raw()))
}

/// `x @ w^T` on the CPU for `w` packed by [`cpu_pack_panels`] (`out_features`
/// is `w`'s row count), any number of rows of `x`: a register-blocked
/// micro-kernel reading the panels in order (BLAS would pack `w` again at
/// every call). Each row's result is the same alone or in a batch.
pub fn cpu_panel_matmul(x: &Array, panels: &Array, out_features: usize) -> Result<Array> {
    let n = i32::try_from(out_features).map_err(|_| Error::new("cpu_panel_matmul", "too many outputs"))?;
    wrap("cpu_panel_matmul", bridge::cpu_panel_matmul(x.raw(), panels.raw(), n))
}

/// Whether this CPU runs [`cpu_panel_matmul`] (it needs AVX-512).
pub fn cpu_panels_supported() -> bool {
    bridge::cpu_panels_supported()
}

/// The instruction sets the CPU kernels use: `avx512vnni`, `avx512`,
/// `avx2` or `portable`, what the CPU has lowered by `TETHER_CPU_ISA`.
pub fn cpu_isa() -> String {
    bridge::cpu_isa_level()
}
