// CPU attention for a batched step, and the KV-cache write that feeds it.
//
// Why: MLX's CPU scaled_dot_product_attention spends its time in a scalar
// exp (about 74 M/s here) and scores key blocks that the causal mask hides;
// and a batched step called it once per sequence, with a dozen small ops
// around each call (slices, transposes, concatenation), whose overhead
// dominated decode at many streams. One primitive here attends every row of
// a step against its own cache; another writes a row's new keys or values
// into its cache without the reshapes and transposes slice_update needed;
// a third does a layer's RoPE, writes and attention as one node (MLX's RoPE
// on the CPU is a dozen ops of its own).
//
// Algorithm (flash attention, on the CPU): a work item is one row's block of
// queries for one KV head, with every query head that shares that KV head
// (grouped-query attention reads each key once per group). It walks the keys
// in blocks of kKeyBlock, stopping at the last key its last query may see:
// per block, scores S = Q K^T (queries pre-scaled), an online-softmax update
// (running max and sum per query, earlier output rescaled when the max grows)
// and O += P V. The score loop runs along keys, 16 per vector, so it reads a
// block transposed, [feature][key]: a cache whose keys are stored in blocks
// (see cpu_attention.h) is read in place; otherwise each block is transposed
// into scratch first, which costs more than scoring it when few queries share
// a block (a decode step: one query per head of the group). Items go to the
// cores largest first.
//
// Caches of 8- or 4-bit codes (see cpu_attention.h): a block of keys or
// values is dequantized into scratch (keys transposed, as the score loop
// reads them) and then scored and accumulated as float32 ones are; the
// cache holds a quarter (an eighth) of the bytes and a little more, which is
// what a decode step at a long history waits on, and the write quantizes
// each new position once.
//
// Invariants: queries and outputs are float32, caches float32 or uint8
// (codes), checked against each other's shapes when the primitive was
// built; a cache of codes has contiguous rows (its strides checked then).
// Strides are read at run time,
// so inputs may be views (slices of the qkv projection, a cache's first
// positions). The output buffer is allocated (or, for the cache write, taken
// over by donation) in eval_cpu and filled by the dispatched task, which
// holds copies of the input arrays so their buffers outlive it. Every
// pointer a task forms stays inside its array: rows tile the T tokens, and
// a row reads cache indices below kv_len - first <= capacity (keys stored in
// blocks: whole blocks, so below that rounded up to a block, which is
// still <= capacity, a multiple of the block, checked when the primitive is
// built) and writes positions below pos + n <= capacity. With a window, a
// query's lowest visible index is >= 0 (checked when built), so blocks
// before it are skipped, never read out of range.
#include "tether-mlx/src/cpu_attention.h"
#include "tether-mlx/src/cpu_isa.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include <immintrin.h>

#include "mlx/backend/cpu/encoder.h"
#include "tether-mlx/src/cpu_eval.h"
#include "mlx/primitives.h"
#include "tether-mlx/src/row_pool.h"
#include "tether-mlx/src/simd_exp.h"

namespace mx = mlx::core;

namespace tether_mlx {
namespace {

// Keys per block: a query's scores for one block fill four AVX-512 vectors.
constexpr int kKeyBlock = kCacheKeyBlock;
// Query vectors per work item (query tokens x heads of one KV group): enough
// to amortize transposing each key block, few enough to stay in L1/L2.
constexpr int kItemRows = 64;

// A float32 tensor read as [token][head][feature] through its strides: a
// step's queries or new keys, shaped [1, T, H * D] or [T, H, 1, D].
struct TokenView {
  const float* p;
  int64_t tok, head, d;
};

// One KV head's cache, [position][feature]; `p` starts at head 0.
struct CacheView {
  const float* p;
  int64_t head, pos, d;
};

// (tokens, heads) of a token-layout array of head size `dim`, or throws.
std::pair<int, int> token_shape(const mx::array& a, int dim, const char* what) {
  if (a.ndim() == 3 && a.shape(0) == 1 && a.shape(2) % dim == 0) return {a.shape(1), a.shape(2) / dim};
  if (a.ndim() == 4 && a.shape(2) == 1 && a.shape(3) == dim) return {a.shape(0), a.shape(1)};
  throw std::invalid_argument(std::string("cpu_attention: ") + what + " must be [1, T, heads * head_dim] or [T, heads, 1, head_dim]");
}

TokenView token_view(const mx::array& a, int dim) {
  const auto& st = a.strides();
  if (a.ndim() == 3) return {a.data<float>(), st[1], st[2] * dim, st[2]};
  return {a.data<float>(), st[0], st[1], st[3]};
}

CacheView cache_view(const mx::array& a) {
  const auto& st = a.strides();
  return {a.data<float>(), st[1], st[2], st[3]};
}

// A code's byte and the shift of its bits within it.
struct CodeAt {
  int64_t byte;
  int shift;
};

// Where, within one head of a cache of codes (rows `width` bytes apart),
// position p's code of feature d and its group's scale and bias lie (see
// quantized_width in cpu_attention.h). Values are never stored in blocks.
struct CodeLayout {
  int dim, group, width;
  bool in_blocks;
  int bits;  // 8 or 4

  int mask() const { return (1 << bits) - 1; }
  // Keys (the layout in blocks) of head sizes that are powers of two are
  // quantized rotated (see rotate).
  bool rotated() const { return in_blocks && (dim & (dim - 1)) == 0; }
  int64_t codes_bytes() const { return static_cast<int64_t>(dim) * bits / 8; }  // one position's codes
  int64_t block(int p) const { return static_cast<int64_t>(p / kKeyBlock) * kKeyBlock * width; }
  // 4-bit codes pair up in a byte, low nibble first: in a block's feature
  // stripe, positions j and j + B/2; in a position's row, features d and d + dim/2.
  CodeAt code(int p, int d) const {
    if (in_blocks) {
      const int stripe = kKeyBlock * bits / 8, j = p % kKeyBlock;
      return {block(p) + static_cast<int64_t>(d) * stripe + j % stripe, j < stripe ? 0 : 4};
    }
    const int half = static_cast<int>(codes_bytes());
    return {static_cast<int64_t>(p) * width + d % half, d < half ? 0 : 4};
  }
  int64_t scale(int p, int g) const {
    return in_blocks ? block(p) + kKeyBlock * codes_bytes() + (2 * g * kKeyBlock + p % kKeyBlock) * 4 : static_cast<int64_t>(p) * width + codes_bytes() + 8 * g;
  }
  int64_t bias(int p, int g) const { return scale(p, g) + (in_blocks ? kKeyBlock * 4 : 4); }
};

inline float load_f32(const uint8_t* p) {
  float f;
  std::memcpy(&f, p, sizeof f);
  return f;
}

inline void store_f32(uint8_t* p, float f) { std::memcpy(p, &f, sizeof f); }

// Feature d of position p, dequantized, from one head's bytes.
inline float code_value(const CodeLayout& l, const uint8_t* head, int p, int d) {
  const int g = d / l.group;
  const CodeAt at = l.code(p, d);
  return ((head[at.byte] >> at.shift) & l.mask()) * load_f32(head + l.scale(p, g)) + load_f32(head + l.bias(p, g));
}

// x <- H x / sqrt(n) in place, H the n x n Hadamard matrix in Sylvester's
// order (n a power of two), by butterflies in float32: its own inverse, and
// q.k = (Hq).(Hk). Keys are quantized rotated, so a feature that is an
// outlier in every position (real models' keys have some) spreads over the
// head instead of stretching its group's scale, and queries are rotated to
// score them. Values are not: their features have no such outliers, and a
// common offset, which the groups' bias absorbs, would all go into one
// rotated feature. On SmolLM2-135M, 4-bit keys rotated raise the perplexity
// of a document 6.2% instead of 12%, and 8-bit 0.0007% instead of 0.0015%;
// rotating values too cost 8-bit 0.07%.
void rotate(float* x, int n) {
  for (int h = 1; h < n; h *= 2)
    for (int i = 0; i < n; i += 2 * h)
      for (int j = i; j < i + h; ++j) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
  const float norm = static_cast<float>(1.0 / std::sqrt(static_cast<double>(n)));
  for (int j = 0; j < n; ++j) x[j] *= norm;
}

// The largest head size a cache of codes takes (the rotation's scratch).
constexpr int kMaxCodedHead = 1024;

// Quantizes one position's features (`from`, `fd` apart) into one head's bytes.
void quantize_position(const CodeLayout& l, uint8_t* head, int p, const float* from, int64_t fd) {
  float x[kMaxCodedHead];
  for (int d = 0; d < l.dim; ++d) x[d] = from[d * fd];
  if (l.rotated()) rotate(x, l.dim);
  for (int g = 0; g < l.dim / l.group; ++g) {
    const float* xg = x + g * l.group;
    float lo = xg[0], hi = xg[0];
    for (int d = 1; d < l.group; ++d) {
      lo = std::min(lo, xg[d]);
      hi = std::max(hi, xg[d]);
    }
    const float levels = static_cast<float>(l.mask());
    const float scale = (hi - lo) / levels;
    const float inv = scale > 0.f ? 1.f / scale : 0.f;
    for (int d = 0; d < l.group; ++d) {
      const int c = static_cast<int>(std::lrint(std::clamp((xg[d] - lo) * inv, 0.f, levels)));
      const CodeAt at = l.code(p, g * l.group + d);
      uint8_t& byte = head[at.byte];
      byte = static_cast<uint8_t>((byte & ~(l.mask() << at.shift)) | (c << at.shift));
    }
    store_f32(head + l.scale(p, g), scale);
    store_f32(head + l.bias(p, g), lo);
  }
}

// One KV head's cache of codes; `p` starts at head 0 (null: the row's cache is float32).
struct CodesView {
  const uint8_t* p;
  int64_t head;
};

struct RowKV {
  CacheView k, v;    // float32 caches
  CodesView kc, vc;  // or ones of codes (kc.p non-null)
  int start, n, kv_len, first;
};

struct Attention {
  TokenView q;
  std::vector<RowKV> rows;
  float* out;  // [T, n_heads * dim], row-contiguous
  int n_heads, kv_heads, dim;
  float scale;
  int window;           // keys a query sees, itself included; 0: all before it
  bool keys_in_blocks;  // every row's keys are row-contiguous and stored in blocks
  CodeLayout key_codes, value_codes;  // for rows whose caches hold codes
};

// The per-block steps, in a portable and an AVX-512 version.
struct BlockOps {
  // kt[d * kKeyBlock + j] = feature d of key j0 + j; columns kb.. are zero.
  void (*pack_keys)(const CacheView& k, int j0, int kb, int dim, float* kt);
  // s[m * kKeyBlock + j] = q[m] . key j, for m < rows and all kKeyBlock columns.
  void (*scores)(const float* q, int rows, int dim, const float* kt, float* s);
  // Online-softmax step for one query over one block whose scores lo .. lim - 1
  // are visible: turns s into probabilities relative to the updated running
  // max (zero outside lo .. lim - 1), updates *max and *sum, and returns the
  // factor by which the query's earlier output must be rescaled.
  float (*softmax_row)(float* s, int lo, int lim, float* max, float* sum);
  // o[m] = alpha[m] * o[m] + sum_{j < kb} p[m][j] * v[j], v rows v_pos apart.
  void (*accumulate)(const float* p, int rows, int kb, const float* v, int64_t v_pos, int dim, const float* alpha, float* o);
  // Caches of codes, from one head's bytes: kt as pack_keys fills it, for the
  // block at j0 (columns kb.. zero or, from a block stored whole, stale);
  // v[j * dim + d] = feature d of position j0 + j, for j < kb.
  void (*dequantize_keys)(const CodeLayout& l, const uint8_t* head, int j0, int kb, float* kt);
  void (*dequantize_values)(const CodeLayout& l, const uint8_t* head, int j0, int kb, float* v);
};

// ---- portable versions (also the fallback for head sizes not a multiple of 16)

void pack_keys_scalar(const CacheView& k, int j0, int kb, int dim, float* kt) {
  for (int d = 0; d < dim; ++d) {
    float* row = kt + static_cast<size_t>(d) * kKeyBlock;
    for (int j = 0; j < kb; ++j) row[j] = k.p[(j0 + j) * k.pos + d * k.d];
    std::fill(row + kb, row + kKeyBlock, 0.f);
  }
}

void scores_scalar(const float* q, int rows, int dim, const float* kt, float* s) {
  for (int m = 0; m < rows; ++m) {
    float* sm = s + static_cast<size_t>(m) * kKeyBlock;
    std::fill(sm, sm + kKeyBlock, 0.f);
    for (int d = 0; d < dim; ++d) {
      const float qd = q[static_cast<size_t>(m) * dim + d];
      const float* kd = kt + static_cast<size_t>(d) * kKeyBlock;
      for (int j = 0; j < kKeyBlock; ++j) sm[j] += qd * kd[j];
    }
  }
}

float softmax_row_scalar(float* s, int lo, int lim, float* max, float* sum) {
  if (lim <= lo) {
    std::fill(s, s + kKeyBlock, 0.f);
    return 1.f;
  }
  const float block_max = *std::max_element(s + lo, s + lim);
  const float m = std::max(*max, block_max);
  const float alpha = std::exp(*max - m);  // 0 on a query's first block (max = -inf)
  float total = 0.f;
  for (int j = lo; j < lim; ++j) total += s[j] = std::exp(s[j] - m);
  std::fill(s, s + lo, 0.f);
  std::fill(s + lim, s + kKeyBlock, 0.f);
  *sum = *sum * alpha + total;
  *max = m;
  return alpha;
}

void accumulate_scalar(const float* p, int rows, int kb, const float* v, int64_t v_pos, int dim, const float* alpha, float* o) {
  for (int m = 0; m < rows; ++m) {
    float* om = o + static_cast<size_t>(m) * dim;
    for (int d = 0; d < dim; ++d) om[d] *= alpha[m];
    for (int j = 0; j < kb; ++j) {
      const float pj = p[static_cast<size_t>(m) * kKeyBlock + j];
      const float* vj = v + j * v_pos;
      for (int d = 0; d < dim; ++d) om[d] += pj * vj[d];
    }
  }
}

void dequantize_keys_scalar(const CodeLayout& l, const uint8_t* head, int j0, int kb, float* kt) {
  for (int d = 0; d < l.dim; ++d) {
    float* row = kt + static_cast<size_t>(d) * kKeyBlock;
    for (int j = 0; j < kb; ++j) row[j] = code_value(l, head, j0 + j, d);
    std::fill(row + kb, row + kKeyBlock, 0.f);
  }
}

void dequantize_values_scalar(const CodeLayout& l, const uint8_t* head, int j0, int kb, float* v) {
  for (int j = 0; j < kb; ++j)
    for (int d = 0; d < l.dim; ++d) v[static_cast<size_t>(j) * l.dim + d] = code_value(l, head, j0 + j, d);
}

// ---- AVX-512 versions (head size and groups multiples of 16; 4-bit codes: head size a multiple of 32)

// Transposes the 16x16 block held in r (r[i] = row i) in registers:
// interleave pairs of rows, then pairs of pairs, then 128-bit lanes.
__attribute__((target("avx512f")))
inline void transpose16(__m512 r[16]) {
  __m512 t[16], u[16];
#pragma GCC unroll 16
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  // u[4i + k], 128-bit lane L: column 4L + k of rows 4i .. 4i + 3.
#pragma GCC unroll 16
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
    const __m512d c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
    u[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    u[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    u[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    u[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  // Output row 4L + k gathers lane L of u[k], u[4 + k], u[8 + k], u[12 + k].
#pragma GCC unroll 16
  for (int k = 0; k < 4; ++k) {
    const __m512 even0 = _mm512_shuffle_f32x4(u[k], u[4 + k], 0x88), odd0 = _mm512_shuffle_f32x4(u[k], u[4 + k], 0xDD);
    const __m512 even1 = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0x88), odd1 = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0xDD);
    r[k] = _mm512_shuffle_f32x4(even0, even1, 0x88);
    r[8 + k] = _mm512_shuffle_f32x4(even0, even1, 0xDD);
    r[4 + k] = _mm512_shuffle_f32x4(odd0, odd1, 0x88);
    r[12 + k] = _mm512_shuffle_f32x4(odd0, odd1, 0xDD);
  }
}

__attribute__((target("avx512f")))
void pack_keys_avx512(const CacheView& k, int j0, int kb, int dim, float* kt) {
  if (k.d != 1) return pack_keys_scalar(k, j0, kb, dim, kt);
  for (int jt = 0; jt < kKeyBlock; jt += 16) {
    for (int dt = 0; dt < dim; dt += 16) {
      __m512 r[16];
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i)
        r[i] = jt + i < kb ? _mm512_loadu_ps(k.p + (j0 + jt + i) * k.pos + dt) : _mm512_setzero_ps();
      transpose16(r);
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) _mm512_storeu_ps(kt + static_cast<size_t>(dt + i) * kKeyBlock + jt, r[i]);
    }
  }
}

// R query rows against the block's 64 keys: 4R accumulators, one broadcast
// of each query feature per 4 FMAs.
template <int R>
__attribute__((target("avx512f")))
void scores_tile(const float* q, int dim, const float* kt, float* s) {
  __m512 acc[R][4];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int d = 0; d < dim; ++d) {
    const float* kd = kt + static_cast<size_t>(d) * kKeyBlock;
    const __m512 k0 = _mm512_loadu_ps(kd), k1 = _mm512_loadu_ps(kd + 16), k2 = _mm512_loadu_ps(kd + 32), k3 = _mm512_loadu_ps(kd + 48);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512 qd = _mm512_set1_ps(q[static_cast<size_t>(r) * dim + d]);
      acc[r][0] = _mm512_fmadd_ps(qd, k0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(qd, k1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(qd, k2, acc[r][2]);
      acc[r][3] = _mm512_fmadd_ps(qd, k3, acc[r][3]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(s + static_cast<size_t>(r) * kKeyBlock + 16 * c, acc[r][c]);
}

__attribute__((target("avx512f")))
void scores_avx512(const float* q, int rows, int dim, const float* kt, float* s) {
  int m = 0;
  for (; m + 4 <= rows; m += 4) scores_tile<4>(q + static_cast<size_t>(m) * dim, dim, kt, s + static_cast<size_t>(m) * kKeyBlock);
  const float* qm = q + static_cast<size_t>(m) * dim;
  float* sm = s + static_cast<size_t>(m) * kKeyBlock;
  switch (rows - m) {
    case 3: scores_tile<3>(qm, dim, kt, sm); break;
    case 2: scores_tile<2>(qm, dim, kt, sm); break;
    case 1: scores_tile<1>(qm, dim, kt, sm); break;
    default: break;
  }
}

__attribute__((target("avx512f")))
float softmax_row_avx512(float* s, int lo, int lim, float* max, float* sum) {
  if (lim <= lo) {
#pragma GCC unroll 16
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(s + 16 * c, _mm512_setzero_ps());
    return 1.f;
  }
  __mmask16 visible[4];
  __m512 v[4];
  __m512 best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
#pragma GCC unroll 16
  for (int c = 0; c < 4; ++c) {
    // Columns below k of this vector, for k = lim (seen) and k = lo (not).
    auto below = [c](int k) -> __mmask16 {
      const int left = k - 16 * c;
      return left >= 16 ? 0xFFFF : left > 0 ? static_cast<__mmask16>((1u << left) - 1) : 0;
    };
    visible[c] = below(lim) & static_cast<__mmask16>(~below(lo));
    v[c] = _mm512_loadu_ps(s + 16 * c);
    best = _mm512_mask_max_ps(best, visible[c], best, v[c]);
  }
  const float m = std::max(*max, _mm512_reduce_max_ps(best));
  const float alpha = std::exp(*max - m);  // 0 on a query's first block (max = -inf)
  const __m512 mv = _mm512_set1_ps(m);
  __m512 total = _mm512_setzero_ps();
#pragma GCC unroll 16
  for (int c = 0; c < 4; ++c) {
    const __m512 e = _mm512_maskz_mov_ps(visible[c], exp_nonpositive(_mm512_sub_ps(v[c], mv)));
    _mm512_storeu_ps(s + 16 * c, e);
    total = _mm512_add_ps(total, e);
  }
  *sum = *sum * alpha + _mm512_reduce_add_ps(total);
  *max = m;
  return alpha;
}

// R query rows, NC x 16 output features starting at o / v.
template <int R, int NC>
__attribute__((target("avx512f")))
void accumulate_tile(const float* p, int kb, const float* v, int64_t v_pos, int dim, const float* alpha, float* o) {
  __m512 acc[R][NC];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    const __m512 a = _mm512_set1_ps(alpha[r]);
#pragma GCC unroll 16
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_mul_ps(_mm512_loadu_ps(o + static_cast<size_t>(r) * dim + 16 * c), a);
  }
  for (int j = 0; j < kb; ++j) {
    __m512 vj[NC];
#pragma GCC unroll 16
    for (int c = 0; c < NC; ++c) vj[c] = _mm512_loadu_ps(v + j * v_pos + 16 * c);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512 pj = _mm512_set1_ps(p[static_cast<size_t>(r) * kKeyBlock + j]);
#pragma GCC unroll 16
      for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_fmadd_ps(pj, vj[c], acc[r][c]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(o + static_cast<size_t>(r) * dim + 16 * c, acc[r][c]);
}

template <int R>
__attribute__((target("avx512f")))
void accumulate_rows(const float* p, int kb, const float* v, int64_t v_pos, int dim, const float* alpha, float* o) {
  int f = 0;
  for (; f + 64 <= dim; f += 64) accumulate_tile<R, 4>(p, kb, v + f, v_pos, dim, alpha, o + f);
  for (; f < dim; f += 16) accumulate_tile<R, 1>(p, kb, v + f, v_pos, dim, alpha, o + f);
}

__attribute__((target("avx512f")))
void accumulate_avx512(const float* p, int rows, int kb, const float* v, int64_t v_pos, int dim, const float* alpha, float* o) {
  int m = 0;
  for (; m + 4 <= rows; m += 4)
    accumulate_rows<4>(p + static_cast<size_t>(m) * kKeyBlock, kb, v, v_pos, dim, alpha + m, o + static_cast<size_t>(m) * dim);
  const float* pm = p + static_cast<size_t>(m) * kKeyBlock;
  float* om = o + static_cast<size_t>(m) * dim;
  switch (rows - m) {
    case 3: accumulate_rows<3>(pm, kb, v, v_pos, dim, alpha + m, om); break;
    case 2: accumulate_rows<2>(pm, kb, v, v_pos, dim, alpha + m, om); break;
    case 1: accumulate_rows<1>(pm, kb, v, v_pos, dim, alpha + m, om); break;
    default: break;
  }
}

// The 16 codes of `Bits` bits in the 16 bytes at c (4-bit: the nibbles at `shift`), as floats.
template <int Bits>
__attribute__((target("avx512f")))
inline __m512 codes16(const uint8_t* c, int shift) {
  __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c)));
  if constexpr (Bits == 4) x = _mm512_and_si512(_mm512_srlv_epi32(x, _mm512_set1_epi32(shift)), _mm512_set1_epi32(15));
  return _mm512_cvtepi32_ps(x);
}

// (Bits a template argument: a code's byte and shift are then found without
// the division CodeLayout::code makes, which cost as much as the expansion.)
template <int Bits>
__attribute__((target("avx512f")))
void dequantize_keys_avx512(const CodeLayout& l, const uint8_t* head, int j0, int kb, float* kt) {
  // A block stored whole is already [feature][position]: one pass, 16 positions a vector.
  if (!l.in_blocks) return dequantize_keys_scalar(l, head, j0, kb, kt);
  constexpr int stripe = kKeyBlock * Bits / 8;  // one feature's codes of the block
  const uint8_t* block = head + l.block(j0);
  const float* scales = reinterpret_cast<const float*>(head + l.scale(j0, 0));  // group g: 64 scales, then 64 biases
  for (int g = 0; g < l.dim / l.group; ++g) {
    const float* scale = scales + 2 * g * kKeyBlock;
    const float* bias = scale + kKeyBlock;
#pragma GCC unroll 4
    for (int c = 0; c < kKeyBlock; c += 16) {
      const __m512 sc = _mm512_loadu_ps(scale + c), bi = _mm512_loadu_ps(bias + c);
      const int byte = c % stripe, shift = c < stripe ? 0 : 4;
      for (int d = g * l.group; d < (g + 1) * l.group; ++d)
        _mm512_storeu_ps(kt + static_cast<size_t>(d) * kKeyBlock + c, _mm512_fmadd_ps(codes16<Bits>(block + static_cast<size_t>(d) * stripe + byte, shift), sc, bi));
    }
  }
}

template <int Bits>
__attribute__((target("avx512f")))
void dequantize_values_avx512(const CodeLayout& l, const uint8_t* head, int j0, int kb, float* v) {
  const int half = l.dim / 2;  // 4-bit: features d and d + half share byte d
  for (int j = 0; j < kb; ++j) {
    const uint8_t* row = head + static_cast<int64_t>(j0 + j) * l.width;
    const uint8_t* scales = row + l.codes_bytes();
    float* out = v + static_cast<size_t>(j) * l.dim;
    for (int g = 0; g < l.dim / l.group; ++g) {
      const __m512 sc = _mm512_set1_ps(load_f32(scales + 8 * g)), bi = _mm512_set1_ps(load_f32(scales + 8 * g + 4));
      for (int d = g * l.group; d < (g + 1) * l.group; d += 16) {
        const bool high = Bits == 4 && d >= half;
        _mm512_storeu_ps(out + d, _mm512_fmadd_ps(codes16<Bits>(row + (high ? d - half : d), high ? 4 : 0), sc, bi));
      }
    }
  }
}

// ---- AVX2 versions (head size and groups multiples of 8; 4-bit codes:
// head size a multiple of 16), for CPUs without AVX-512: the same steps on
// 8 lanes, score and output tiles sized to AVX2's 16 registers.

// Transposes the 8x8 block held in r (r[i] = row i) in registers.
__attribute__((target("avx2,fma")))
inline void transpose8(__m256 r[8]) {
  __m256 t[8], u[8];
#pragma GCC unroll 8
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
#pragma GCC unroll 8
  for (int i = 0; i < 2; ++i) {
    const __m256d a = _mm256_castps_pd(t[4 * i]), b = _mm256_castps_pd(t[4 * i + 1]);
    const __m256d c = _mm256_castps_pd(t[4 * i + 2]), d = _mm256_castps_pd(t[4 * i + 3]);
    u[4 * i] = _mm256_castpd_ps(_mm256_unpacklo_pd(a, c));
    u[4 * i + 1] = _mm256_castpd_ps(_mm256_unpackhi_pd(a, c));
    u[4 * i + 2] = _mm256_castpd_ps(_mm256_unpacklo_pd(b, d));
    u[4 * i + 3] = _mm256_castpd_ps(_mm256_unpackhi_pd(b, d));
  }
  // u[k] holds column k of rows 0-3 (low lane: columns 0-3's k, high: 4-7's) and u[4 + k] of rows 4-7.
#pragma GCC unroll 8
  for (int k = 0; k < 4; ++k) {
    r[k] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x20);
    r[4 + k] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x31);
  }
}

__attribute__((target("avx2,fma")))
void pack_keys_avx2(const CacheView& k, int j0, int kb, int dim, float* kt) {
  if (k.d != 1) return pack_keys_scalar(k, j0, kb, dim, kt);
  for (int jt = 0; jt < kKeyBlock; jt += 8) {
    for (int dt = 0; dt < dim; dt += 8) {
      __m256 r[8];
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) r[i] = jt + i < kb ? _mm256_loadu_ps(k.p + (j0 + jt + i) * k.pos + dt) : _mm256_setzero_ps();
      transpose8(r);
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) _mm256_storeu_ps(kt + static_cast<size_t>(dt + i) * kKeyBlock + jt, r[i]);
    }
  }
}

// R query rows against 32 of the block's keys (from column c0).
template <int R>
__attribute__((target("avx2,fma")))
void scores_tile_avx2(const float* q, int dim, const float* kt, int c0, float* s) {
  __m256 acc[R][4];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int d = 0; d < dim; ++d) {
    const float* kd = kt + static_cast<size_t>(d) * kKeyBlock + c0;
    const __m256 k0 = _mm256_loadu_ps(kd), k1 = _mm256_loadu_ps(kd + 8), k2 = _mm256_loadu_ps(kd + 16), k3 = _mm256_loadu_ps(kd + 24);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 qd = _mm256_set1_ps(q[static_cast<size_t>(r) * dim + d]);
      acc[r][0] = _mm256_fmadd_ps(qd, k0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(qd, k1, acc[r][1]);
      acc[r][2] = _mm256_fmadd_ps(qd, k2, acc[r][2]);
      acc[r][3] = _mm256_fmadd_ps(qd, k3, acc[r][3]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < 4; ++c) _mm256_storeu_ps(s + static_cast<size_t>(r) * kKeyBlock + c0 + 8 * c, acc[r][c]);
}

__attribute__((target("avx2,fma")))
void scores_avx2(const float* q, int rows, int dim, const float* kt, float* s) {
  for (int c0 = 0; c0 < kKeyBlock; c0 += 32) {
    int m = 0;
    for (; m + 2 <= rows; m += 2) scores_tile_avx2<2>(q + static_cast<size_t>(m) * dim, dim, kt, c0, s + static_cast<size_t>(m) * kKeyBlock);
    if (m < rows) scores_tile_avx2<1>(q + static_cast<size_t>(m) * dim, dim, kt, c0, s + static_cast<size_t>(m) * kKeyBlock);
  }
}

__attribute__((target("avx2,fma")))
inline float max_lanes(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}


__attribute__((target("avx2,fma")))
float softmax_row_avx2(float* s, int lo, int lim, float* max, float* sum) {
  if (lim <= lo) {
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) _mm256_storeu_ps(s + 8 * c, _mm256_setzero_ps());
    return 1.f;
  }
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256 visible[8], v[8];
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 best = neg_inf;
#pragma GCC unroll 8
  for (int c = 0; c < 8; ++c) {
    // Column 8c + lane is seen when lo <= it < lim.
    const __m256i col = _mm256_add_epi32(lane, _mm256_set1_epi32(8 * c));
    const __m256i seen = _mm256_andnot_si256(_mm256_cmpgt_epi32(_mm256_set1_epi32(lo), col), _mm256_cmpgt_epi32(_mm256_set1_epi32(lim), col));
    visible[c] = _mm256_castsi256_ps(seen);
    v[c] = _mm256_loadu_ps(s + 8 * c);
    best = _mm256_max_ps(best, _mm256_blendv_ps(neg_inf, v[c], visible[c]));
  }
  const float m = std::max(*max, max_lanes(best));
  const float alpha = std::exp(*max - m);  // 0 on a query's first block (max = -inf)
  const __m256 mv = _mm256_set1_ps(m);
  __m256 total = _mm256_setzero_ps();
#pragma GCC unroll 8
  for (int c = 0; c < 8; ++c) {
    const __m256 e = _mm256_and_ps(visible[c], exp_nonpositive_avx2(_mm256_sub_ps(_mm256_min_ps(v[c], mv), mv)));
    _mm256_storeu_ps(s + 8 * c, e);
    total = _mm256_add_ps(total, e);
  }
  *sum = *sum * alpha + sum_lanes(total);
  *max = m;
  return alpha;
}

// R query rows, NC x 8 output features starting at o / v.
template <int R, int NC>
__attribute__((target("avx2,fma")))
void accumulate_tile_avx2(const float* p, int kb, const float* v, int64_t v_pos, int dim, const float* alpha, float* o) {
  __m256 acc[R][NC];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const __m256 a = _mm256_set1_ps(alpha[r]);
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm256_mul_ps(_mm256_loadu_ps(o + static_cast<size_t>(r) * dim + 8 * c), a);
  }
  for (int j = 0; j < kb; ++j) {
    __m256 vj[NC];
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) vj[c] = _mm256_loadu_ps(v + j * v_pos + 8 * c);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 pj = _mm256_set1_ps(p[static_cast<size_t>(r) * kKeyBlock + j]);
#pragma GCC unroll 8
      for (int c = 0; c < NC; ++c) acc[r][c] = _mm256_fmadd_ps(pj, vj[c], acc[r][c]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) _mm256_storeu_ps(o + static_cast<size_t>(r) * dim + 8 * c, acc[r][c]);
}

template <int R>
__attribute__((target("avx2,fma")))
void accumulate_rows_avx2(const float* p, int kb, const float* v, int64_t v_pos, int dim, const float* alpha, float* o) {
  int f = 0;
  for (; f + 32 <= dim; f += 32) accumulate_tile_avx2<R, 4>(p, kb, v + f, v_pos, dim, alpha, o + f);
  for (; f < dim; f += 8) accumulate_tile_avx2<R, 1>(p, kb, v + f, v_pos, dim, alpha, o + f);
}

__attribute__((target("avx2,fma")))
void accumulate_avx2(const float* p, int rows, int kb, const float* v, int64_t v_pos, int dim, const float* alpha, float* o) {
  int m = 0;
  for (; m + 2 <= rows; m += 2)
    accumulate_rows_avx2<2>(p + static_cast<size_t>(m) * kKeyBlock, kb, v, v_pos, dim, alpha + m, o + static_cast<size_t>(m) * dim);
  if (m < rows) accumulate_rows_avx2<1>(p + static_cast<size_t>(m) * kKeyBlock, kb, v, v_pos, dim, alpha + m, o + static_cast<size_t>(m) * dim);
}

// The 8 codes of `Bits` bits in the 8 bytes at c (4-bit: the nibbles at `shift`), as floats.
template <int Bits>
__attribute__((target("avx2,fma")))
inline __m256 codes8(const uint8_t* c, int shift) {
  __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c)));
  if constexpr (Bits == 4) x = _mm256_and_si256(_mm256_srlv_epi32(x, _mm256_set1_epi32(shift)), _mm256_set1_epi32(15));
  return _mm256_cvtepi32_ps(x);
}

template <int Bits>
__attribute__((target("avx2,fma")))
void dequantize_keys_avx2(const CodeLayout& l, const uint8_t* head, int j0, int kb, float* kt) {
  if (!l.in_blocks) return dequantize_keys_scalar(l, head, j0, kb, kt);
  constexpr int stripe = kKeyBlock * Bits / 8;  // one feature's codes of the block
  const uint8_t* block = head + l.block(j0);
  const float* scales = reinterpret_cast<const float*>(head + l.scale(j0, 0));  // group g: 64 scales, then 64 biases
  for (int g = 0; g < l.dim / l.group; ++g) {
    const float* scale = scales + 2 * g * kKeyBlock;
    const float* bias = scale + kKeyBlock;
    for (int c = 0; c < kKeyBlock; c += 8) {
      const __m256 sc = _mm256_loadu_ps(scale + c), bi = _mm256_loadu_ps(bias + c);
      const int byte = c % stripe, shift = c < stripe ? 0 : 4;
      for (int d = g * l.group; d < (g + 1) * l.group; ++d)
        _mm256_storeu_ps(kt + static_cast<size_t>(d) * kKeyBlock + c, _mm256_fmadd_ps(codes8<Bits>(block + static_cast<size_t>(d) * stripe + byte, shift), sc, bi));
    }
  }
}

template <int Bits>
__attribute__((target("avx2,fma")))
void dequantize_values_avx2(const CodeLayout& l, const uint8_t* head, int j0, int kb, float* v) {
  const int half = l.dim / 2;  // 4-bit: features d and d + half share byte d
  for (int j = 0; j < kb; ++j) {
    const uint8_t* row = head + static_cast<int64_t>(j0 + j) * l.width;
    const uint8_t* scales = row + l.codes_bytes();
    float* out = v + static_cast<size_t>(j) * l.dim;
    for (int g = 0; g < l.dim / l.group; ++g) {
      const __m256 sc = _mm256_set1_ps(load_f32(scales + 8 * g)), bi = _mm256_set1_ps(load_f32(scales + 8 * g + 4));
      for (int d = g * l.group; d < (g + 1) * l.group; d += 8) {
        const bool high = Bits == 4 && d >= half;
        _mm256_storeu_ps(out + d, _mm256_fmadd_ps(codes8<Bits>(row + (high ? d - half : d), high ? 4 : 0), sc, bi));
      }
    }
  }
}

const BlockOps& block_ops(int dim, int group, int bits) {
  static const BlockOps portable{pack_keys_scalar, scores_scalar, softmax_row_scalar, accumulate_scalar, dequantize_keys_scalar, dequantize_values_scalar};
  static const BlockOps avx512{pack_keys_avx512, scores_avx512, softmax_row_avx512, accumulate_avx512, dequantize_keys_avx512<8>, dequantize_values_avx512<8>};
  static const BlockOps avx512_4bit{pack_keys_avx512, scores_avx512, softmax_row_avx512, accumulate_avx512, dequantize_keys_avx512<4>, dequantize_values_avx512<4>};
  static const BlockOps avx2{pack_keys_avx2, scores_avx2, softmax_row_avx2, accumulate_avx2, dequantize_keys_avx2<8>, dequantize_values_avx2<8>};
  static const BlockOps avx2_4bit{pack_keys_avx2, scores_avx2, softmax_row_avx2, accumulate_avx2, dequantize_keys_avx2<4>, dequantize_values_avx2<4>};
  // n codes a vector (16 on AVX-512, 8 on AVX2): a group's run of n
  // features, and (4-bit) half a position's features, stay whole.
  const auto fits = [&](int n) { return dim % n == 0 && group % n == 0 && (bits != 4 || dim % (2 * n) == 0); };
  if (isa_at_least(Isa::Avx512) && fits(16)) return bits == 4 ? avx512_4bit : avx512;
  if (isa_at_least(Isa::Avx2) && fits(8)) return bits == 4 ? avx2_4bit : avx2;
  return portable;
}

// ---- the work items

struct Item {
  int row, group, q0, q1;  // queries q0 .. q1 - 1 of `row`, KV head `group`
  int64_t cost;            // query-key pairs scored
};

// Per-thread buffers, grown to the largest item seen and then reused.
struct Scratch {
  std::vector<float> q, kt, s, o, v, max, sum, alpha;
  void fit(int rows, int dim) {
    auto grow = [](std::vector<float>& b, size_t n) {
      if (b.size() < n) b.resize(n);
    };
    grow(q, static_cast<size_t>(rows) * dim);
    grow(kt, static_cast<size_t>(dim) * kKeyBlock);
    grow(s, static_cast<size_t>(rows) * kKeyBlock);
    grow(o, static_cast<size_t>(rows) * dim);
    grow(v, static_cast<size_t>(kKeyBlock) * dim);
    grow(max, rows);
    grow(sum, rows);
    grow(alpha, rows);
  }
};

Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

void attend_item(const Attention& a, const BlockOps& ops, const Item& it) {
  const RowKV& row = a.rows[it.row];
  const int group = a.n_heads / a.kv_heads, dim = a.dim;
  const int rows = (it.q1 - it.q0) * group;  // query vector m is token q0 + m / group, head m % group of the group
  const int offset = row.kv_len - row.n;     // position of the row's first query
  Scratch& s = scratch();
  s.fit(rows, dim);

  for (int m = 0; m < rows; ++m) {
    const int token = row.start + it.q0 + m / group, head = it.group * group + m % group;
    const float* src = a.q.p + token * a.q.tok + head * a.q.head;
    float* dst = s.q.data() + static_cast<size_t>(m) * dim;
    for (int d = 0; d < dim; ++d) dst[d] = src[d * a.q.d] * a.scale;
  }
  // Codes hold rotated keys (see rotate): scored by rotated queries.
  if (row.kc.p && a.key_codes.rotated())
    for (int m = 0; m < rows; ++m) rotate(s.q.data() + static_cast<size_t>(m) * dim, dim);
  std::fill(s.o.begin(), s.o.begin() + static_cast<size_t>(rows) * dim, 0.f);
  std::fill(s.max.begin(), s.max.begin() + rows, -std::numeric_limits<float>::infinity());
  std::fill(s.sum.begin(), s.sum.begin() + rows, 0.f);

  CacheView k = row.k, v = row.v;  // (null for caches of codes)
  if (k.p) k.p += it.group * k.head;
  if (v.p) v.p += it.group * v.head;
  // Keys past the one the item's last query sees are never scored, nor
  // (with a window) blocks wholly before the first one its first query sees.
  // j0 and end are cache indices: position p is at index p - row.first.
  const int end = offset + it.q1 - row.first;
  const int start = a.window > 0 ? std::max(0, offset + it.q0 - a.window + 1 - row.first) / kKeyBlock * kKeyBlock : 0;
  for (int j0 = start; j0 < end; j0 += kKeyBlock) {
    const int kb = std::min(kKeyBlock, end - j0);
    // A stored block is whole (capacity is a multiple of the block); its
    // columns past kb are stale or zero, scored, and masked by softmax_row.
    const float* kt;
    if (row.kc.p) {
      ops.dequantize_keys(a.key_codes, row.kc.p + it.group * row.kc.head, j0, kb, s.kt.data());
      kt = s.kt.data();
    } else if (!a.keys_in_blocks) {
      ops.pack_keys(k, j0, kb, dim, s.kt.data());
      kt = s.kt.data();
    } else {
      kt = k.p + static_cast<size_t>(j0) * dim;
    }
    ops.scores(s.q.data(), rows, dim, kt, s.s.data());
    for (int m = 0; m < rows; ++m) {
      const int index = offset + it.q0 + m / group - row.first - j0;  // the query's own key, in this block's columns
      const int lo = a.window > 0 ? index - a.window + 1 : 0;
      s.alpha[m] = ops.softmax_row(s.s.data() + static_cast<size_t>(m) * kKeyBlock, std::clamp(lo, 0, kb), std::clamp(index + 1, 0, kb), &s.max[m], &s.sum[m]);
    }
    const float* vb;
    int64_t v_pos = v.pos;
    if (row.vc.p) {
      ops.dequantize_values(a.value_codes, row.vc.p + it.group * row.vc.head, j0, kb, s.v.data());
      vb = s.v.data();
      v_pos = dim;
    } else if (v.d != 1) {  // features not adjacent: gather the block's values first
      const float* from = v.p + j0 * v.pos;
      for (int j = 0; j < kb; ++j)
        for (int d = 0; d < dim; ++d) s.v[static_cast<size_t>(j) * dim + d] = from[j * v.pos + d * v.d];
      vb = s.v.data();
      v_pos = dim;
    } else {
      vb = v.p + j0 * v.pos;
    }
    ops.accumulate(s.s.data(), rows, kb, vb, v_pos, dim, s.alpha.data(), s.o.data());
  }

  const int width = a.n_heads * dim;
  for (int m = 0; m < rows; ++m) {
    const int token = row.start + it.q0 + m / group, head = it.group * group + m % group;
    const float inv = 1.f / s.sum[m];  // sum >= 1: the running max's own term
    const float* src = s.o.data() + static_cast<size_t>(m) * dim;
    float* dst = a.out + static_cast<size_t>(token) * width + static_cast<size_t>(head) * dim;
    for (int d = 0; d < dim; ++d) dst[d] = src[d] * inv;
  }
}

void attend(const Attention& a) {
  const BlockOps& ops = block_ops(a.dim, a.key_codes.group, a.key_codes.bits);
  const int group = a.n_heads / a.kv_heads;
  const int block = std::max(1, kItemRows / group);  // query tokens per item
  std::vector<Item> items;
  for (int r = 0; r < static_cast<int>(a.rows.size()); ++r) {
    const RowKV& row = a.rows[r];
    for (int q0 = 0; q0 < row.n; q0 += block) {
      const int q1 = std::min(row.n, q0 + block);
      const int last_key = row.kv_len - row.n + q1 - row.first;
      const int keys = a.window > 0 ? std::min(last_key, a.window + q1 - q0) : last_key;
      for (int g = 0; g < a.kv_heads; ++g) items.push_back({r, g, q0, q1, static_cast<int64_t>(keys) * (q1 - q0)});
    }
  }
  // Largest first, so the last items to start are small and cores finish together.
  std::stable_sort(items.begin(), items.end(), [](const Item& x, const Item& y) { return x.cost > y.cost; });
  RowPool::get().run(static_cast<int>(items.size()), 1, [&](int b, int e) {
    for (int i = b; i < e; ++i) attend_item(a, ops, items[i]);
  });
}

// The head size of a cache of `dtype` and last dimension `width`: width
// itself for float32, or what quantized_width(dim, group, bits) maps to
// width (0: none).
int head_dim_of(mx::Dtype dtype, int width, int group, int bits) {
  if (dtype == mx::float32) return width;
  if (dtype != mx::uint8 || group <= 0 || (bits != 8 && bits != 4)) return 0;
  // width = dim * bits / 8 + 8 * dim / group, so dim = 8 * group * width / (bits * group + 64).
  const int64_t num = 8LL * group * width, den = static_cast<int64_t>(bits) * group + 64;
  const int dim = num % den == 0 ? static_cast<int>(num / den) : 0;
  return dim > 0 && dim <= kMaxCodedHead && dim % group == 0 && (bits == 8 || dim % 2 == 0) && quantized_width(dim, group, bits) == width ? dim : 0;
}

// The attention of a step whose queries are `q` (n_heads heads) over
// `caches` (each row's keys, then values: evaluated, so their data pointers
// and strides are final; shapes were checked when the primitive was built),
// into `out` ([T, n_heads * dim], row-contiguous).
Attention step_attention(const TokenView& q, int n_heads, float* out, const std::vector<mx::array>& caches, const std::vector<AttentionRow>& rows, int window,
                         bool keys_in_blocks, int dim, int group_size, int bits) {
  const int group = group_size > 0 ? group_size : dim;
  const int width = quantized_width(dim, group, bits);
  Attention a{q, {}, out, n_heads, caches[0].shape(1), dim, 1.f / std::sqrt(static_cast<float>(dim)), window, keys_in_blocks,
              CodeLayout{dim, group, width, keys_in_blocks, bits}, CodeLayout{dim, group, width, false, bits}};
  int start = 0;
  for (size_t r = 0; r < rows.size(); ++r) {
    const mx::array &keys = caches[2 * r], &values = caches[2 * r + 1];
    // Blocks are found by offset, so a view of a blocked cache would be misread.
    if (keys_in_blocks && !keys.flags().row_contiguous)
      throw std::invalid_argument("cpu_attention: keys stored in blocks must be a whole, row-contiguous cache");
    RowKV row{{}, {}, {}, {}, start, rows[r].n, rows[r].kv_len, rows[r].first};
    for (auto [cache, floats, codes] : {std::tuple{&keys, &row.k, &row.kc}, std::tuple{&values, &row.v, &row.vc}}) {
      if (cache->dtype() == mx::uint8) {
        // Rows are found by offset too: a position's bytes must be one contiguous row.
        if (cache->strides()[3] != 1 || cache->strides()[2] != width)
          throw std::invalid_argument("cpu_attention: a cache of codes must hold its positions as contiguous rows");
        *codes = {cache->data<uint8_t>(), cache->strides()[1]};
      } else {
        *floats = cache_view(*cache);
      }
    }
    a.rows.push_back(row);
    start += rows[r].n;
  }
  return a;
}

class CpuAttention : public mx::UnaryPrimitive {
 public:
  CpuAttention(mx::Stream s, std::vector<AttentionRow> rows, int window, bool keys_in_blocks, int dim, int group, int bits)
      : mx::UnaryPrimitive(s), rows_(std::move(rows)), window_(window), keys_in_blocks_(keys_in_blocks), dim_(dim), group_(group), bits_(bits) {}

  // in: q, then each row's keys and values.
  void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
    auto& enc = start_cpu_eval(stream(), in, out);
    const std::vector<mx::array> caches(in.begin() + 1, in.end());
    Attention a = step_attention(token_view(in[0], dim_), token_shape(in[0], dim_, "q").second, out.data<float>(), caches, rows_, window_, keys_in_blocks_, dim_, group_, bits_);
    // The task holds the inputs, so the buffers `a` points into outlive it.
    enc.dispatch([in, a = std::move(a)]() { attend(a); });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("cpu_attention runs on the CPU only");
  }

  const char* name() const override { return "TetherCpuAttention"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const CpuAttention*>(&other);
    return o && o->keys_in_blocks_ == keys_in_blocks_ && o->window_ == window_ && o->dim_ == dim_ && o->group_ == group_ && o->bits_ == bits_ && o->rows_.size() == rows_.size() &&
           std::equal(rows_.begin(), rows_.end(), o->rows_.begin(),
                      [](const AttentionRow& x, const AttentionRow& y) { return x.n == y.n && x.kv_len == y.kv_len && x.first == y.first; });
  }

 private:
  std::vector<AttentionRow> rows_;
  int window_;
  bool keys_in_blocks_;
  int dim_, group_, bits_;
};

// ---- cache write

// Copies a [1, H, C, W] array of any strides (a broadcast zero buffer, a
// view) into a row-contiguous buffer of the same shape and element type.
template <typename T>
void copy_cache(const mx::array& src, T* dst) {
  const auto& st = src.strides();
  const T* base = src.data<T>();
  const int heads = src.shape(1), cap = src.shape(2), width = src.shape(3);
  for (int h = 0; h < heads; ++h)
    for (int c = 0; c < cap; ++c) {
      const T* from = base + h * st[1] + c * st[2];
      T* to = dst + (static_cast<size_t>(h) * cap + c) * width;
      if (st[3] == 1) std::memcpy(to, from, sizeof(T) * width);
      else for (int d = 0; d < width; ++d) to[d] = from[d * st[3]];
    }
}

// Writes tokens start .. start + n of `fresh` at positions pos .. of a
// float32 cache's row-contiguous buffer.
void write_floats(const mx::array& cache, const TokenView& f, int start, int n, int pos, bool in_blocks, float* dst) {
  const int heads = cache.shape(1), cap = cache.shape(2), dim = cache.shape(3);
  for (int h = 0; h < heads; ++h)
    for (int i = 0; i < n; ++i) {
      const float* from = f.p + (start + i) * f.tok + h * f.head;
      const int p = pos + i;
      if (in_blocks) {  // feature d of position p: block p / B, row d, column p % B
        float* to = dst + static_cast<size_t>(h) * cap * dim + static_cast<size_t>(p / kKeyBlock) * kKeyBlock * dim + p % kKeyBlock;
        for (int d = 0; d < dim; ++d) to[static_cast<size_t>(d) * kKeyBlock] = from[d * f.d];
      } else {
        float* to = dst + (static_cast<size_t>(h) * cap + p) * dim;
        for (int d = 0; d < dim; ++d) to[d] = from[d * f.d];
      }
    }
}

// Gives `out`, the updated cache, a buffer: the cache's own when nothing
// else can see it (this primitive's input is its last holder: no snapshot,
// no other view) and it is a plain dense buffer, so the write is in place;
// otherwise a fresh one for a copy. Returns whether in place.
bool take_cache_buffer(const mx::array& cache, mx::array& out) {
  const bool in_place = cache.is_donatable() && cache.flags().row_contiguous && cache.data_size() == cache.size();
  if (in_place) out.copy_shared_buffer(cache);
  else out.set_data(mx::allocator::malloc(out.nbytes()));
  return in_place;
}

// MLX gives every output of a multi-output primitive its own copy of the
// input list (array::make_arrays), so while the outputs live, each input is
// held once per output and is_donatable() can never hold: a node with
// outputs beside its caches copied every cache whole on every step. This
// drops the copies held by the outputs other than the one whose list `in`
// is (the list MLX evaluates from, which keeps every input alive until the
// node is done). MLX's detach, right after evaluation, drops them all
// anyway; nothing reads a sibling's inputs in between.
void release_sibling_inputs(const std::vector<mx::array>& in, std::vector<mx::array>& out) {
  for (auto& o : out)
    if (&o.inputs() != &in) o.inputs().clear();
}

// Writes tokens start .. start + n of `f` at positions pos .. of `cache`
// into `raw`, the buffer take_cache_buffer gave the updated cache (copying
// the cache there first unless in place); a uint8 cache takes codes.
void write_cache(const mx::array& cache, uint8_t* raw, bool in_place, const TokenView& f, int start, int n, int pos, bool in_blocks, int dim, int group, int bits) {
  if (cache.dtype() == mx::float32) {
    float* dst = reinterpret_cast<float*>(raw);
    if (!in_place) copy_cache(cache, dst);
    return write_floats(cache, f, start, n, pos, in_blocks, dst);
  }
  if (!in_place) copy_cache(cache, raw);
  const CodeLayout l{dim, group, cache.shape(3), in_blocks, bits};
  const int heads = cache.shape(1);
  const int64_t head_bytes = static_cast<int64_t>(cache.shape(2)) * l.width;
  for (int h = 0; h < heads; ++h)
    for (int i = 0; i < n; ++i) quantize_position(l, raw + h * head_bytes, pos + i, f.p + (start + i) * f.tok + h * f.head, f.d);
}

class CpuKvWrite : public mx::UnaryPrimitive {
 public:
  CpuKvWrite(mx::Stream s, int start, int n, int pos, bool in_blocks, int dim, int group, int bits)
      : mx::UnaryPrimitive(s), start_(start), n_(n), pos_(pos), in_blocks_(in_blocks), dim_(dim), group_(group), bits_(bits) {}

  // in: cache, fresh.
  void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
    const bool in_place = take_cache_buffer(in[0], out);
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (auto& a : in) enc.set_input_array(a);
    enc.set_output_array(out);
    enc.dispatch([in, in_place, start = start_, n = n_, pos = pos_, in_blocks = in_blocks_, dim = dim_, group = group_, bits = bits_, raw = out.data<uint8_t>()]() {
      write_cache(in[0], raw, in_place, token_view(in[1], dim), start, n, pos, in_blocks, dim, group, bits);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("cpu_kv_write runs on the CPU only");
  }

  const char* name() const override { return "TetherCpuKvWrite"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const CpuKvWrite*>(&other);
    return o && o->start_ == start_ && o->n_ == n_ && o->pos_ == pos_ && o->in_blocks_ == in_blocks_ && o->dim_ == dim_ && o->group_ == group_ && o->bits_ == bits_;
  }

 private:
  int start_, n_, pos_;
  bool in_blocks_;
  int dim_, group_, bits_;
};

// ---- one layer's attention as one node

// GCC contracts a * b - c * d into a fused multiply-add even in ISO mode;
// RoPE here must round each product as MLX's separate ops do.
#if defined(__clang__)
#define TETHER_NO_FP_CONTRACT_FN
#define TETHER_NO_FP_CONTRACT_BODY _Pragma("clang fp contract(off)")
#else
#define TETHER_NO_FP_CONTRACT_FN __attribute__((optimize("fp-contract=off")))
#define TETHER_NO_FP_CONTRACT_BODY
#endif

// Rotates heads 0 .. heads - 1 of tokens t0 .. t1 - 1 of `x` into `out`
// ([token][head][feature], contiguous) by `table` (see cpu_layer_attention
// in the header): the pair (a, b) of a head turns to (x_a cos - x_b sin,
// x_a sin + x_b cos), each product rounded alone, as MLX's RoPE on the CPU
// computes it, so the result is the same bit for bit.
TETHER_NO_FP_CONTRACT_FN void rope_heads(const TokenView& x, int t0, int t1, int heads, int dim, const float* table, bool traditional, float* out) {
  TETHER_NO_FP_CONTRACT_BODY
  const int half = dim / 2;
  for (int t = t0; t < t1; ++t) {
    const float* turn = table + static_cast<size_t>(t) * dim;
    for (int h = 0; h < heads; ++h) {
      const float* src = x.p + t * x.tok + h * x.head;
      float* dst = out + (static_cast<size_t>(t) * heads + h) * dim;
      for (int i = 0; i < half; ++i) {
        const int a = traditional ? 2 * i : i, b = traditional ? 2 * i + 1 : half + i;
        const float cos = turn[a], sin = turn[b], xa = src[a * x.d], xb = src[b * x.d];
        const float xa_cos = xa * cos, xb_sin = xb * sin, xa_sin = xa * sin, xb_cos = xb * cos;
        dst[a] = xa_cos - xb_sin;
        dst[b] = xa_sin + xb_cos;
      }
    }
  }
}

// Tokens a pool task turns: a decode step's one token stays on the caller.
constexpr int kRopeTokensPerTask = 16;

// cpu_layer_attention's node: RoPE, the cache writes and the attention of a
// layer in one task. Inputs: qkv, the rope table, each row's keys and
// values; outputs: the attention, each row's updated keys and values (the
// inputs' buffers, written in place, where take_cache_buffer allows).
class CpuLayerAttention : public mx::Primitive {
 public:
  CpuLayerAttention(mx::Stream s, std::vector<AttentionRow> rows, bool traditional, int n_heads, int window, bool keys_in_blocks, int dim, int group, int bits)
      : mx::Primitive(s), rows_(std::move(rows)), traditional_(traditional), n_heads_(n_heads), window_(window), keys_in_blocks_(keys_in_blocks), dim_(dim), group_(group), bits_(bits) {}

  void eval_cpu(const std::vector<mx::array>& in, std::vector<mx::array>& out) override {
    release_sibling_inputs(in, out);
    out[0].set_data(mx::allocator::malloc(out[0].nbytes()));
    std::vector<bool> in_place;
    for (size_t c = 2; c < in.size(); ++c) in_place.push_back(take_cache_buffer(in[c], out[c - 1]));
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (auto& a : in) enc.set_input_array(a);
    for (auto& a : out) enc.set_output_array(a);
    // Attention reads the updated caches: their buffers are set now, filled by the task before it attends.
    const std::vector<mx::array> caches(out.begin() + 1, out.end());
    Attention a = step_attention({}, n_heads_, out[0].data<float>(), caches, rows_, window_, keys_in_blocks_, dim_, group_, bits_);
    std::vector<uint8_t*> raw;
    for (auto it = out.begin() + 1; it != out.end(); ++it) raw.push_back(it->data<uint8_t>());
    // The task holds the inputs, so the buffers it reads outlive it.
    enc.dispatch([in, in_place = std::move(in_place), raw = std::move(raw), a = std::move(a), rows = rows_, traditional = traditional_, dim = dim_, in_blocks = keys_in_blocks_,
                  group = group_, bits = bits_]() mutable {
      const int tokens = in[0].shape(1), heads = a.n_heads + a.kv_heads;  // rotated: queries, then keys
      const TokenView qkv = token_view(in[0], dim);
      std::vector<float> table_scratch, rotated(static_cast<size_t>(tokens) * heads * dim);
      const float* table = row_major_f32(in[1], table_scratch);
      RowPool::get().run(tokens, kRopeTokensPerTask, [&](int b, int e) { rope_heads(qkv, b, e, heads, dim, table, traditional, rotated.data()); });
      const TokenView keys{rotated.data() + static_cast<size_t>(a.n_heads) * dim, static_cast<int64_t>(heads) * dim, dim, 1};
      const TokenView values{qkv.p + (a.n_heads + a.kv_heads) * qkv.head, qkv.tok, qkv.head, qkv.d};
      // Each row's keys and values are written in parallel (a copy, when not in place, is most of it).
      RowPool::get().run(static_cast<int>(raw.size()), 1, [&](int b, int e) {
        for (int c = b; c < e; ++c) {
          const AttentionRow& row = rows[c / 2];
          const bool is_keys = c % 2 == 0;
          write_cache(in[2 + c], raw[c], in_place[c], is_keys ? keys : values, a.rows[c / 2].start, row.n, row.kv_len - row.n - row.first, is_keys && in_blocks, dim, group, bits);
        }
      });
      a.q = {rotated.data(), static_cast<int64_t>(heads) * dim, dim, 1};
      attend(a);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("cpu_layer_attention runs on the CPU only");
  }

  const char* name() const override { return "TetherCpuLayerAttention"; }

 private:
  std::vector<AttentionRow> rows_;
  bool traditional_;
  int n_heads_, window_;
  bool keys_in_blocks_;
  int dim_, group_, bits_;
};

class CpuKvDequantize : public mx::UnaryPrimitive {
 public:
  CpuKvDequantize(mx::Stream s, bool in_blocks, int dim, int group, int bits)
      : mx::UnaryPrimitive(s), in_blocks_(in_blocks), dim_(dim), group_(group), bits_(bits) {}

  // in: the cache; out: [1, H, len, dim].
  void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
    const mx::array& cache = in[0];
    // Positions are found by offset: rows must be contiguous, and blocks whole.
    const bool readable = cache.strides()[3] == 1 && cache.strides()[2] == cache.shape(3) && (!in_blocks_ || cache.flags().row_contiguous);
    if (!readable) throw std::invalid_argument("cpu_kv_dequantize: the cache must be a whole buffer (or, in position order, a slice of positions)");
    auto& enc = start_cpu_eval(stream(), in, out);
    enc.dispatch([in, dst = out.data<float>(), heads = out.shape(1), len = out.shape(2), l = CodeLayout{dim_, group_, in[0].shape(3), in_blocks_, bits_}]() mutable {
      const mx::array& cache = in[0];
      for (int h = 0; h < heads; ++h) {
        const uint8_t* head = cache.data<uint8_t>() + h * cache.strides()[1];
        for (int p = 0; p < len; ++p, dst += l.dim) {
          for (int d = 0; d < l.dim; ++d) dst[d] = code_value(l, head, p, d);
          if (l.rotated()) rotate(dst, l.dim);  // back from the rotation the codes were made in
        }
      }
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("cpu_kv_dequantize runs on the CPU only");
  }

  const char* name() const override { return "TetherCpuKvDequantize"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const CpuKvDequantize*>(&other);
    return o && o->in_blocks_ == in_blocks_ && o->dim_ == dim_ && o->group_ == group_ && o->bits_ == bits_;
  }

 private:
  bool in_blocks_;
  int dim_, group_, bits_;
};

// The head size of cache `c`, checking its type and shape; caches of codes
// need `group`, a divisor of the head size, and `bits`, 8 or 4.
int check_cache(const mx::array& c, const char* what, bool in_blocks, int group, int bits) {
  if ((c.dtype() != mx::float32 && c.dtype() != mx::uint8) || c.ndim() != 4 || c.shape(0) != 1)
    throw std::invalid_argument(std::string("cpu_attention: ") + what + " must be float32 or uint8 (codes) [1, kv_heads, capacity, width]");
  const int dim = head_dim_of(c.dtype(), c.shape(3), group, bits);
  if (dim <= 0)
    throw std::invalid_argument(std::string("cpu_attention: ") + what + " of codes need 8 or 4 bits, a group dividing the head size and a width of quantized_width(head_dim, group, bits)");
  if (in_blocks && c.shape(2) % kKeyBlock != 0)
    throw std::invalid_argument(std::string("cpu_attention: ") + what + " stored in blocks need a capacity that is a multiple of " + std::to_string(kKeyBlock));
  return dim;
}

// Checks a step's caches against its rows (token counts adding up to
// `tokens`, caches holding every key a query sees, heads dividing n_heads)
// and returns them in input order: each row's keys, then values.
std::vector<mx::array> check_step_caches(const std::vector<mx::array>& keys, const std::vector<mx::array>& values, const std::vector<AttentionRow>& rows, int tokens,
                                         int n_heads, int window, bool keys_in_blocks, int group, int bits) {
  if (window < 0) throw std::invalid_argument("cpu_attention: window must be >= 0");
  if (rows.empty() || keys.size() != rows.size() || values.size() != rows.size())
    throw std::invalid_argument("cpu_attention: need one keys and one values array per row, and at least one row");
  const int kv_heads = keys[0].ndim() == 4 ? keys[0].shape(1) : 0;
  const int dim = check_cache(keys[0], "keys", keys_in_blocks, group, bits);
  if (kv_heads <= 0 || n_heads % kv_heads != 0) throw std::invalid_argument("cpu_attention: query heads must be a multiple of KV heads");
  int total = 0;
  std::vector<mx::array> caches;
  for (size_t r = 0; r < rows.size(); ++r) {
    const int key_dim = check_cache(keys[r], "keys", keys_in_blocks, group, bits), value_dim = check_cache(values[r], "values", false, group, bits);
    for (const auto* c : {&keys[r], &values[r]})
      if (c->shape(1) != kv_heads || key_dim != dim || value_dim != dim || c->shape(2) < rows[r].kv_len - rows[r].first)
        throw std::invalid_argument("cpu_attention: row " + std::to_string(r) + "'s cache is smaller than kv_len - first or differs in heads or head_dim");
    if (rows[r].n < 1 || rows[r].kv_len < rows[r].n)
      throw std::invalid_argument("cpu_attention: row " + std::to_string(r) + " needs 1 <= n <= kv_len");
    // Every key a query sees must be held: the first query's window starts at or after `first`.
    const int first_seen = window > 0 ? std::max(0, rows[r].kv_len - rows[r].n - window + 1) : 0;
    if (rows[r].first < 0 || rows[r].first > first_seen || (keys_in_blocks && rows[r].first % kKeyBlock != 0))
      throw std::invalid_argument("cpu_attention: row " + std::to_string(r) + "'s cache starts after a key its queries see" +
                                  (keys_in_blocks ? " (or not at a block boundary)" : ""));
    total += rows[r].n;
    caches.push_back(keys[r]);
    caches.push_back(values[r]);
  }
  if (total != tokens) throw std::invalid_argument("cpu_attention: rows' token counts must add up to q's tokens");
  return caches;
}

}  // namespace

mx::array cpu_step_attention(const mx::array& q, const std::vector<mx::array>& keys, const std::vector<mx::array>& values, const std::vector<AttentionRow>& rows, int window, bool keys_in_blocks, int group, int bits) {
  if (q.dtype() != mx::float32) throw std::invalid_argument("cpu_attention: q must be float32");
  if (keys.empty()) throw std::invalid_argument("cpu_attention: need at least one row");
  const int dim = check_cache(keys[0], "keys", keys_in_blocks, group, bits);
  const auto [tokens, n_heads] = token_shape(q, dim, "q");
  std::vector<mx::array> inputs = {q};
  for (const auto& cache : check_step_caches(keys, values, rows, tokens, n_heads, window, keys_in_blocks, group, bits)) inputs.push_back(cache);
  auto cpu = mx::default_stream(mx::Device::cpu);
  return mx::array({1, tokens, n_heads * dim}, mx::float32, std::make_shared<CpuAttention>(cpu, rows, window, keys_in_blocks, dim, group, bits), std::move(inputs));
}

std::vector<mx::array> cpu_layer_attention(const mx::array& qkv, const mx::array& rope, bool traditional, int n_heads, const std::vector<mx::array>& keys, const std::vector<mx::array>& values,
                                           const std::vector<AttentionRow>& rows, int window, bool keys_in_blocks, int group, int bits) {
  if (qkv.dtype() != mx::float32 || rope.dtype() != mx::float32) throw std::invalid_argument("cpu_layer_attention: qkv and the rope table must be float32");
  if (keys.empty()) throw std::invalid_argument("cpu_layer_attention: need at least one row");
  const int dim = check_cache(keys[0], "keys", keys_in_blocks, group, bits);
  const int kv_heads = keys[0].shape(1);
  if (dim % 2 != 0) throw std::invalid_argument("cpu_layer_attention: RoPE needs an even head size");
  const auto [tokens, heads] = token_shape(qkv, dim, "qkv");
  if (qkv.ndim() != 3 || heads != n_heads + 2 * kv_heads)
    throw std::invalid_argument("cpu_layer_attention: qkv must be [1, T, (n_heads + 2 kv_heads) * head_dim]");
  if (rope.ndim() != 2 || rope.shape(0) != tokens || rope.shape(1) != dim)
    throw std::invalid_argument("cpu_layer_attention: the rope table must be [T, head_dim]");
  std::vector<mx::array> inputs = {qkv, rope};
  std::vector<mx::Shape> shapes = {{1, tokens, n_heads * dim}};
  std::vector<mx::Dtype> dtypes = {mx::float32};
  for (const auto& cache : check_step_caches(keys, values, rows, tokens, n_heads, window, keys_in_blocks, group, bits)) {
    inputs.push_back(cache);
    shapes.push_back(cache.shape());
    dtypes.push_back(cache.dtype());
  }
  auto cpu = mx::default_stream(mx::Device::cpu);
  return mx::array::make_arrays(std::move(shapes), dtypes, std::make_shared<CpuLayerAttention>(cpu, rows, traditional, n_heads, window, keys_in_blocks, dim, group, bits), inputs);
}

mx::array cpu_cache_write(const mx::array& cache, const mx::array& fresh, int start, int n, int pos, bool in_blocks, int group, int bits) {
  const int dim = check_cache(cache, "cache", in_blocks, group, bits);
  if (fresh.dtype() != mx::float32) throw std::invalid_argument("cpu_kv_write: new keys/values must be float32");
  const auto [tokens, heads] = token_shape(fresh, dim, "new keys/values");
  if (heads != cache.shape(1)) throw std::invalid_argument("cpu_kv_write: new keys/values and cache differ in heads");
  if (n < 1 || start < 0 || start + n > tokens || pos < 0 || pos + n > cache.shape(2))
    throw std::invalid_argument("cpu_kv_write: tokens or positions out of range");
  auto cpu = mx::default_stream(mx::Device::cpu);
  return mx::array(cache.shape(), cache.dtype(), std::make_shared<CpuKvWrite>(cpu, start, n, pos, in_blocks, dim, group, bits), {cache, fresh});
}

mx::array cpu_cache_dequantize(const mx::array& cache, int len, bool in_blocks, int group, int bits) {
  const int dim = check_cache(cache, "cache", in_blocks, group, bits);
  if (cache.dtype() != mx::uint8) throw std::invalid_argument("cpu_kv_dequantize: the cache must hold codes (uint8)");
  if (len < 0 || len > cache.shape(2)) throw std::invalid_argument("cpu_kv_dequantize: len out of range");
  auto cpu = mx::default_stream(mx::Device::cpu);
  return mx::array({1, cache.shape(1), len, dim}, mx::float32, std::make_shared<CpuKvDequantize>(cpu, in_blocks, dim, group, bits), {cache});
}

}  // namespace tether_mlx
