//! The parts every family's decoder is built from, written once: RoPE (at a
//! base, or by given per-pair periods), the attention block's projections
//! and norms, the gated MLP, and the pre-norm residual block that joins them.
//! A block's mixer is attention, or for a hybrid model's recurrent layers a
//! Gated DeltaNet (`qwen35.rs`).
//!
//! A family file (`llama.rs`, `qwen2.rs`, `qwen3.rs`, `gemma3.rs`) holds only
//! what its model does differently, and the loader sets those parts in
//! (qk-norm, post-norms, a window, the gate). What does not live here: how
//! a layer's queries meet the keys. That is the attention backend's job
//! (`attention.rs`), picked once at load, so a block only hands its
//! projected `qkv` to an `attend` closure and takes the heads' outputs back.
use std::rc::Rc;

use mlx::fast::{self, RopeTable};
use mlx::{Array, Dtype};

use super::gemma3;
use super::gemma4::{self, LayerTail};
use super::linear::Linear;
use super::qwen3::QkNorm;
use super::qwen35::DeltaNet;

/// Query and key/value head counts and the head size, as MLX's shapes want them.
#[derive(Clone, Copy, Debug)]
pub(super) struct Heads {
    pub q: i32,
    pub kv: i32,
    pub dim: i32,
}

impl Heads {
    /// Width of the fused q/k/v projection's output: `(q + 2 kv) dim`.
    pub fn qkv_width(self) -> i32 {
        (self.q + 2 * self.kv) * self.dim
    }
}

/// How a layer's RoPE turns, and over which pairs.
#[derive(Debug)]
pub struct Rope {
    pub freqs: RopeFreqs,
    /// Rotated dimensions, from a head's first: the whole head, or part of
    /// it (Qwen3.5).
    pub dims: i32,
    /// Rotate adjacent pairs (2i, 2i+1) rather than a head's two halves.
    pub traditional: bool,
}

/// A RoPE's rotation speeds.
#[derive(Debug)]
pub enum RopeFreqs {
    /// `base^(2i / dims)` periods.
    Base(f32),
    /// Given per-pair periods `[dims / 2]` (Llama 3.x's scaled RoPE).
    Periods(Array),
}

impl Rope {
    /// RoPE over whole heads from position `offset` on.
    pub fn apply(&self, a: &Array, offset: i32) -> mlx::Result<Array> {
        match &self.freqs {
            RopeFreqs::Base(theta) => fast::rope(a, self.dims, self.traditional, *theta, 1.0, offset),
            RopeFreqs::Periods(periods) => fast::rope_freqs(a, self.dims, self.traditional, 1.0, offset, periods),
        }
    }

    /// RoPE with one starting position per row of `a` (`offsets`: int32).
    pub fn apply_at(&self, a: &Array, offsets: &Array) -> mlx::Result<Array> {
        match &self.freqs {
            RopeFreqs::Base(theta) => fast::rope_offsets(a, self.dims, self.traditional, *theta, 1.0, offsets),
            RopeFreqs::Periods(periods) => fast::rope_offsets_freqs(a, self.dims, self.traditional, 1.0, offsets, periods),
        }
    }
}

/// The RoPE tables ([`RopeTable`]) of one step's row tokens, one per RoPE
/// its layers turn by (a model has one, or two when its window layers turn
/// at a base of their own), each built at its first layer: a few graph
/// nodes a step instead of MLX's RoPE in every layer (the CPU kernel's way).
pub(super) struct RopeTables {
    /// `[T]` int32: each row token's position.
    positions: Array,
    /// Layers share their model's `Rc<Rope>`s, so a pointer names a RoPE.
    built: Vec<(Rc<Rope>, Array)>,
}

impl RopeTables {
    pub fn new(positions: Array) -> RopeTables {
        RopeTables { positions, built: Vec::new() }
    }

    /// `rope`'s table, `[T, dims]`: MLX's RoPE of a unit head at every
    /// token's position.
    pub fn table(&mut self, rope: &Rc<Rope>) -> mlx::Result<RopeTable<'_>> {
        let at = match self.built.iter().position(|(r, _)| Rc::ptr_eq(r, rope)) {
            Some(at) => at,
            None => {
                let (dim, tokens) = (rope.dims as usize, self.positions.dim(0));
                // 1 at the first feature of each rotated pair, 0 at the second.
                let unit: Vec<f32> = (0..dim).map(|d| if rope.traditional { ((d + 1) % 2) as f32 } else { (d < dim / 2) as u8 as f32 }).collect();
                let heads = Array::from_f32(&unit, &[1, 1, 1, dim])?.broadcast_to(&[tokens as i32, 1, 1, dim as i32])?;
                let table = rope.apply_at(&heads, &self.positions)?.reshape(&[tokens as i32, dim as i32])?;
                self.built.push((rope.clone(), table));
                self.built.len() - 1
            }
        };
        Ok(RopeTable { table: &self.built[at].1, traditional: rope.traditional })
    }
}

/// One layer's attention block: its weights and how its heads are turned
/// and windowed. The attention itself is the backend's (see the module notes).
pub struct Attention {
    /// The RMS norm of the block's input.
    pub norm: Array,
    /// q, k and v stacked along the output axis: one matmul per layer
    /// (Qwen2's biases ride along in it).
    pub qkv: Linear,
    /// Per-head query/key norms before RoPE (Qwen3, Gemma 3).
    pub qk_norm: Option<QkNorm>,
    /// Ones `[head_dim]`: each head's values are RMS-normed too, without
    /// weights (Gemma 4).
    pub value_norm: Option<Array>,
    /// The KV layer (its index among the layers holding KV) whose keys and
    /// values this layer attends over instead of its own: it projects only
    /// queries (Gemma 4's KV-shared layers).
    pub kv_from: Option<usize>,
    pub out: Linear,
    /// The heads' outputs are multiplied by `sigmoid` of this projection
    /// of the normed input before `out` (Qwen3.5).
    pub gate: Option<Linear>,
    /// The norm of the block's output before it joins the residual (Gemma 3).
    pub post_norm: Option<Array>,
    /// Shared with the layers that turn alike (see [`RopeTables`]).
    pub rope: Rc<Rope>,
    /// How many positions a query sees, itself included (`None`: all before it).
    pub window: Option<usize>,
    pub(super) heads: Heads,
    pub(super) eps: f32,
}

impl Attention {
    /// The block's normed input projected to `[1, total, (hq + 2 hkv) hd]`,
    /// queries and keys normed head by head where the family does: done
    /// once, before the rows split into the backend's paths, so every path
    /// sees the same queries and keys.
    fn project(&self, h: &Array) -> mlx::Result<Array> {
        let qkv = self.qkv.forward_fused(h, Some((&self.norm, self.eps)), None)?;
        match (&self.qk_norm, &self.value_norm) {
            (Some(norm), Some(unit)) => gemma4::norm_heads(&qkv, norm, unit, self.heads, h.dim(1) as i32, self.eps),
            (Some(norm), None) => norm.apply(&qkv, self.heads, h.dim(1) as i32, self.eps),
            (None, _) => Ok(qkv),
        }
    }

    /// Its projections: q/k/v, attention out, and the output gate if any.
    fn linears(&self) -> impl Iterator<Item = &Linear> {
        [&self.qkv, &self.out].into_iter().chain(self.gate.as_ref())
    }

    /// `h + out(..)` of this block: `attend` turns the projected
    /// `[1, T, (hq + 2 hkv) hd]` into the heads' outputs `[1, T, hq hd]`.
    pub(super) fn forward(&self, h: &Array, attend: impl FnOnce(&Attention, &Array) -> mlx::Result<Array>) -> mlx::Result<Array> {
        let heads = attend(self, &self.project(h)?)?;
        let heads = match &self.gate {
            Some(gate) => heads.multiply(&gate.forward_fused(h, Some((&self.norm, self.eps)), None)?.sigmoid()?)?,
            None => heads,
        };
        residual(h, &self.out, &heads, self.post_norm.as_ref(), self.eps)
    }

    /// `[1, n, ..]` rows of the projection at positions `offset ..` split
    /// into queries, keys and values, `[1, heads, n, head_dim]`, the first two rotated.
    pub(super) fn rotated_heads(&self, qkv: &Array, offset: usize) -> mlx::Result<(Array, Array, Array)> {
        let Heads { q: hq, kv: hkv, dim: hd } = self.heads;
        let n = qkv.dim(1) as i32;
        let heads = |start: i32, count: i32| -> mlx::Result<Array> {
            qkv.slice(&[0, 0, start * hd], &[1, n, (start + count) * hd])?.reshape(&[1, n, count, hd])?.transpose(&[0, 2, 1, 3])
        };
        let rope = |a: &Array| self.rope.apply(a, offset as i32);
        Ok((rope(&heads(0, hq)?)?, rope(&heads(hq, hkv)?)?, heads(hq + hkv, hkv)?))
    }

    /// A KV-shared layer's `[1, n, hq hd]` queries at positions `offset ..`
    /// as `[1, hq, n, head_dim]`, rotated.
    pub(super) fn rotated_queries(&self, q: &Array, offset: usize) -> mlx::Result<Array> {
        let Heads { q: hq, dim: hd, .. } = self.heads;
        let heads = q.reshape(&[1, q.dim(1) as i32, hq, hd])?.transpose(&[0, 2, 1, 3])?;
        self.rope.apply(&heads, offset as i32)
    }

    /// The scale of the attention's scores, `1 / sqrt(head_dim)` (Gemma 3
    /// 27B's own scale is folded into its query norm at load).
    pub(super) fn scale(&self) -> f32 {
        1.0 / (self.heads.dim as f32).sqrt()
    }
}

/// The gate of the gated MLP, `act(gate) * up`, as this model runs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gate {
    /// SwiGLU on MLX's ops.
    SwiGlu,
    /// SwiGLU in one vectorised pass ([`fast::cpu_swiglu`]): on the CPU in
    /// float32, with the CPU's attention kernel.
    SwiGluCpu,
    /// GeGLU with GELU's tanh approximation (Gemma).
    GeGlu,
}

/// One layer's gated MLP block.
pub struct Mlp {
    /// The RMS norm of the block's input.
    pub norm: Array,
    /// gate and up stacked along the output axis.
    pub gate_up: Linear,
    pub down: Linear,
    /// The norm of the block's output before it joins the residual (Gemma 3).
    pub post_norm: Option<Array>,
    pub gate: Gate,
    pub(super) d_ff: i32,
    pub(super) eps: f32,
    pub(super) dtype: Dtype,
}

impl Mlp {
    /// `h + down(act(gate) * up)` of the normed `h`.
    pub(super) fn forward(&self, h: &Array) -> mlx::Result<Array> {
        let gate_up = self.gate_up.forward_fused(h, Some((&self.norm, self.eps)), None)?; // [1, total, 2 d_ff]
        let gated = match self.gate {
            Gate::SwiGluCpu => fast::cpu_swiglu(&gate_up)?,
            Gate::SwiGlu | Gate::GeGlu => {
                let (total, ff) = (h.dim(1) as i32, self.d_ff);
                let gate = gate_up.slice(&[0, 0, 0], &[1, total, ff])?;
                let up = gate_up.slice(&[0, 0, ff], &[1, total, 2 * ff])?;
                match self.gate {
                    Gate::GeGlu => gemma3::gelu_tanh(&gate, self.dtype)?.multiply(&up)?,
                    _ => gate.silu()?.multiply(&up)?,
                }
            }
        };
        residual(h, &self.down, &gated, self.post_norm.as_ref(), self.eps)
    }
}

/// What mixes a layer's positions: attention over the KV, or a recurrent
/// layer's state.
pub enum Mixer {
    Attention(Attention),
    /// A Gated DeltaNet layer (Qwen3.5), its state per row.
    DeltaNet(DeltaNet),
}

/// One decoder layer: the pre-norm mixer, then the pre-norm MLP, each
/// added to the residual stream.
pub struct Block {
    pub mixer: Mixer,
    pub mlp: Mlp,
    /// What the layer adds after its MLP (Gemma 4's per-layer input and
    /// output scale).
    pub tail: Option<LayerTail>,
}

impl Block {
    /// Its attention, unless the layer is a recurrent one.
    pub fn attention(&self) -> Option<&Attention> {
        match &self.mixer {
            Mixer::Attention(a) => Some(a),
            Mixer::DeltaNet(_) => None,
        }
    }

    /// The layer's projections: the mixer's (q/k/v, the gate, attention
    /// out; or the recurrent layer's in and out), then gate/up, down.
    pub fn linears(&self) -> Vec<&Linear> {
        let mut out: Vec<&Linear> = match &self.mixer {
            Mixer::Attention(a) => a.linears().collect(),
            Mixer::DeltaNet(d) => d.linears().into(),
        };
        out.extend([&self.mlp.gate_up, &self.mlp.down]);
        out.extend(self.tail.iter().flat_map(LayerTail::linears));
        out
    }

    pub(super) fn linears_mut(&mut self) -> Vec<&mut Linear> {
        let mut out: Vec<&mut Linear> = match &mut self.mixer {
            Mixer::Attention(a) => [&mut a.qkv, &mut a.out].into_iter().chain(a.gate.as_mut()).collect(),
            Mixer::DeltaNet(d) => d.linears_mut().into(),
        };
        out.extend([&mut self.mlp.gate_up, &mut self.mlp.down]);
        out.extend(self.tail.iter_mut().flat_map(LayerTail::linears_mut));
        out
    }

    /// Bytes held by this layer's weights.
    pub fn nbytes(&self) -> usize {
        let m = &self.mlp;
        let mlp = m.norm.nbytes() + m.post_norm.as_ref().map_or(0, Array::nbytes) + m.gate_up.nbytes() + m.down.nbytes();
        let mixer = match &self.mixer {
            Mixer::Attention(a) => {
                let qk = a.qk_norm.as_ref().map_or(0, |n| n.q.nbytes() + n.k.nbytes()) + a.value_norm.as_ref().map_or(0, Array::nbytes);
                let linears = a.linears().map(Linear::nbytes).sum::<usize>();
                qk + a.post_norm.as_ref().map_or(0, Array::nbytes) + a.norm.nbytes() + linears
            }
            Mixer::DeltaNet(d) => d.nbytes(),
        };
        mlp + mixer + self.tail.as_ref().map_or(0, LayerTail::nbytes)
    }
}

/// `h + post_norm(proj(x))`: the residual add rides in the projection's
/// node where no norm comes between (see [`Linear::forward_fused`]).
fn residual(h: &Array, proj: &Linear, x: &Array, post_norm: Option<&Array>, eps: f32) -> mlx::Result<Array> {
    match post_norm {
        None => proj.forward_fused(x, None, Some(h)),
        Some(w) => h.add(&fast::rms_norm(&proj.forward(x)?, w, eps)?),
    }
}
