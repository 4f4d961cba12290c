//! `--model` and its neighbours (device, weights, dtype), and loading what
//! they name: an engine worker with the weights, the tokenizer for the
//! caller, or both on this thread.
//!
//! An engine worker loads the weights only (it speaks token ids); the
//! command loads the tokenizer once and checks each worker against it.
use clap::{Args, ValueEnum};
use tether::engine::speculate::DraftModelSpec;
use tether::engine::{EngineConfig, EngineHandle};
use tether::loaded::{self, LoadedModel, ModelWithTokenizer};
use tether::models::{LoadOptions, WeightFormat};
use tether::registry;
use tether::tokenizer::TextTokenizer;

#[derive(Args)]
pub(super) struct ModelArgs {
    /// A known model name, a .gguf file, or an HF safetensors folder.
    #[arg(long, default_value = registry::DEFAULT_MODEL)]
    pub(super) model: String,
    #[arg(long, value_enum, default_value = "auto")]
    device: DeviceArg,
    /// Weight storage: `dense` (compute dtype) or `quantized` (quantized GGUF
    /// blocks kept in an exact affine form where the device has a kernel).
    /// Default: quantized.
    #[arg(long)]
    weights: Option<String>,
    /// Activations, KV cache and dense weights: float32 (the CPU's default)
    /// or bfloat16/float16 (the GPU's default is bfloat16). float32 on a GPU
    /// brings batched and speculative outputs much closer to one-token
    /// decoding (the GPU's kernels still vary with the rows in a step).
    #[arg(long, value_enum, default_value = "auto")]
    dtype: DtypeArg,
}

#[derive(Clone, Copy, ValueEnum)]
enum DeviceArg {
    /// The GPU when MLX has one, else the CPU.
    Auto,
    Cpu,
    Gpu,
}

#[derive(Clone, Copy, ValueEnum)]
enum DtypeArg {
    /// float32 on the CPU, bfloat16 on a GPU.
    Auto,
    F32,
    Bf16,
    F16,
}

impl ModelArgs {
    pub(super) fn device(&self) -> anyhow::Result<mlx::Device> {
        Ok(match self.device {
            DeviceArg::Cpu => mlx::Device::Cpu,
            DeviceArg::Gpu if !mlx::gpu_available() => anyhow::bail!("--device gpu: this MLX build has no usable GPU"),
            DeviceArg::Gpu => mlx::Device::Gpu,
            DeviceArg::Auto if mlx::gpu_available() => mlx::Device::Gpu,
            DeviceArg::Auto => mlx::Device::Cpu,
        })
    }

    fn load_options(&self) -> anyhow::Result<LoadOptions> {
        let mut opts = LoadOptions::for_device(self.device()?);
        match self.dtype {
            DtypeArg::Auto => {}
            DtypeArg::F32 => opts.dtype = mlx::Dtype::F32,
            DtypeArg::Bf16 => opts.dtype = mlx::Dtype::BF16,
            DtypeArg::F16 => opts.dtype = mlx::Dtype::F16,
        }
        if let Some(w) = &self.weights {
            opts.weights = WeightFormat::parse(w).ok_or_else(|| anyhow::anyhow!("--weights must be `dense` or `quantized`, got {w:?}"))?;
        }
        Ok(opts)
    }

    /// The draft model to load beside this one: same device and weight form.
    pub(super) fn draft_model_spec(&self, draft: Option<&str>) -> anyhow::Result<Option<DraftModelSpec>> {
        let Some(name) = draft else { return Ok(None) };
        Ok(Some(DraftModelSpec { path: registry::resolve(name)?, options: self.load_options()? }))
    }

    /// The model's tokenizer, loaded once for the whole process.
    pub(super) fn load_tokenizer(&self) -> anyhow::Result<TextTokenizer> {
        Ok(loaded::load_tokenizer(&registry::resolve(&self.model)?)?)
    }

    /// An engine thread that loads the weights onto the chosen device;
    /// `tokenizer` (the caller's: the engine never sees text) must fit them.
    pub(super) fn start_worker(&self, config: EngineConfig, tokenizer: &TextTokenizer) -> anyhow::Result<EngineHandle> {
        let device = self.device()?;
        if device == mlx::Device::Cpu {
            // Which of the CPU kernels' paths run (TETHER_CPU_ISA lowers it).
            eprintln!("cpu kernels: {}", mlx::cpu_isa());
        }
        let opts = self.load_options()?;
        let name = self.model.clone();
        let engine = EngineHandle::start(config, move || {
            mlx::set_default_device(device)?;
            Ok(LoadedModel::load(&name, opts)?)
        })?;
        loaded::check_vocab(tokenizer, engine.info().vocab_size)?;
        Ok(engine)
    }

    /// The weights and tokenizer on this thread, for running text with no engine.
    pub(super) fn load_here(&self) -> anyhow::Result<ModelWithTokenizer> {
        mlx::set_default_device(self.device()?)?;
        Ok(ModelWithTokenizer::load(&self.model, self.load_options()?)?)
    }

    /// [`load_here`](Self::load_here) in `dtype` whatever `--dtype` says
    /// (a float32 reference beside the model under test).
    pub(super) fn load_here_in(&self, dtype: mlx::Dtype) -> anyhow::Result<ModelWithTokenizer> {
        mlx::set_default_device(self.device()?)?;
        Ok(ModelWithTokenizer::load(&self.model, LoadOptions { dtype, ..self.load_options()? })?)
    }
}
