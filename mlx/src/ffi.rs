//! The raw cxx bridge. Every C++ function is declared returning `Result`, so
//! cxx wraps each call in a try/catch and converts any C++ exception into a
//! `cxx::Exception`: nothing unwinds across the FFI boundary. This module is
//! private; `Array` and the functions in `ops` are the safe surface.

// The bridge mirrors the C++ signatures (the fused quantized product takes
// its weights, their form and what it folds in: ten arguments).
#[allow(clippy::too_many_arguments)]
#[cxx::bridge(namespace = "tether_mlx")]
pub(crate) mod bridge {
    unsafe extern "C++" {
        include!("tether-mlx/src/shim.h");
        include!("tether-mlx/src/cuda_kernel.h");

        type Array;
        type ArrayList;
        type SafetensorsFile;
        type CudaKernel;

        fn list_new() -> Result<UniquePtr<ArrayList>>;
        fn list_push(list: Pin<&mut ArrayList>, a: &Array) -> Result<()>;
        fn list_len(list: &ArrayList) -> usize;
        fn list_get(list: &ArrayList, i: usize) -> Result<UniquePtr<Array>>;

        fn from_f32(data: &[f32], shape: &[i32]) -> Result<UniquePtr<Array>>;
        fn from_i32(data: &[i32], shape: &[i32]) -> Result<UniquePtr<Array>>;
        fn from_u32(data: &[u32], shape: &[i32]) -> Result<UniquePtr<Array>>;
        fn from_bool(data: &[bool], shape: &[i32]) -> Result<UniquePtr<Array>>;
        fn from_u16_bits(data: &[u16], shape: &[i32], dtype: u8) -> Result<UniquePtr<Array>>;
        fn from_raw_bytes(data: &[u8], shape: &[i32], dtype: u8) -> Result<UniquePtr<Array>>;
        fn copy_raw_bytes(a: &Array, out: &mut [u8]) -> Result<()>;
        fn scalar_f32(v: f32, dtype: u8) -> Result<UniquePtr<Array>>;
        fn zeros(shape: &[i32], dtype: u8) -> Result<UniquePtr<Array>>;
        fn full(shape: &[i32], v: f32, dtype: u8) -> Result<UniquePtr<Array>>;
        fn arange(start: f64, stop: f64, step: f64, dtype: u8) -> Result<UniquePtr<Array>>;
        fn clone_array(a: &Array) -> Result<UniquePtr<Array>>;
        fn shape(a: &Array) -> Vec<i32>;
        fn dtype(a: &Array) -> u8;
        fn nbytes(a: &Array) -> usize;
        fn astype(a: &Array, dtype: u8) -> Result<UniquePtr<Array>>;
        fn view_as(a: &Array, dtype: u8) -> Result<UniquePtr<Array>>;

        fn eval_one(a: &Array) -> Result<()>;
        fn eval_list(list: &ArrayList) -> Result<()>;
        fn detach(a: &Array) -> Result<()>;
        fn async_eval_list(list: &ArrayList) -> Result<()>;
        fn to_f32_vec(a: &Array) -> Result<Vec<f32>>;
        fn to_i32_vec(a: &Array) -> Result<Vec<i32>>;
        fn to_u32_vec(a: &Array) -> Result<Vec<u32>>;

        fn binary(a: &Array, b: &Array, op: &str) -> Result<UniquePtr<Array>>;
        fn unary(a: &Array, op: &str) -> Result<UniquePtr<Array>>;
        fn where_(cond: &Array, a: &Array, b: &Array) -> Result<UniquePtr<Array>>;
        fn reduce(a: &Array, axes: &[i32], keepdims: bool, op: &str) -> Result<UniquePtr<Array>>;
        fn softmax(a: &Array, axis: i32, precise: bool) -> Result<UniquePtr<Array>>;
        fn argmax(a: &Array, axis: i32, keepdims: bool) -> Result<UniquePtr<Array>>;
        fn argsort(a: &Array, axis: i32) -> Result<UniquePtr<Array>>;
        fn sort(a: &Array, axis: i32) -> Result<UniquePtr<Array>>;
        fn topk(a: &Array, k: i32, axis: i32) -> Result<UniquePtr<Array>>;
        fn argpartition(a: &Array, kth: i32, axis: i32) -> Result<UniquePtr<Array>>;
        fn cumsum(a: &Array, axis: i32, reverse: bool, inclusive: bool) -> Result<UniquePtr<Array>>;
        fn matmul(a: &Array, b: &Array) -> Result<UniquePtr<Array>>;

        fn reshape(a: &Array, shape: &[i32]) -> Result<UniquePtr<Array>>;
        fn transpose(a: &Array, axes: &[i32]) -> Result<UniquePtr<Array>>;
        fn expand_dims(a: &Array, axis: i32) -> Result<UniquePtr<Array>>;
        fn squeeze(a: &Array, axis: i32) -> Result<UniquePtr<Array>>;
        fn broadcast_to(a: &Array, shape: &[i32]) -> Result<UniquePtr<Array>>;
        fn concatenate(list: &ArrayList, axis: i32) -> Result<UniquePtr<Array>>;
        fn stack(list: &ArrayList, axis: i32) -> Result<UniquePtr<Array>>;
        fn slice(a: &Array, start: &[i32], stop: &[i32], strides: &[i32]) -> Result<UniquePtr<Array>>;
        fn slice_dynamic(a: &Array, start: &Array, axes: &[i32], sizes: &[i32]) -> Result<UniquePtr<Array>>;
        fn slice_update(src: &Array, update: &Array, start: &[i32], stop: &[i32]) -> Result<UniquePtr<Array>>;
        fn slice_update_dynamic(src: &Array, update: &Array, start: &Array, axes: &[i32]) -> Result<UniquePtr<Array>>;
        fn take(a: &Array, indices: &Array, axis: i32) -> Result<UniquePtr<Array>>;
        fn take_along_axis(a: &Array, indices: &Array, axis: i32) -> Result<UniquePtr<Array>>;
        fn put_along_axis(a: &Array, indices: &Array, values: &Array, axis: i32) -> Result<UniquePtr<Array>>;
        fn contiguous(a: &Array) -> Result<UniquePtr<Array>>;

        fn quantize(w: &Array, group_size: i32, bits: i32) -> Result<UniquePtr<ArrayList>>;
        fn dequantize(w: &Array, scales: &Array, biases: &Array, group_size: i32, bits: i32, dtype: u8) -> Result<UniquePtr<Array>>;
        fn quantized_matmul(x: &Array, w: &Array, scales: &Array, biases: &Array, transpose: bool, group_size: i32, bits: i32) -> Result<UniquePtr<Array>>;

        fn cpu_quantized_matmul(x: &Array, w: &Array, scales: &Array, biases: &Array, group_size: i32, bits: i32) -> Result<UniquePtr<Array>>;
        fn cpu_quantized_matmul_fused(
            x: &Array,
            w: &Array,
            scales: &Array,
            biases: &Array,
            group_size: i32,
            bits: i32,
            norm: &ArrayList,
            eps: f32,
            bias: &ArrayList,
            residual: &ArrayList,
        ) -> Result<UniquePtr<Array>>;
        fn cpu_quantized_matmul_max_rows() -> i32;
        fn cpu_five_bit_codes_fast() -> bool;
        fn cpu_dequantize(w: &Array, scales: &Array, biases: &Array, group_size: i32, bits: i32) -> Result<UniquePtr<Array>>;
        fn cpu_pack_panels(w: &Array) -> Result<UniquePtr<Array>>;
        fn cpu_panel_matmul(x: &Array, panels: &Array, out_features: i32) -> Result<UniquePtr<Array>>;
        fn cpu_panels_supported() -> bool;
        fn cpu_isa_level() -> String;

        fn rms_norm(x: &Array, weight: &Array, eps: f32) -> Result<UniquePtr<Array>>;
        fn rope(x: &Array, dims: i32, traditional: bool, base: f32, scale: f32, offset: i32) -> Result<UniquePtr<Array>>;
        fn rope_offsets(x: &Array, dims: i32, traditional: bool, base: f32, scale: f32, offsets: &Array) -> Result<UniquePtr<Array>>;
        fn rope_freqs(x: &Array, dims: i32, traditional: bool, scale: f32, offset: i32, freqs: &Array) -> Result<UniquePtr<Array>>;
        fn rope_offsets_freqs(x: &Array, dims: i32, traditional: bool, scale: f32, offsets: &Array, freqs: &Array) -> Result<UniquePtr<Array>>;
        fn sdpa(q: &Array, k: &Array, v: &Array, scale: f32, mask_mode: &str) -> Result<UniquePtr<Array>>;
        fn sdpa_masked(q: &Array, k: &Array, v: &Array, scale: f32, mask: &Array) -> Result<UniquePtr<Array>>;
        fn cpu_attention(
            q: &Array,
            kv: &ArrayList,
            n: &[i32],
            kv_len: &[i32],
            first: &[i32],
            window: i32,
            keys_in_blocks: bool,
            group: i32,
            bits: i32,
        ) -> Result<UniquePtr<Array>>;
        fn cpu_layer_attention(
            qkv: &Array,
            rope: &Array,
            traditional: bool,
            n_heads: i32,
            kv: &ArrayList,
            n: &[i32],
            kv_len: &[i32],
            first: &[i32],
            window: i32,
            keys_in_blocks: bool,
            group: i32,
            bits: i32,
        ) -> Result<UniquePtr<ArrayList>>;
        fn cpu_kv_write(cache: &Array, fresh: &Array, start: i32, n: i32, pos: i32, in_blocks: bool, group: i32, bits: i32) -> Result<UniquePtr<Array>>;
        fn cpu_kv_dequantize(cache: &Array, len: i32, in_blocks: bool, group: i32, bits: i32) -> Result<UniquePtr<Array>>;
        fn cpu_swiglu(gate_up: &Array) -> Result<UniquePtr<Array>>;

        fn cuda_kernel_new(name: &str, inputs: &str, outputs: &str, source: &str, header: &str) -> Result<UniquePtr<CudaKernel>>;
        fn cuda_kernel_launch(
            kernel: &CudaKernel,
            inputs: &ArrayList,
            shapes: &[i32],
            ndims: &[i32],
            dtypes: &[u8],
            grid: &[i32],
            block: &[i32],
            names: &[&str],
            kinds: &[u8],
            values: &[i32],
        ) -> Result<UniquePtr<ArrayList>>;
        fn cuda_available() -> bool;
        fn sole_holder(a: &Array) -> bool;
        fn graph_census(outputs: &ArrayList) -> String;

        fn random_key(seed: u64) -> Result<UniquePtr<Array>>;
        fn random_split(key: &Array, num: i32) -> Result<UniquePtr<ArrayList>>;
        fn categorical(logits: &Array, axis: i32, key: &Array) -> Result<UniquePtr<Array>>;
        fn uniform(shape: &[i32], key: &Array) -> Result<UniquePtr<Array>>;

        fn active_memory() -> usize;
        fn peak_memory() -> usize;
        fn reset_peak_memory();
        fn cache_memory() -> usize;
        fn clear_cache() -> Result<()>;
        fn trim_process_heap() -> bool;
        fn set_memory_limit(bytes: usize) -> usize;
        fn set_cache_limit(bytes: usize) -> usize;
        fn set_default_device(gpu: bool) -> Result<()>;
        fn gpu_available() -> bool;
        fn default_device_name() -> String;
        fn synchronize() -> Result<()>;
        fn call_at_exit(f: fn());

        fn load_safetensors(path: &str) -> Result<UniquePtr<SafetensorsFile>>;
        fn safetensors_len(f: &SafetensorsFile) -> usize;
        fn safetensors_name(f: &SafetensorsFile, i: usize) -> Result<String>;
        fn safetensors_array(f: &SafetensorsFile, i: usize) -> Result<UniquePtr<Array>>;
        fn safetensors_metadata(f: &SafetensorsFile) -> Vec<String>;
    }
}
