// C++ side of the MLX binding. Every function here is a thin adapter over
// mlx::core: it converts plain arguments (slices, integers, strings) into
// MLX's types and returns results by unique_ptr so Rust owns them. Functions
// that can throw are declared `Result<...>` on the Rust side, so cxx catches
// every C++ exception at the boundary and turns it into a Rust error; no
// exception ever unwinds into Rust.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "mlx/mlx.h"
#include "rust/cxx.h"

namespace tether_mlx {

// The opaque types the Rust side sees. `Array` is MLX's own reference-counted
// array handle: copying it shares the buffer, which is what makes snapshots of
// a KV cache cheap (copy-on-write through slice_update's donation rules).
using Array = mlx::core::array;

// A growable list of arrays, for calls that take or return several.
struct ArrayList {
  std::vector<mlx::core::array> items;
};

// The tensors of one safetensors file, by name.
struct SafetensorsFile {
  std::vector<std::string> names;
  std::vector<mlx::core::array> arrays;
  std::vector<std::string> meta_keys;
  std::vector<std::string> meta_values;
};

// The dtype a code of Rust's `Dtype` enum names (mlx/src/dtype.rs).
mlx::core::Dtype dtype_from_code(uint8_t code);

// ---- lists
std::unique_ptr<ArrayList> list_new();
void list_push(ArrayList& list, const Array& a);
size_t list_len(const ArrayList& list);
std::unique_ptr<Array> list_get(const ArrayList& list, size_t i);

// ---- creation and inspection
std::unique_ptr<Array> from_f32(rust::Slice<const float> data, rust::Slice<const int32_t> shape);
std::unique_ptr<Array> from_i32(rust::Slice<const int32_t> data, rust::Slice<const int32_t> shape);
std::unique_ptr<Array> from_u32(rust::Slice<const uint32_t> data, rust::Slice<const int32_t> shape);
std::unique_ptr<Array> from_bool(rust::Slice<const bool> data, rust::Slice<const int32_t> shape);
std::unique_ptr<Array> from_u16_bits(rust::Slice<const uint16_t> data, rust::Slice<const int32_t> shape, uint8_t dtype);
// Raw bytes in the array's own dtype, row-contiguous: in (a copy) and out
// (into a buffer of exactly nbytes).
std::unique_ptr<Array> from_raw_bytes(rust::Slice<const uint8_t> data, rust::Slice<const int32_t> shape, uint8_t dtype);
void copy_raw_bytes(const Array& a, rust::Slice<uint8_t> out);
std::unique_ptr<Array> scalar_f32(float v, uint8_t dtype);
std::unique_ptr<Array> zeros(rust::Slice<const int32_t> shape, uint8_t dtype);
std::unique_ptr<Array> full(rust::Slice<const int32_t> shape, float v, uint8_t dtype);
std::unique_ptr<Array> arange(double start, double stop, double step, uint8_t dtype);
std::unique_ptr<Array> clone_array(const Array& a);
rust::Vec<int32_t> shape(const Array& a);
uint8_t dtype(const Array& a);
size_t nbytes(const Array& a);
std::unique_ptr<Array> astype(const Array& a, uint8_t dtype);
// The same bytes read as `dtype` (the last axis rescaled by the size ratio).
std::unique_ptr<Array> view_as(const Array& a, uint8_t dtype);

// ---- evaluation and readback
void eval_one(const Array& a);
void eval_list(const ArrayList& list);
// Cuts an evaluated array from the graph that computed it: it keeps its
// data only, and what it was computed from can be freed.
void detach(const Array& a);
void async_eval_list(const ArrayList& list);
rust::Vec<float> to_f32_vec(const Array& a);
rust::Vec<int32_t> to_i32_vec(const Array& a);
rust::Vec<uint32_t> to_u32_vec(const Array& a);

// ---- elementwise and reductions
std::unique_ptr<Array> binary(const Array& a, const Array& b, rust::Str op);
std::unique_ptr<Array> unary(const Array& a, rust::Str op);
std::unique_ptr<Array> where_(const Array& cond, const Array& a, const Array& b);
std::unique_ptr<Array> reduce(const Array& a, rust::Slice<const int32_t> axes, bool keepdims, rust::Str op);
std::unique_ptr<Array> softmax(const Array& a, int32_t axis, bool precise);
std::unique_ptr<Array> argmax(const Array& a, int32_t axis, bool keepdims);
std::unique_ptr<Array> argsort(const Array& a, int32_t axis);
std::unique_ptr<Array> sort(const Array& a, int32_t axis);
std::unique_ptr<Array> topk(const Array& a, int32_t k, int32_t axis);
std::unique_ptr<Array> argpartition(const Array& a, int32_t kth, int32_t axis);
std::unique_ptr<Array> cumsum(const Array& a, int32_t axis, bool reverse, bool inclusive);
std::unique_ptr<Array> matmul(const Array& a, const Array& b);

// ---- shape and indexing
std::unique_ptr<Array> reshape(const Array& a, rust::Slice<const int32_t> shape);
std::unique_ptr<Array> transpose(const Array& a, rust::Slice<const int32_t> axes);
std::unique_ptr<Array> expand_dims(const Array& a, int32_t axis);
std::unique_ptr<Array> squeeze(const Array& a, int32_t axis);
std::unique_ptr<Array> broadcast_to(const Array& a, rust::Slice<const int32_t> shape);
std::unique_ptr<Array> concatenate(const ArrayList& list, int32_t axis);
std::unique_ptr<Array> stack(const ArrayList& list, int32_t axis);
std::unique_ptr<Array> slice(const Array& a, rust::Slice<const int32_t> start, rust::Slice<const int32_t> stop, rust::Slice<const int32_t> strides);
std::unique_ptr<Array> slice_dynamic(const Array& a, const Array& start, rust::Slice<const int32_t> axes, rust::Slice<const int32_t> sizes);
std::unique_ptr<Array> slice_update(const Array& src, const Array& update, rust::Slice<const int32_t> start, rust::Slice<const int32_t> stop);
std::unique_ptr<Array> slice_update_dynamic(const Array& src, const Array& update, const Array& start, rust::Slice<const int32_t> axes);
std::unique_ptr<Array> take(const Array& a, const Array& indices, int32_t axis);
std::unique_ptr<Array> take_along_axis(const Array& a, const Array& indices, int32_t axis);
std::unique_ptr<Array> put_along_axis(const Array& a, const Array& indices, const Array& values, int32_t axis);
std::unique_ptr<Array> contiguous(const Array& a);

// ---- quantization
std::unique_ptr<ArrayList> quantize(const Array& w, int32_t group_size, int32_t bits);
std::unique_ptr<Array> dequantize(const Array& w, const Array& scales, const Array& biases, int32_t group_size, int32_t bits, uint8_t dtype);
std::unique_ptr<Array> quantized_matmul(const Array& x, const Array& w, const Array& scales, const Array& biases, bool transpose, int32_t group_size, int32_t bits);
std::unique_ptr<Array> cpu_quantized_matmul(const Array& x, const Array& w, const Array& scales, const Array& biases, int32_t group_size, int32_t bits);
std::unique_ptr<Array> cpu_quantized_matmul_fused(const Array& x, const Array& w, const Array& scales, const Array& biases, int32_t group_size, int32_t bits,
                                                  const ArrayList& norm, float eps, const ArrayList& bias, const ArrayList& residual);
int32_t cpu_quantized_matmul_max_rows();
bool cpu_five_bit_codes_fast();
std::unique_ptr<Array> cpu_dequantize(const Array& w, const Array& scales, const Array& biases, int32_t group_size, int32_t bits);
std::unique_ptr<Array> cpu_pack_panels(const Array& w);
std::unique_ptr<Array> cpu_panel_matmul(const Array& x, const Array& panels, int32_t out_features);
bool cpu_panels_supported();
// The instruction sets the CPU kernels use (see cpu_isa.h), by name.
rust::String cpu_isa_level();

// ---- fused kernels
std::unique_ptr<Array> rms_norm(const Array& x, const Array& weight, float eps);
std::unique_ptr<Array> rope(const Array& x, int32_t dims, bool traditional, float base, float scale, int32_t offset);
std::unique_ptr<Array> rope_offsets(const Array& x, int32_t dims, bool traditional, float base, float scale, const Array& offsets);
std::unique_ptr<Array> rope_freqs(const Array& x, int32_t dims, bool traditional, float scale, int32_t offset, const Array& freqs);
std::unique_ptr<Array> rope_offsets_freqs(const Array& x, int32_t dims, bool traditional, float scale, const Array& offsets, const Array& freqs);
std::unique_ptr<Array> sdpa(const Array& q, const Array& k, const Array& v, float scale, rust::Str mask_mode);
std::unique_ptr<Array> sdpa_masked(const Array& q, const Array& k, const Array& v, float scale, const Array& mask);
// kv: each row's keys then values; n, kv_len, first: per row; window: 0 for none (see cpu_attention.h).
std::unique_ptr<Array> cpu_attention(const Array& q, const ArrayList& kv, rust::Slice<const int32_t> n, rust::Slice<const int32_t> kv_len, rust::Slice<const int32_t> first, int32_t window, bool keys_in_blocks, int32_t group, int32_t bits);
// qkv, rope: see cpu_layer_attention in cpu_attention.h; returns the attention, then each row's keys and values.
std::unique_ptr<ArrayList> cpu_layer_attention(const Array& qkv, const Array& rope, bool traditional, int32_t n_heads, const ArrayList& kv, rust::Slice<const int32_t> n, rust::Slice<const int32_t> kv_len,
                                               rust::Slice<const int32_t> first, int32_t window, bool keys_in_blocks, int32_t group, int32_t bits);
std::unique_ptr<Array> cpu_kv_write(const Array& cache, const Array& fresh, int32_t start, int32_t n, int32_t pos, bool in_blocks, int32_t group, int32_t bits);
std::unique_ptr<Array> cpu_kv_dequantize(const Array& cache, int32_t len, bool in_blocks, int32_t group, int32_t bits);
// gate_up: [..., 2 ff] float32; see cpu_swiglu.h.
std::unique_ptr<Array> cpu_swiglu(const Array& gate_up);

// ---- random
std::unique_ptr<Array> random_key(uint64_t seed);
std::unique_ptr<ArrayList> random_split(const Array& key, int32_t num);
std::unique_ptr<Array> categorical(const Array& logits, int32_t axis, const Array& key);
std::unique_ptr<Array> uniform(rust::Slice<const int32_t> shape, const Array& key);

// ---- memory and devices
size_t active_memory();
size_t peak_memory();
void reset_peak_memory();
size_t cache_memory();
void clear_cache();
bool trim_process_heap();
size_t set_memory_limit(size_t bytes);
size_t set_cache_limit(size_t bytes);
void set_default_device(bool gpu);
bool gpu_available();
rust::String default_device_name();
void synchronize();
// Runs `f` when the process exits, before MLX's own static destructors
// (registered later, so it runs earlier).
void call_at_exit(rust::Fn<void()> f);

// ---- files
std::unique_ptr<SafetensorsFile> load_safetensors(rust::Str path);
size_t safetensors_len(const SafetensorsFile& f);
rust::String safetensors_name(const SafetensorsFile& f, size_t i);
std::unique_ptr<Array> safetensors_array(const SafetensorsFile& f, size_t i);
rust::Vec<rust::String> safetensors_metadata(const SafetensorsFile& f);

}  // namespace tether_mlx
