// One layer's attention for decode rows (one query each) over their batched
// slots, in one launch: each query head's RoPE (after its RMS norm where
// QK_NORM), the row's new key and value written into its slot at position p
// (in place: the caller hands over buffers nothing else holds), and the
// head's attention over positions 0..p with an online softmax.
//
// One block of 256 threads per (row, query head). A key is read by HD / 8
// lanes, 16 bytes each; the block's warps take keys in turn, four at a time
// per lane group, and fold their partial softmaxes together at the end.
// The new key and value are read from shared memory, never from the slot,
// so the query heads of a group need not wait for the one that writes it.
//
// Slots of codes (BITS 8 or 4): a position's row is its codes then each
// group's scale and bias as float32 (models/kv_codes.rs, the layout MLX's
// ops write and read). Every block encodes the new key and value itself
// (the same arithmetic as those ops: IEEE division, round to nearest even),
// the group's first head stores them, and every feature read is decoded
// and rounded to bfloat16, as the ops path's decoded buffers are; so both
// paths attend over the same numbers.
//
// Constants: HD (head size: 64, 128 or 256), HQ, HKV (query and key/value
// heads), TRAD (RoPE over adjacent pairs rather than halves), QK_NORM,
// EPS_E12 (the q/k norms' epsilon times 1e12), BITS (0: bfloat16 slots; 8
// or 4: codes), CODE_GROUP (features a scale covers, a multiple of 8).
// Inputs: qkv [R, (HQ + 2 HKV) HD] bf16 (projected, unrotated), k_cache and
// v_cache [S, HKV, C, HD] bf16 or [S, HKV, C, ROW_BYTES] uint8, rows [R, 2] int32 (slot, position p),
// inv_freq [HD / 2] float32 (each pair's turn per position), q_norm and
// k_norm [HD] bf16 (1-element placeholders without QK_NORM).
// Output: out [R, HQ HD] bf16.
constexpr int WARPS = 8;
constexpr int GROUP = HQ / HKV;
constexpr int WIDTH = (HQ + 2 * HKV) * HD;
constexpr int LANES_PER_KEY = HD / 8;
constexpr int KEYS_PER_WARP = 32 / LANES_PER_KEY;
constexpr int KEY_GROUPS = WARPS * KEYS_PER_WARP;
constexpr int UNROLL = 4;
constexpr int CODE_BYTES = BITS == 0 ? 2 * HD : HD * BITS / 8;
constexpr int ROW_BYTES = BITS == 0 ? 2 * HD : CODE_BYTES + 8 * (HD / CODE_GROUP);
constexpr int MASK = BITS == 0 ? 0 : (1 << BITS) - 1;
constexpr float LEVELS = (float)MASK;
// The new position's key and value rows, as the slot stores them.
__shared__ __align__(16) uint8_t k_row[ROW_BYTES];
__shared__ __align__(16) uint8_t v_row[ROW_BYTES];
// The new key (turned) and value as the floats their bfloat16 values are.
__shared__ float kv_new[2][HD];
__shared__ uint8_t codes_new[2][HD];
__shared__ float q_raw[HD];
__shared__ float k_raw[HD];
__shared__ float q_rot[HD];
__shared__ float norms[2];
__shared__ float group_max[KEY_GROUPS];
__shared__ float group_sum[KEY_GROUPS];
__shared__ float group_acc[KEY_GROUPS][HD];

const int row = blockIdx.x / HQ;
const int h = blockIdx.x % HQ;
const int kvh = h / GROUP;
const int slot = rows[2 * row];
const int p = rows[2 * row + 1];
const int capacity = k_cache_shape[2];
const int warp = threadIdx.x / 32;
const int lane = threadIdx.x % 32;
const __nv_bfloat16* mine = qkv + (size_t)row * WIDTH;
const size_t head_base = ((size_t)slot * HKV + kvh) * (size_t)capacity * ROW_BYTES;
const uint8_t* k_head = reinterpret_cast<const uint8_t*>(k_cache) + head_base;
const uint8_t* v_head = reinterpret_cast<const uint8_t*>(v_cache) + head_base;

// 1. This head's query and the group's new key, normed and turned; the value as is.
for (int i = threadIdx.x; i < HD; i += blockDim.x) {
  q_raw[i] = to_float(mine[h * HD + i]);
  k_raw[i] = to_float(mine[(HQ + kvh) * HD + i]);
  kv_new[1][i] = to_float(mine[(HQ + HKV + kvh) * HD + i]);
}
__syncthreads();
if (QK_NORM) {
  if (warp == 0) {
    float sq = 0.f, sk = 0.f;
    for (int i = lane; i < HD; i += 32) {
      sq += q_raw[i] * q_raw[i];
      sk += k_raw[i] * k_raw[i];
    }
    sq = warp_sum(sq);
    sk = warp_sum(sk);
    if (lane == 0) {
      norms[0] = rsqrtf(sq / HD + EPS_E12 * 1e-12f);
      norms[1] = rsqrtf(sk / HD + EPS_E12 * 1e-12f);
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < HD; i += blockDim.x) {
    q_raw[i] = round_bf16(q_raw[i] * norms[0] * to_float(q_norm[i]));
    k_raw[i] = round_bf16(k_raw[i] * norms[1] * to_float(k_norm[i]));
  }
  __syncthreads();
}
for (int i = threadIdx.x; i < HD / 2; i += blockDim.x) {
  float s, c;
  sincosf((float)p * inv_freq[i], &s, &c);
  const int a = TRAD ? 2 * i : i;
  const int b = TRAD ? 2 * i + 1 : i + HD / 2;
  q_rot[a] = round_bf16(q_raw[a] * c - q_raw[b] * s);
  q_rot[b] = round_bf16(q_raw[a] * s + q_raw[b] * c);
  kv_new[0][a] = round_bf16(k_raw[a] * c - k_raw[b] * s);
  kv_new[0][b] = round_bf16(k_raw[a] * s + k_raw[b] * c);
}
__syncthreads();
// The new rows in the slot's form: bfloat16 as is, or each group's codes
// (warp w takes the groups w, w + WARPS, ... of the key, then the value).
if (BITS == 0) {
  for (int i = threadIdx.x; i < HD; i += blockDim.x) {
    reinterpret_cast<__nv_bfloat16*>(k_row)[i] = __float2bfloat16(kv_new[0][i]);
    reinterpret_cast<__nv_bfloat16*>(v_row)[i] = __float2bfloat16(kv_new[1][i]);
  }
} else {
  constexpr int GROUPS = HD / CODE_GROUP;
  for (int task = warp; task < 2 * GROUPS; task += WARPS) {
    const int kind = task / GROUPS, g = task % GROUPS;
    const float* x = kv_new[kind] + g * CODE_GROUP;
    float lo = infinity(), hi = -infinity();
    for (int i = lane; i < CODE_GROUP; i += 32) {
      lo = fminf(lo, x[i]);
      hi = fmaxf(hi, x[i]);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      lo = fminf(lo, __shfl_xor_sync(0xffffffffu, lo, o));
      hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, o));
    }
    const float scale = __fdiv_rn(__fsub_rn(hi, lo), LEVELS);
    const float inv = scale > 0.f ? __fdiv_rn(1.f, scale) : 0.f;
    for (int i = lane; i < CODE_GROUP; i += 32) {
      const float level = fminf(fmaxf(__fmul_rn(__fsub_rn(x[i], lo), inv), 0.f), LEVELS);
      codes_new[kind][g * CODE_GROUP + i] = (uint8_t)rintf(level);
    }
    if (lane == 0) *reinterpret_cast<float2*>((kind == 0 ? k_row : v_row) + CODE_BYTES + 8 * g) = make_float2(scale, lo);
  }
  __syncthreads();
  // 4 bits: features d and d + HD / 2 share byte d, low nibble first.
  for (int i = threadIdx.x; i < 2 * CODE_BYTES; i += blockDim.x) {
    const int kind = i / CODE_BYTES, b = i % CODE_BYTES;
    const uint8_t* c = codes_new[kind];
    (kind == 0 ? k_row : v_row)[b] = BITS == 8 ? c[b] : (uint8_t)(c[b] | (c[(b + HD / 2) % HD] << 4));
  }
}
__syncthreads();
// The group's first query head stores the new key and value in the slot.
if (h % GROUP == 0) {
  uint32_t* keys = reinterpret_cast<uint32_t*>(const_cast<uint8_t*>(k_head) + (size_t)p * ROW_BYTES);
  uint32_t* values = reinterpret_cast<uint32_t*>(const_cast<uint8_t*>(v_head) + (size_t)p * ROW_BYTES);
  for (int i = threadIdx.x; i < ROW_BYTES / 4; i += blockDim.x) {
    keys[i] = reinterpret_cast<const uint32_t*>(k_row)[i];
    values[i] = reinterpret_cast<const uint32_t*>(v_row)[i];
  }
}

// 2. Scores and the weighted values, per lane group, with a running maximum.
const int group = warp * KEYS_PER_WARP + lane / LANES_PER_KEY;
const int part = lane % LANES_PER_KEY;  // features part * 8 .. part * 8 + 8
// A lane's share of a row: 16 bytes of bfloat16, or 8 codes (4 bits: the
// low or high nibbles of 8 bytes) with their group's scale and bias.
const int code_at = BITS == 8 ? part * 8 : (part * 8) % (HD / 2);
const int shift = (BITS == 4 && part * 8 >= HD / 2) ? 4 : 0;
const int scale_at = CODE_BYTES + 8 * (part * 8 / CODE_GROUP);
auto load_part = [&](const uint8_t* from) -> uint4 {
  if (BITS == 0) return *reinterpret_cast<const uint4*>(from + part * 16);
  const uint2 c = *reinterpret_cast<const uint2*>(from + code_at);
  const uint2 sb = *reinterpret_cast<const uint2*>(from + scale_at);
  return make_uint4(c.x, c.y, sb.x, sb.y);
};
auto unpack_part = [&](const uint4& w, float* f) {
  if (BITS == 0) {
    unpack8(w, f);
    return;
  }
  const float scale = __uint_as_float(w.z), bias = __uint_as_float(w.w);
#pragma unroll
  for (int t = 0; t < 8; ++t) {
    const uint32_t byte = ((t < 4 ? w.x : w.y) >> (8 * (t % 4))) & 0xffu;
    f[t] = round_bf16(__fadd_rn(__fmul_rn((float)((byte >> shift) & MASK), scale), bias));
  }
};
float q[8];
#pragma unroll
for (int j = 0; j < 8; ++j) q[j] = q_rot[part * 8 + j];
const float scale = rsqrtf((float)HD);
float run_max = -infinity();
float run_sum = 0.f;
float acc[8];
#pragma unroll
for (int j = 0; j < 8; ++j) acc[j] = 0.f;
const int n = p + 1;
for (int base = 0; base < n; base += KEY_GROUPS * UNROLL) {
  uint4 kw[UNROLL];
  uint4 vw[UNROLL];
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) {
    const int j = base + u * KEY_GROUPS + group;
    kw[u] = make_uint4(0, 0, 0, 0);
    vw[u] = make_uint4(0, 0, 0, 0);
    if (j < p) {
      kw[u] = load_part(k_head + (size_t)j * ROW_BYTES);
      vw[u] = load_part(v_head + (size_t)j * ROW_BYTES);
    } else if (j == p) {
      kw[u] = load_part(k_row);
      vw[u] = load_part(v_row);
    }
  }
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) {
    const int j = base + u * KEY_GROUPS + group;
    float kf[8];
    unpack_part(kw[u], kf);
    float score = 0.f;
#pragma unroll
    for (int t = 0; t < 8; ++t) score += q[t] * kf[t];
#pragma unroll
    for (int o = LANES_PER_KEY / 2; o > 0; o >>= 1) score += __shfl_xor_sync(0xffffffffu, score, o);
    if (j <= p) {
      score *= scale;
      const float new_max = fmaxf(run_max, score);
      const float fade = __expf(run_max - new_max);
      const float weight = __expf(score - new_max);
      float vf[8];
      unpack_part(vw[u], vf);
      run_sum = run_sum * fade + weight;
#pragma unroll
      for (int t = 0; t < 8; ++t) acc[t] = acc[t] * fade + weight * vf[t];
      run_max = new_max;
    }
  }
}

// 3. The groups' partial softmaxes folded into the head's output.
if (part == 0) {
  group_max[group] = run_max;
  group_sum[group] = run_sum;
}
#pragma unroll
for (int t = 0; t < 8; ++t) group_acc[group][part * 8 + t] = acc[t];
__syncthreads();
for (int d = threadIdx.x; d < HD; d += blockDim.x) {
  float top = -infinity();
  for (int g = 0; g < KEY_GROUPS; ++g) top = fmaxf(top, group_max[g]);
  float total = 0.f, value = 0.f;
  for (int g = 0; g < KEY_GROUPS; ++g) {
    if (group_sum[g] > 0.f) {
      const float w = __expf(group_max[g] - top);
      total += group_sum[g] * w;
      value += group_acc[g][d] * w;
    }
  }
  out[(size_t)row * HQ * HD + h * HD + d] = __float2bfloat16(value / total);
}
