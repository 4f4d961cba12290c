//! Safe Rust binding of MLX's C++ API, the tensor engine under Tether.
//!
//! This crate holds all of Tether's unsafe-adjacent code: the cxx bridge in
//! `ffi.rs` and the C++ adapters in `shim.cc`. Its invariants:
//! - Every C++ call that can throw is declared `Result` in the bridge, so cxx
//!   catches the exception and we return [`Error`]; nothing unwinds into Rust.
//! - An [`Array`] is MLX's reference-counted handle. It is neither `Send` nor
//!   `Sync` (cxx opaque types are not), which keeps all MLX graph building on
//!   the thread that owns the engine: MLX's graph construction and its
//!   per-thread streams are not thread-safe.
//! - Arrays are immutable values. Ops build a lazy graph; [`eval`] runs it.
//!   Reading back (`to_vec_*`) evaluates first.
mod ffi;

mod array;
pub mod cuda;
mod dtype;
mod error;
pub mod fast;
pub mod memory;
pub mod random;
mod safetensors;

pub use array::{
    async_eval, concatenate, cpu_dequantize, cpu_five_bit_codes_fast, cpu_isa, cpu_pack_panels, cpu_panel_matmul, cpu_panels_supported, cpu_quantized_matmul,
    cpu_quantized_matmul_fused, cpu_quantized_matmul_max_rows, dequantize, eval, eval_detached, pack_5bit_codes, quantize, quantized_matmul, stack, where_,
    Array, QmmFusion, QuantizedWeights,
};
pub use dtype::Dtype;
pub use error::{Error, Result};
pub use safetensors::load_safetensors;

/// MLX CUDA settings that suit a server, applied where the environment does
/// not set them already. MLX reads them once, at the first GPU work, so call
/// this first thing in `main`, before any thread is started (changing the
/// environment while another thread reads it is a data race).
///
/// - `MLX_USE_CUDA_GRAPHS=0`: MLX records work into CUDA graphs and reuses
///   an instantiated graph only when the next one has the same structure and
///   can be updated in place. A serving step's structure changes with its
///   rows, and quantized matmuls over several rows launch cluster kernels
///   that make graphs non-updatable, so every commit re-instantiates: on an
///   NVIDIA H200, 8 batched streams of SmolLM2 took 403 ms a step with graphs
///   and 27 ms without (bench/results/gpu-h200-profile.jsonl).
/// - `MLX_CUDA_USE_CUDNN_SDPA=0`: cuDNN's attention builds a graph for
///   every new query/key shape it meets, and each new prompt, prompt chunk or
///   draft count is a new shape; MLX's own kernels take any shape as is.
/// - `MLX_PTX_CACHE_DIR=~/.cache/tether/mlx-ptx`: where MLX keeps the
///   kernels NVRTC compiled (Tether's fused decode kernels among them, about
///   1.5 s each), so a restarted server loads them instead (MLX's default is
///   under the temporary directory).
pub fn apply_cuda_server_defaults() {
    let ptx = std::env::var_os("HOME").map(|h| std::path::PathBuf::from(h).join(".cache/tether/mlx-ptx"));
    let ptx = ptx.map(|p| p.to_string_lossy().into_owned());
    let defaults = [("MLX_USE_CUDA_GRAPHS", Some("0".to_string())), ("MLX_CUDA_USE_CUDNN_SDPA", Some("0".to_string())), ("MLX_PTX_CACHE_DIR", ptx)];
    for (name, value) in defaults {
        if let (None, Some(value)) = (std::env::var_os(name), value) {
            std::env::set_var(name, value);
        }
    }
}

/// Which device MLX runs new work on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    Cpu,
    Gpu,
}

/// Makes `device` the default for all following ops on this thread.
pub fn set_default_device(device: Device) -> Result<()> {
    ffi::bridge::set_default_device(device == Device::Gpu).map_err(|e| Error::from_cxx("set_default_device", e))
}

/// Whether this MLX build has a usable GPU backend (Metal or CUDA).
pub fn gpu_available() -> bool {
    ffi::bridge::gpu_available()
}

/// The device new ops run on.
pub fn default_device() -> Device {
    if ffi::bridge::default_device_name() == "gpu" {
        Device::Gpu
    } else {
        Device::Cpu
    }
}

/// Waits until all queued work on the default stream has finished.
pub fn synchronize() -> Result<()> {
    ffi::bridge::synchronize().map_err(|e| Error::from_cxx("synchronize", e))
}

/// Runs `f` when the process exits normally, before MLX tears down its
/// global state. Threads that own MLX arrays must be stopped by then (a
/// thread still using MLX while its statics are destroyed corrupts the heap).
/// Call after MLX has been used at least once in the process.
pub fn call_at_exit(f: fn()) {
    ffi::bridge::call_at_exit(f)
}
