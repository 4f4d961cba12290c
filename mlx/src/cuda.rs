//! Kernels of our own on a CUDA device (`mlx::core::fast::cuda_kernel`).
//!
//! A [`CudaKernel`] is a CUDA C++ function body and the names of its
//! parameters. MLX declares the `__global__` function around the body
//! (inputs as `const T*`, then outputs as `T*`, each in its array's dtype,
//! `__nv_bfloat16` for bfloat16; `<input>_shape` as a `Shape` where the
//! body names it), compiles it with NVRTC at its first launch on the GPU
//! (MLX keeps the PTX on disk, so a process compiles each variant once per
//! machine), and runs each launch as one graph node. Template arguments
//! become `constexpr` constants of the body, one compiled variant per set.
//! Nothing is compiled on a machine without CUDA: creating a kernel works
//! there, launching one fails.
use cxx::UniquePtr;

use crate::array::{make_list, unwrap_list};
use crate::ffi::bridge;
use crate::{Array, Dtype, Error, Result};

/// A compile-time constant of a kernel's body.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TemplateArg {
    /// `constexpr int NAME = value;`
    Int(i32),
    /// `constexpr bool NAME = value;`
    Bool(bool),
    /// `using NAME = <the dtype's CUDA type>;`
    Type(Dtype),
}

/// One launch's geometry, in threads as MLX's custom kernels count them:
/// `grid` threads in all per axis (a multiple of `block` per axis), in
/// blocks of `block` threads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Launch {
    pub grid: [usize; 3],
    pub block: [usize; 3],
}

impl Launch {
    /// `blocks` blocks of `threads` threads along x.
    pub fn blocks(blocks: usize, threads: usize) -> Launch {
        Launch { grid: [blocks * threads, 1, 1], block: [threads, 1, 1] }
    }
}

/// A CUDA kernel of our own (see the module notes).
pub struct CudaKernel {
    name: &'static str,
    raw: UniquePtr<bridge::CudaKernel>,
}

impl CudaKernel {
    /// `source`: the function body; `header`: code placed before the
    /// function (device helpers). `inputs` and `outputs` name the body's parameters.
    pub fn new(name: &'static str, inputs: &[&str], outputs: &[&str], source: &str, header: &str) -> Result<CudaKernel> {
        let raw =
            bridge::cuda_kernel_new(name, &inputs.join(","), &outputs.join(","), &compact(source), &compact(header)).map_err(|e| Error::from_cxx(name, e))?;
        Ok(CudaKernel { name, raw })
    }

    /// Queues one launch (lazy, like any op) and returns its outputs, each of
    /// the given shape and dtype.
    pub fn launch(&self, inputs: &[&Array], outputs: &[(&[usize], Dtype)], at: Launch, template: &[(&str, TemplateArg)]) -> Result<Vec<Array>> {
        let op = self.name;
        let to_i32 = |v: usize| i32::try_from(v).map_err(|_| Error::new(op, format!("{v} does not fit in i32")));
        let mut shapes = Vec::new();
        let mut ndims = Vec::with_capacity(outputs.len());
        for (shape, _) in outputs {
            ndims.push(to_i32(shape.len())?);
            for &d in *shape {
                shapes.push(to_i32(d)?);
            }
        }
        let dtypes: Vec<u8> = outputs.iter().map(|(_, d)| *d as u8).collect();
        let grid = at.grid.iter().map(|&v| to_i32(v)).collect::<Result<Vec<_>>>()?;
        let block = at.block.iter().map(|&v| to_i32(v)).collect::<Result<Vec<_>>>()?;
        let names: Vec<&str> = template.iter().map(|(n, _)| *n).collect();
        let (kinds, values): (Vec<u8>, Vec<i32>) = template
            .iter()
            .map(|(_, arg)| match *arg {
                TemplateArg::Int(v) => (0, v),
                TemplateArg::Bool(b) => (1, i32::from(b)),
                TemplateArg::Type(d) => (2, i32::from(d as u8)),
            })
            .unzip();
        let list = make_list(op, inputs)?;
        let out = bridge::cuda_kernel_launch(&self.raw, &list, &shapes, &ndims, &dtypes, &grid, &block, &names, &kinds, &values)
            .map_err(|e| Error::from_cxx(op, e))?;
        unwrap_list(op, &out)
    }
}

/// `source` without `//` comments, indentation or blank lines: MLX hashes a
/// kernel's whole source at every launch to find its compiled module, and
/// copies it into every launch's graph node. (No `//` may sit inside a
/// string literal of a kernel.)
fn compact(source: &str) -> String {
    let code = source.lines().map(|l| l.find("//").map_or(l, |at| &l[..at]).trim()).filter(|l| !l.is_empty());
    code.collect::<Vec<_>>().join("\n")
}

/// Whether MLX runs on CUDA here: a CUDA build of MLX and a device.
pub fn available() -> bool {
    bridge::cuda_available()
}

/// Whether `a` alone holds its evaluated buffer (no other handle, view or
/// pending op refers to it) as a dense row-major array, so a kernel may
/// write into it in place: MLX hands a kernel such an input as is.
pub fn sole_holder(a: &Array) -> bool {
    bridge::sole_holder(a.raw())
}

/// What evaluating `outputs` would run: one line per primitive kind,
/// `<count> <name>`, most frequent first, then `total <n>`.
pub fn graph_census(outputs: &[&Array]) -> Result<String> {
    let list = make_list("graph_census", outputs)?;
    Ok(bridge::graph_census(&list))
}

/// How many primitives evaluating `outputs` would run (the census's total).
pub fn primitive_count(outputs: &[&Array]) -> Result<usize> {
    let census = graph_census(outputs)?;
    census.lines().last().and_then(|l| l.strip_prefix("total ")).and_then(|n| n.parse().ok()).ok_or_else(|| Error::new("graph_census", "no total"))
}

#[cfg(test)]
mod tests {
    #[test]
    fn compact_source_keeps_code_lines_only() {
        let source = "// a kernel\n  int x = 1;  // why\n\n#pragma unroll\n  for (;;) {}\n";
        assert_eq!(super::compact(source), "int x = 1;\n#pragma unroll\nfor (;;) {}");
    }
}
