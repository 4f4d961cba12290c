// y = epilogue(W · prologue(x)) for a few rows of x, reading W once: the
// decode step's projections (one warp per output feature, or KSPLIT warps
// splitting its inputs), bandwidth-bound on W.
//
// Constants: MAX_ROWS (most rows of x: 1, or 8 with the count read from x's
// shape, so one compiled variant serves 2 to 8 rows), K (input features, a
// multiple of 8), KSPLIT
// (warps per output: 1, 2, 4 or 8), NORM (x is RMS-normed by `norm_w`
// first: the norm's sum of squares rides along with the product, and its
// scale is applied to the dot product once), BIAS, RESIDUAL (adds
// `res[row, o]`), GLU (0: none; 1: SwiGLU, 2: GeGLU, of the gate rows
// 0..O and the up rows O..2O of W), EPS_E12 (the norm's epsilon times 1e12).
// Inputs: x [rows, K] bf16, w [O or 2O, K] bf16, norm_w [K], bias [O],
// res [rows, O] (a 1-element placeholder where unused). Output y [rows, O],
// bf16 or float32. Blocks of 256 threads.
constexpr int WARPS = 8;
constexpr int OUTS_PER_BLOCK = WARPS / KSPLIT;
constexpr int CHUNKS = K / 8;  // 16-byte words per row of W
constexpr int SPAN = (CHUNKS + KSPLIT - 1) / KSPLIT;
constexpr int ITERS = (SPAN + 31) / 32;
__shared__ float partial[WARPS][3 * MAX_ROWS];

const int rows = MAX_ROWS == 1 ? 1 : x_shape[0];
const int warp = threadIdx.x / 32;
const int lane = threadIdx.x % 32;
const int O = GLU != 0 ? w_shape[0] / 2 : w_shape[0];
const int o = blockIdx.x * OUTS_PER_BLOCK + warp / KSPLIT;
const int split = warp % KSPLIT;

float dot[MAX_ROWS];
float dot_up[MAX_ROWS];
float squares[MAX_ROWS];
#pragma unroll
for (int r = 0; r < MAX_ROWS; ++r) {
  dot[r] = 0.f;
  dot_up[r] = 0.f;
  squares[r] = 0.f;
}

if (o < O) {
  const uint4* w_row = reinterpret_cast<const uint4*>(w) + (size_t)o * CHUNKS;
  const uint4* up_row = reinterpret_cast<const uint4*>(w) + (size_t)(o + O) * CHUNKS;
  const int end = min(CHUNKS, (split + 1) * SPAN);
#pragma unroll
  for (int i = 0; i < ITERS; ++i) {
    const int c = split * SPAN + i * 32 + lane;
    if (c < end) {
      float wf[8];
      unpack8(__ldg(w_row + c), wf);
      float uf[8];
      if (GLU != 0) unpack8(__ldg(up_row + c), uf);
      float g[8];
      if (NORM) unpack8(__ldg(reinterpret_cast<const uint4*>(norm_w) + c), g);
#pragma unroll
      for (int r = 0; r < MAX_ROWS; ++r) {
        if (r >= rows) break;
        float xf[8];
        unpack8(__ldg(reinterpret_cast<const uint4*>(x) + (size_t)r * CHUNKS + c), xf);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          if (NORM) {
            squares[r] += xf[j] * xf[j];
            xf[j] *= g[j];
          }
          dot[r] += wf[j] * xf[j];
          if (GLU != 0) dot_up[r] += uf[j] * xf[j];
        }
      }
    }
  }
}

#pragma unroll
for (int r = 0; r < MAX_ROWS; ++r) {
  dot[r] = warp_sum(dot[r]);
  if (GLU != 0) dot_up[r] = warp_sum(dot_up[r]);
  if (NORM) squares[r] = warp_sum(squares[r]);
}
if (KSPLIT > 1) {
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < MAX_ROWS; ++r) {
      partial[warp][r] = dot[r];
      partial[warp][MAX_ROWS + r] = dot_up[r];
      partial[warp][2 * MAX_ROWS + r] = squares[r];
    }
  }
  __syncthreads();
  if (split == 0) {
#pragma unroll
    for (int r = 0; r < MAX_ROWS; ++r) {
      for (int s = 1; s < KSPLIT; ++s) {
        dot[r] += partial[warp + s][r];
        dot_up[r] += partial[warp + s][MAX_ROWS + r];
        squares[r] += partial[warp + s][2 * MAX_ROWS + r];
      }
    }
  }
}

if (o < O && split == 0) {
  // Lane r writes row r.
#pragma unroll
  for (int r = 0; r < MAX_ROWS; ++r) {
    if (lane == r && r < rows) {
      const float scale = NORM ? rsqrtf(squares[r] / K + EPS_E12 * 1e-12f) : 1.f;
      float v = dot[r] * scale;
      if (BIAS) v += to_float(bias[o]);
      if (GLU != 0) {
        float up = dot_up[r] * scale;
        if (BIAS) up += to_float(bias[o + O]);
        v = round_bf16(v);
        up = round_bf16(up);
        v = (GLU == 1 ? silu(v) : gelu_tanh(v)) * up;
      }
      if (RESIDUAL) v += to_float(res[(size_t)r * O + o]);
      store(y + (size_t)r * O + o, v);
    }
  }
}
