// Device helpers shared by the decode kernels (placed before each kernel's
// function; MLX's own header has declared the bfloat16 types).

// A 16-byte word of 8 bfloat16 values, as floats.
__device__ __forceinline__ void unpack8(const uint4& word, float* f) {
  const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&word);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 t = __bfloat1622float2(pairs[i]);
    f[2 * i] = t.x;
    f[2 * i + 1] = t.y;
  }
}

__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

__device__ __forceinline__ float infinity() { return cuda::std::numeric_limits<float>::infinity(); }

// Outputs are bfloat16 or float32, whichever the launch asked for.
__device__ __forceinline__ void store(float* p, float v) { *p = v; }
__device__ __forceinline__ void store(__nv_bfloat16* p, float v) { *p = __float2bfloat16(v); }

// What a bfloat16 array would hold of `v`: intermediates MLX's ops would
// round are rounded the same way.
__device__ __forceinline__ float round_bf16(float v) { return __bfloat162float(__float2bfloat16(v)); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float silu(float x) { return x / (1.0f + __expf(-x)); }

__device__ __forceinline__ float gelu_tanh(float x) {
  const float k = 0.7978845608028654f;  // sqrt(2 / pi)
  return 0.5f * x * (1.0f + tanhf(k * (x + 0.044715f * x * x * x)));
}
