// Adapters from the Rust bridge to mlx::core. See shim.h for the contract.
#include "tether-mlx/src/shim.h"

#include <cstring>
#include <stdexcept>
#if defined(__GLIBC__)  // defined by the C library's headers, included above
#include <malloc.h>
#endif

#include "tether-mlx/src/cpu_attention.h"
#include "tether-mlx/src/cpu_isa.h"
#include "tether-mlx/src/cpu_panels.h"
#include "tether-mlx/src/cpu_swiglu.h"
#include "tether-mlx/src/cpu_qmm.h"
#include "tether-mlx/src/cpu_dequantize.h"

namespace mx = mlx::core;

namespace tether_mlx {

// Dtype codes shared with Rust's `Dtype` enum (mlx/src/dtype.rs): they follow
// the order of mx::Dtype::Val so a code is the enum's ordinal.
mx::Dtype dtype_from_code(uint8_t code) {
  switch (code) {
    case 0: return mx::bool_;
    case 1: return mx::uint8;
    case 2: return mx::uint16;
    case 3: return mx::uint32;
    case 4: return mx::uint64;
    case 5: return mx::int8;
    case 6: return mx::int16;
    case 7: return mx::int32;
    case 8: return mx::int64;
    case 9: return mx::float16;
    case 10: return mx::float32;
    case 11: return mx::float64;
    case 12: return mx::bfloat16;
    case 13: return mx::complex64;
  }
  throw std::invalid_argument("unknown dtype code " + std::to_string(code));
}

namespace {

mx::Shape to_shape(rust::Slice<const int32_t> s) { return mx::Shape(s.begin(), s.end()); }
std::vector<int> to_ints(rust::Slice<const int32_t> s) { return std::vector<int>(s.begin(), s.end()); }
std::unique_ptr<Array> boxed(mx::array a) { return std::make_unique<Array>(std::move(a)); }

size_t checked_size(rust::Slice<const int32_t> shape) {
  size_t n = 1;
  for (auto d : shape) {
    if (d < 0) throw std::invalid_argument("negative dimension in shape");
    n *= static_cast<size_t>(d);
  }
  return n;
}

template <typename T>
std::unique_ptr<Array> from_slice(rust::Slice<const T> data, rust::Slice<const int32_t> shape, mx::Dtype dt) {
  if (checked_size(shape) != data.size())
    throw std::invalid_argument("data length " + std::to_string(data.size()) + " does not match shape");
  // A raw pointer, not the slice's iterator: MLX copies with std::copy,
  // which is a memmove for a pointer of the element type and an
  // element-at-a-time loop for anything else.
  return boxed(mx::array(data.data(), to_shape(shape), dt));
}

// Reads an array back to the host as a row-contiguous buffer of T.
template <typename T>
rust::Vec<T> read_back(const Array& a, mx::Dtype dt) {
  auto c = mx::contiguous(mx::astype(a, dt));
  c.eval();
  rust::Vec<T> out;
  out.reserve(c.size());
  const T* p = c.data<T>();
  for (size_t i = 0; i < c.size(); ++i) out.push_back(p[i]);
  return out;
}

}  // namespace

std::unique_ptr<ArrayList> list_new() { return std::make_unique<ArrayList>(); }
void list_push(ArrayList& list, const Array& a) { list.items.push_back(a); }
size_t list_len(const ArrayList& list) { return list.items.size(); }
std::unique_ptr<Array> list_get(const ArrayList& list, size_t i) {
  if (i >= list.items.size()) throw std::out_of_range("array list index out of range");
  return boxed(list.items[i]);
}

std::unique_ptr<Array> from_f32(rust::Slice<const float> d, rust::Slice<const int32_t> s) { return from_slice(d, s, mx::float32); }
std::unique_ptr<Array> from_i32(rust::Slice<const int32_t> d, rust::Slice<const int32_t> s) { return from_slice(d, s, mx::int32); }
std::unique_ptr<Array> from_u32(rust::Slice<const uint32_t> d, rust::Slice<const int32_t> s) { return from_slice(d, s, mx::uint32); }
std::unique_ptr<Array> from_bool(rust::Slice<const bool> d, rust::Slice<const int32_t> s) { return from_slice(d, s, mx::bool_); }
std::unique_ptr<Array> from_u16_bits(rust::Slice<const uint16_t> d, rust::Slice<const int32_t> s, uint8_t dtype) {
  auto dt = dtype_from_code(dtype);
  if (dt.size() != 2) throw std::invalid_argument("from_u16_bits needs a 16-bit dtype");
  auto a = from_slice(d, s, mx::uint16);
  return boxed(mx::view(*a, dt));
}
std::unique_ptr<Array> from_raw_bytes(rust::Slice<const uint8_t> d, rust::Slice<const int32_t> s, uint8_t dtype) {
  auto dt = dtype_from_code(dtype);
  if (checked_size(s) * dt.size() != d.size())
    throw std::invalid_argument("from_raw_bytes: " + std::to_string(d.size()) + " bytes do not match the shape and dtype");
  // Bytes in as one flat uint8 array, reinterpreted (a view), then shaped.
  int32_t n = static_cast<int32_t>(d.size());
  auto flat = from_slice(d, rust::Slice<const int32_t>(&n, 1), mx::uint8);
  return boxed(mx::reshape(mx::view(*flat, dt), to_shape(s)));
}
void copy_raw_bytes(const Array& a, rust::Slice<uint8_t> out) {
  auto c = mx::contiguous(a);
  c.eval();
  if (c.nbytes() != out.size())
    throw std::invalid_argument("copy_raw_bytes: " + std::to_string(c.nbytes()) + " bytes into " + std::to_string(out.size()));
  std::memcpy(out.data(), c.data<uint8_t>(), c.nbytes());
}
std::unique_ptr<Array> scalar_f32(float v, uint8_t dtype) { return boxed(mx::array(v, dtype_from_code(dtype))); }
std::unique_ptr<Array> zeros(rust::Slice<const int32_t> s, uint8_t dtype) { return boxed(mx::zeros(to_shape(s), dtype_from_code(dtype))); }
std::unique_ptr<Array> full(rust::Slice<const int32_t> s, float v, uint8_t dtype) {
  return boxed(mx::full(to_shape(s), mx::array(v), dtype_from_code(dtype)));
}
std::unique_ptr<Array> arange(double start, double stop, double step, uint8_t dtype) {
  return boxed(mx::arange(start, stop, step, dtype_from_code(dtype)));
}
std::unique_ptr<Array> clone_array(const Array& a) { return boxed(a); }
rust::Vec<int32_t> shape(const Array& a) {
  rust::Vec<int32_t> out;
  for (auto d : a.shape()) out.push_back(d);
  return out;
}
uint8_t dtype(const Array& a) { return static_cast<uint8_t>(a.dtype().val()); }
size_t nbytes(const Array& a) { return a.nbytes(); }
std::unique_ptr<Array> astype(const Array& a, uint8_t dt) { return boxed(mx::astype(a, dtype_from_code(dt))); }
std::unique_ptr<Array> view_as(const Array& a, uint8_t dt) { return boxed(mx::view(a, dtype_from_code(dt))); }

void eval_one(const Array& a) { mx::eval({a}); }
void eval_list(const ArrayList& l) { mx::eval(l.items); }
void detach(const Array& a) { mx::array(a).detach(); }
void async_eval_list(const ArrayList& l) { mx::async_eval(l.items); }
rust::Vec<float> to_f32_vec(const Array& a) { return read_back<float>(a, mx::float32); }
rust::Vec<int32_t> to_i32_vec(const Array& a) { return read_back<int32_t>(a, mx::int32); }
rust::Vec<uint32_t> to_u32_vec(const Array& a) { return read_back<uint32_t>(a, mx::uint32); }

std::unique_ptr<Array> binary(const Array& a, const Array& b, rust::Str op_) {
  std::string op(op_);
  if (op == "add") return boxed(mx::add(a, b));
  if (op == "subtract") return boxed(mx::subtract(a, b));
  if (op == "multiply") return boxed(mx::multiply(a, b));
  if (op == "divide") return boxed(mx::divide(a, b));
  if (op == "maximum") return boxed(mx::maximum(a, b));
  if (op == "minimum") return boxed(mx::minimum(a, b));
  if (op == "greater") return boxed(mx::greater(a, b));
  if (op == "greater_equal") return boxed(mx::greater_equal(a, b));
  if (op == "less") return boxed(mx::less(a, b));
  if (op == "less_equal") return boxed(mx::less_equal(a, b));
  if (op == "equal") return boxed(mx::equal(a, b));
  if (op == "logical_and") return boxed(mx::logical_and(a, b));
  if (op == "logical_or") return boxed(mx::logical_or(a, b));
  if (op == "right_shift") return boxed(mx::right_shift(a, b));
  if (op == "bitwise_and") return boxed(mx::bitwise_and(a, b));
  throw std::invalid_argument("unknown binary op " + op);
}

std::unique_ptr<Array> unary(const Array& a, rust::Str op_) {
  std::string op(op_);
  if (op == "exp") return boxed(mx::exp(a));
  if (op == "log") return boxed(mx::log(a));
  if (op == "negative") return boxed(mx::negative(a));
  if (op == "sqrt") return boxed(mx::sqrt(a));
  if (op == "rsqrt") return boxed(mx::rsqrt(a));
  if (op == "abs") return boxed(mx::abs(a));
  if (op == "sigmoid") return boxed(mx::sigmoid(a));
  if (op == "tanh") return boxed(mx::tanh(a));
  if (op == "square") return boxed(mx::square(a));
  if (op == "logical_not") return boxed(mx::logical_not(a));
  if (op == "round") return boxed(mx::round(a));
  if (op == "stop_gradient") return boxed(mx::stop_gradient(a));
  throw std::invalid_argument("unknown unary op " + op);
}

std::unique_ptr<Array> where_(const Array& c, const Array& a, const Array& b) { return boxed(mx::where(c, a, b)); }

std::unique_ptr<Array> reduce(const Array& a, rust::Slice<const int32_t> axes_, bool keepdims, rust::Str op_) {
  std::string op(op_);
  auto axes = to_ints(axes_);
  if (op == "sum") return boxed(mx::sum(a, axes, keepdims));
  if (op == "max") return boxed(mx::max(a, axes, keepdims));
  if (op == "min") return boxed(mx::min(a, axes, keepdims));
  if (op == "mean") return boxed(mx::mean(a, axes, keepdims));
  if (op == "logsumexp") return boxed(mx::logsumexp(a, axes, keepdims));
  throw std::invalid_argument("unknown reduction " + op);
}

std::unique_ptr<Array> softmax(const Array& a, int32_t axis, bool precise) { return boxed(mx::softmax(a, std::vector<int>{axis}, precise)); }
std::unique_ptr<Array> argmax(const Array& a, int32_t axis, bool keepdims) { return boxed(mx::argmax(a, axis, keepdims)); }
std::unique_ptr<Array> argsort(const Array& a, int32_t axis) { return boxed(mx::argsort(a, axis)); }
std::unique_ptr<Array> sort(const Array& a, int32_t axis) { return boxed(mx::sort(a, axis)); }
std::unique_ptr<Array> topk(const Array& a, int32_t k, int32_t axis) { return boxed(mx::topk(a, k, axis)); }
std::unique_ptr<Array> argpartition(const Array& a, int32_t kth, int32_t axis) { return boxed(mx::argpartition(a, kth, axis)); }
std::unique_ptr<Array> cumsum(const Array& a, int32_t axis, bool reverse, bool inclusive) { return boxed(mx::cumsum(a, axis, reverse, inclusive)); }
std::unique_ptr<Array> matmul(const Array& a, const Array& b) { return boxed(mx::matmul(a, b)); }

std::unique_ptr<Array> reshape(const Array& a, rust::Slice<const int32_t> s) { return boxed(mx::reshape(a, to_shape(s))); }
std::unique_ptr<Array> transpose(const Array& a, rust::Slice<const int32_t> axes) { return boxed(mx::transpose(a, to_ints(axes))); }
std::unique_ptr<Array> expand_dims(const Array& a, int32_t axis) { return boxed(mx::expand_dims(a, axis)); }
std::unique_ptr<Array> squeeze(const Array& a, int32_t axis) { return boxed(mx::squeeze(a, axis)); }
std::unique_ptr<Array> broadcast_to(const Array& a, rust::Slice<const int32_t> s) { return boxed(mx::broadcast_to(a, to_shape(s))); }
std::unique_ptr<Array> concatenate(const ArrayList& l, int32_t axis) { return boxed(mx::concatenate(l.items, axis)); }
std::unique_ptr<Array> stack(const ArrayList& l, int32_t axis) { return boxed(mx::stack(l.items, axis)); }
std::unique_ptr<Array> slice(const Array& a, rust::Slice<const int32_t> start, rust::Slice<const int32_t> stop, rust::Slice<const int32_t> strides) {
  return boxed(mx::slice(a, to_shape(start), to_shape(stop), to_shape(strides)));
}
std::unique_ptr<Array> slice_dynamic(const Array& a, const Array& start, rust::Slice<const int32_t> axes, rust::Slice<const int32_t> sizes) {
  return boxed(mx::slice(a, start, to_ints(axes), to_shape(sizes)));
}
std::unique_ptr<Array> slice_update(const Array& src, const Array& update, rust::Slice<const int32_t> start, rust::Slice<const int32_t> stop) {
  return boxed(mx::slice_update(src, update, to_shape(start), to_shape(stop)));
}
std::unique_ptr<Array> slice_update_dynamic(const Array& src, const Array& update, const Array& start, rust::Slice<const int32_t> axes) {
  return boxed(mx::slice_update(src, update, start, to_ints(axes)));
}
std::unique_ptr<Array> take(const Array& a, const Array& idx, int32_t axis) { return boxed(mx::take(a, idx, axis)); }
std::unique_ptr<Array> take_along_axis(const Array& a, const Array& idx, int32_t axis) { return boxed(mx::take_along_axis(a, idx, axis)); }
std::unique_ptr<Array> put_along_axis(const Array& a, const Array& idx, const Array& v, int32_t axis) { return boxed(mx::put_along_axis(a, idx, v, axis)); }
std::unique_ptr<Array> contiguous(const Array& a) { return boxed(mx::contiguous(a)); }

std::unique_ptr<ArrayList> quantize(const Array& w, int32_t group_size, int32_t bits) {
  auto out = std::make_unique<ArrayList>();
  out->items = mx::quantize(w, group_size, bits);
  return out;
}
std::unique_ptr<Array> dequantize(const Array& w, const Array& scales, const Array& biases, int32_t group_size, int32_t bits, uint8_t dt) {
  return boxed(mx::dequantize(w, scales, biases, group_size, bits, "affine", std::nullopt, dtype_from_code(dt)));
}
std::unique_ptr<Array> quantized_matmul(const Array& x, const Array& w, const Array& scales, const Array& biases, bool transpose, int32_t group_size, int32_t bits) {
  return boxed(mx::quantized_matmul(x, w, scales, biases, transpose, group_size, bits));
}

std::unique_ptr<Array> cpu_quantized_matmul(const Array& x, const Array& w, const Array& scales, const Array& biases, int32_t group_size, int32_t bits) {
  return boxed(cpu_affine_matmul(x, w, scales, biases, group_size, bits));
}
std::unique_ptr<Array> cpu_quantized_matmul_fused(const Array& x, const Array& w, const Array& scales, const Array& biases, int32_t group_size, int32_t bits,
                                                  const ArrayList& norm, float eps, const ArrayList& bias, const ArrayList& residual) {
  auto first = [](const ArrayList& l) { return l.items.empty() ? std::nullopt : std::optional<mx::array>(l.items[0]); };
  return boxed(cpu_affine_matmul(x, w, scales, biases, group_size, bits, first(norm), eps, first(bias), first(residual)));
}
int32_t cpu_quantized_matmul_max_rows() { return kCpuQmmMaxRows; }
bool cpu_five_bit_codes_fast() { return tether_mlx::cpu_affine_five_bit_fast(); }
std::unique_ptr<Array> cpu_dequantize(const Array& w, const Array& scales, const Array& biases, int32_t group_size, int32_t bits) {
  return boxed(cpu_affine_dequantize(w, scales, biases, group_size, bits));
}
std::unique_ptr<Array> cpu_pack_panels(const Array& w) { return boxed(pack_panels(w)); }
std::unique_ptr<Array> cpu_panel_matmul(const Array& x, const Array& panels, int32_t out_features) { return boxed(panel_matmul(x, panels, out_features)); }
bool cpu_panels_supported() { return panel_kernel_supported(); }

rust::String cpu_isa_level() { return rust::String(isa_name(cpu_isa())); }

std::unique_ptr<Array> rms_norm(const Array& x, const Array& w, float eps) { return boxed(mx::fast::rms_norm(x, w, eps)); }
std::unique_ptr<Array> rope(const Array& x, int32_t dims, bool traditional, float base, float scale, int32_t offset) {
  return boxed(mx::fast::rope(x, dims, traditional, base, scale, offset));
}
std::unique_ptr<Array> rope_offsets(const Array& x, int32_t dims, bool traditional, float base, float scale, const Array& offsets) {
  return boxed(mx::fast::rope(x, dims, traditional, base, scale, offsets));
}
std::unique_ptr<Array> rope_freqs(const Array& x, int32_t dims, bool traditional, float scale, int32_t offset, const Array& freqs) {
  return boxed(mx::fast::rope(x, dims, traditional, std::nullopt, scale, offset, freqs));
}
std::unique_ptr<Array> rope_offsets_freqs(const Array& x, int32_t dims, bool traditional, float scale, const Array& offsets, const Array& freqs) {
  return boxed(mx::fast::rope(x, dims, traditional, std::nullopt, scale, offsets, freqs));
}
std::unique_ptr<Array> sdpa(const Array& q, const Array& k, const Array& v, float scale, rust::Str mask_mode) {
  return boxed(mx::fast::scaled_dot_product_attention(q, k, v, scale, std::string(mask_mode)));
}
std::unique_ptr<Array> sdpa_masked(const Array& q, const Array& k, const Array& v, float scale, const Array& mask) {
  return boxed(mx::fast::scaled_dot_product_attention(q, k, v, scale, "", mask));
}
namespace {
// Each row's keys and values from `kv` (keys then values, row by row) and
// its AttentionRow, checking that every per-row list has one entry a row.
struct StepRows {
  std::vector<mx::array> keys, values;
  std::vector<AttentionRow> rows;
};
StepRows step_rows(const ArrayList& kv, rust::Slice<const int32_t> n, rust::Slice<const int32_t> kv_len, rust::Slice<const int32_t> first) {
  if (n.size() != kv_len.size() || first.size() != n.size() || kv.items.size() != 2 * n.size())
    throw std::invalid_argument("cpu_attention: need keys, values, n, kv_len and first for every row");
  StepRows s;
  for (size_t r = 0; r < n.size(); ++r) {
    s.keys.push_back(kv.items[2 * r]);
    s.values.push_back(kv.items[2 * r + 1]);
    s.rows.push_back({n[r], kv_len[r], first[r]});
  }
  return s;
}
}  // namespace

std::unique_ptr<Array> cpu_attention(const Array& q, const ArrayList& kv, rust::Slice<const int32_t> n, rust::Slice<const int32_t> kv_len, rust::Slice<const int32_t> first, int32_t window, bool keys_in_blocks, int32_t group, int32_t bits) {
  const StepRows s = step_rows(kv, n, kv_len, first);
  return boxed(cpu_step_attention(q, s.keys, s.values, s.rows, window, keys_in_blocks, group, bits));
}
std::unique_ptr<ArrayList> cpu_layer_attention(const Array& qkv, const Array& rope, bool traditional, int32_t n_heads, const ArrayList& kv, rust::Slice<const int32_t> n, rust::Slice<const int32_t> kv_len,
                                               rust::Slice<const int32_t> first, int32_t window, bool keys_in_blocks, int32_t group, int32_t bits) {
  StepRows s = step_rows(kv, n, kv_len, first);
  auto out = std::make_unique<ArrayList>();
  out->items = tether_mlx::cpu_layer_attention(qkv, rope, traditional, n_heads, s.keys, s.values, s.rows, window, keys_in_blocks, group, bits);
  return out;
}
std::unique_ptr<Array> cpu_kv_write(const Array& cache, const Array& fresh, int32_t start, int32_t n, int32_t pos, bool in_blocks, int32_t group, int32_t bits) {
  return boxed(cpu_cache_write(cache, fresh, start, n, pos, in_blocks, group, bits));
}
std::unique_ptr<Array> cpu_kv_dequantize(const Array& cache, int32_t len, bool in_blocks, int32_t group, int32_t bits) {
  return boxed(cpu_cache_dequantize(cache, len, in_blocks, group, bits));
}
std::unique_ptr<Array> cpu_swiglu(const Array& gate_up) { return boxed(tether_mlx::swiglu_activation(gate_up)); }

std::unique_ptr<Array> random_key(uint64_t seed) { return boxed(mx::random::key(seed)); }
std::unique_ptr<ArrayList> random_split(const Array& key, int32_t num) {
  auto keys = mx::random::split(key, num);
  auto out = std::make_unique<ArrayList>();
  for (int i = 0; i < num; ++i) out->items.push_back(mx::take(keys, i, 0));
  return out;
}
std::unique_ptr<Array> categorical(const Array& logits, int32_t axis, const Array& key) {
  return boxed(mx::random::categorical(logits, axis, key));
}
std::unique_ptr<Array> uniform(rust::Slice<const int32_t> s, const Array& key) {
  return boxed(mx::random::uniform(to_shape(s), mx::float32, key));
}

size_t active_memory() { return mx::get_active_memory(); }
size_t peak_memory() { return mx::get_peak_memory(); }
void reset_peak_memory() { mx::reset_peak_memory(); }
size_t cache_memory() { return mx::get_cache_memory(); }
void clear_cache() { mx::clear_cache(); }

// glibc keeps memory freed into its heaps and per-thread arenas for reuse
// and returns it to the system only from the top of each heap (and only
// past a threshold that grows with the largest freed mmap chunk). After a
// burst, freed KV caches and graph buffers leave most of it in the middle
// of the heaps: malloc_trim(0) releases every free page there too.
bool trim_process_heap() {
#if defined(__GLIBC__)
  return malloc_trim(0) != 0;
#else
  return false;
#endif
}
size_t set_memory_limit(size_t bytes) { return mx::set_memory_limit(bytes); }
size_t set_cache_limit(size_t bytes) { return mx::set_cache_limit(bytes); }
void set_default_device(bool gpu) { mx::set_default_device(gpu ? mx::Device::gpu : mx::Device::cpu); }
bool gpu_available() { return mx::is_available(mx::Device::gpu); }
rust::String default_device_name() {
  return mx::default_device().type == mx::Device::gpu ? rust::String("gpu") : rust::String("cpu");
}
void synchronize() { mx::synchronize(); }

namespace {
std::vector<rust::Fn<void()>>& exit_hooks() {
  static std::vector<rust::Fn<void()>> hooks;
  return hooks;
}
void run_exit_hooks() {
  auto& hooks = exit_hooks();
  for (auto it = hooks.rbegin(); it != hooks.rend(); ++it) (*it)();
}
}  // namespace

void call_at_exit(rust::Fn<void()> f) {
  // MLX's statics are constructed by now (the engine has run ops), so an
  // atexit handler registered here runs before their destructors.
  if (exit_hooks().empty()) std::atexit(run_exit_hooks);
  exit_hooks().push_back(f);
}

std::unique_ptr<SafetensorsFile> load_safetensors(rust::Str path) {
  auto [tensors, meta] = mx::load_safetensors(std::string(path));
  auto f = std::make_unique<SafetensorsFile>();
  for (auto& [name, arr] : tensors) {
    f->names.push_back(name);
    f->arrays.push_back(arr);
  }
  for (auto& [k, v] : meta) {
    f->meta_keys.push_back(k);
    f->meta_values.push_back(v);
  }
  return f;
}
size_t safetensors_len(const SafetensorsFile& f) { return f.names.size(); }
rust::String safetensors_name(const SafetensorsFile& f, size_t i) { return rust::String(f.names.at(i)); }
std::unique_ptr<Array> safetensors_array(const SafetensorsFile& f, size_t i) { return boxed(f.arrays.at(i)); }
rust::Vec<rust::String> safetensors_metadata(const SafetensorsFile& f) {
  rust::Vec<rust::String> out;
  for (size_t i = 0; i < f.meta_keys.size(); ++i) {
    out.push_back(rust::String(f.meta_keys[i]));
    out.push_back(rust::String(f.meta_values[i]));
  }
  return out;
}

}  // namespace tether_mlx
