//! Model architectures, their weights and loaders.
//!
//! A model on disk is either a GGUF file or an HF-style safetensors folder;
//! both load into the same [`Transformer`]. Its layers are written once
//! (`layers.rs`); each family file (`llama.rs`, `qwen2.rs`, `qwen3.rs`,
//! `gemma3.rs`, `qwen35.rs`, `gemma4.rs`) holds only what that family does differently, and the
//! loaders build each model's blocks with its family's parts. How rows
//! attend (the CPU's kernel, MLX's attention, batched slots) is
//! `attention.rs`, its backend picked once at load.
mod attention;
mod batch_step;
mod config;
mod embedding;
mod gemma3;
mod gemma4;
mod gguf_loader;
pub mod gpu;
mod kv;
mod kv_batch;
mod kv_cache;
mod kv_codes;
pub mod kv_file;
mod layers;
mod linear;
mod llama;
mod qwen2;
mod qwen3;
mod qwen35;
mod safetensors_loader;
mod slot_lease;
mod state_rows;
mod transformer;
mod weights;

use std::path::Path;

pub use attention::AttentionBackend;
pub use batch_step::{alone_queries, queries_per_slot, BatchedRows, ALONE_QUERIES_MULTIPLE, GATHERED_ROWS_MULTIPLE, SHARED_ATTENTION_SCORES, SMALL_QUERIES};
pub use config::{Activation, Architecture, ModelConfig, SlidingWindow};
pub use embedding::Embedding;
pub use kv::{Kv, LayerKv, RowKv};
pub use kv_batch::{capacity_class, capacity_classes, KvBatch};
pub use kv_cache::{KvCache, KvQuantization, StoredCache, CAPACITY_STEP as KV_CAPACITY_STEP};
/// The old name of a decoder layer (now a [`Block`] of an [`Attention`] and an [`Mlp`]).
pub use layers::Block as Layer;
pub use layers::{Attention, Block, Gate, Mixer, Mlp, Rope, RopeFreqs};
pub use linear::{Linear, Weight};
pub use qwen3::QkNorm;
pub use qwen35::{DeltaNet, Hybrid};
pub use slot_lease::{SharedKvBatch, SlotLease};
pub use state_rows::{LayerState, RecurrentState, CHECKPOINT_INTERVAL, MAX_STATES};
pub use transformer::{RowInput, StepLogits, Transformer};
pub use weights::WeightFormat;

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("cannot read {0}: {1}")]
    Io(String, #[source] std::io::Error),
    #[error(transparent)]
    Gguf(#[from] gguf::GgufError),
    #[error("unsupported architecture {0:?} (supported: {supported})", supported = config::Architecture::SUPPORTED)]
    UnsupportedArchitecture(String),
    #[error("model is missing tensor {0}")]
    MissingTensor(String),
    #[error("invalid model: {0}")]
    Invalid(String),
    /// A model of a supported architecture using a part Tether does not run yet.
    #[error("{0}: not supported yet")]
    Unsupported(String),
    #[error("building weights on the device failed: {0}")]
    Mlx(#[from] mlx::Error),
}

/// What a loaded model runs with.
#[derive(Clone, Copy, Debug)]
pub struct LoadOptions {
    /// Activations, KV cache and dense weights.
    pub dtype: mlx::Dtype,
    pub weights: WeightFormat,
}

impl LoadOptions {
    /// float32 on CPU, bfloat16 on a GPU; quantized blocks with an exact
    /// affine form stay quantized on both (decode reads fewer bytes; on CPU
    /// through Tether's own decode kernel, see `mlx::cpu_quantized_matmul`).
    pub fn for_device(device: mlx::Device) -> LoadOptions {
        match device {
            mlx::Device::Cpu => LoadOptions { dtype: mlx::Dtype::F32, weights: WeightFormat::Quantized },
            mlx::Device::Gpu => LoadOptions { dtype: mlx::Dtype::BF16, weights: WeightFormat::Quantized },
        }
    }
}

/// Whether `TETHER_TRACE_STEPS=1` asks for traces on stderr (see
/// [`crate::engine::tracing`], which is this). Read once.
pub fn tracing() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("TETHER_TRACE_STEPS").is_ok_and(|v| v == "1"))
}

/// Loads weights from a `.gguf` file or a safetensors folder.
pub fn load_transformer(path: &Path, opts: LoadOptions) -> Result<Transformer, LoadError> {
    let mut transformer = if path.is_dir() {
        safetensors_loader::load(path, opts.dtype)?
    } else {
        let file = gguf::GgufFile::open(path)?;
        gguf_loader::load(&file, opts.dtype, opts.weights)?
    };
    if mlx::default_device() == mlx::Device::Cpu {
        transformer.lay_out_for_cpu()?;
    }
    // After the weights' final form is set: the kernels read them as they are.
    transformer.gpu_decode = gpu::GpuDecode::for_model(&transformer)?;
    Ok(transformer)
}
