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
// Constants: HD (head size: 64, 128 or 256), HQ, HKV (query and key/value
// heads), TRAD (RoPE over adjacent pairs rather than halves), QK_NORM,
// EPS_E12 (the q/k norms' epsilon times 1e12).
// Inputs: qkv [R, (HQ + 2 HKV) HD] bf16 (projected, unrotated), k_cache and
// v_cache [S, HKV, C, HD] bf16, rows [R, 2] int32 (slot, position p),
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
__shared__ __align__(16) __nv_bfloat16 k_new[HD];
__shared__ __align__(16) __nv_bfloat16 v_new[HD];
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
const size_t head_base = ((size_t)slot * HKV + kvh) * (size_t)capacity * HD;

// 1. This head's query and the group's new key, normed and turned; the value as is.
for (int i = threadIdx.x; i < HD; i += blockDim.x) {
  q_raw[i] = to_float(mine[h * HD + i]);
  k_raw[i] = to_float(mine[(HQ + kvh) * HD + i]);
  v_new[i] = mine[(HQ + HKV + kvh) * HD + i];
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
  k_new[a] = __float2bfloat16(k_raw[a] * c - k_raw[b] * s);
  k_new[b] = __float2bfloat16(k_raw[a] * s + k_raw[b] * c);
}
__syncthreads();
// The group's first query head stores the new key and value in the slot.
if (h % GROUP == 0) {
  __nv_bfloat16* keys = const_cast<__nv_bfloat16*>(k_cache) + head_base + (size_t)p * HD;
  __nv_bfloat16* values = const_cast<__nv_bfloat16*>(v_cache) + head_base + (size_t)p * HD;
  for (int i = threadIdx.x; i < HD; i += blockDim.x) {
    keys[i] = k_new[i];
    values[i] = v_new[i];
  }
}

// 2. Scores and the weighted values, per lane group, with a running maximum.
const int group = warp * KEYS_PER_WARP + lane / LANES_PER_KEY;
const int part = lane % LANES_PER_KEY;  // features part * 8 .. part * 8 + 8
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
      kw[u] = *(reinterpret_cast<const uint4*>(k_cache + head_base + (size_t)j * HD) + part);
      vw[u] = *(reinterpret_cast<const uint4*>(v_cache + head_base + (size_t)j * HD) + part);
    } else if (j == p) {
      kw[u] = *(reinterpret_cast<const uint4*>(k_new) + part);
      vw[u] = *(reinterpret_cast<const uint4*>(v_new) + part);
    }
  }
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) {
    const int j = base + u * KEY_GROUPS + group;
    float kf[8];
    unpack8(kw[u], kf);
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
      unpack8(vw[u], vf);
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
