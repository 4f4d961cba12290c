// CPU attention for a batched step over per-sequence KV caches, and the
// cache write that feeds it.
#pragma once

#include <vector>

#include "mlx/mlx.h"

namespace tether_mlx {

// Positions per key block. A cache may store its keys in blocks: the
// positions of a block lie together, transposed, [feature][position], so
// feature d of position p of one head is at (p / B) * B * head_dim + d * B +
// p % B (B = kCacheKeyBlock), which is how attention reads them; the cache's
// shape stays [1, kv_heads, capacity, head_dim] with capacity a multiple of B,
// and only these two primitives know where a position's features are.
inline constexpr int kCacheKeyBlock = 64;

// A cache may hold 8- or 4-bit codes instead of float32 (a uint8 cache, of
// shape [1, kv_heads, capacity, quantized_width(head_dim, group, bits)]):
// each position's features of one head (keys, stored in blocks, rotated
// first when head_dim is a power of two: x <- H x / sqrt(head_dim), H the
// Hadamard matrix in Sylvester's order; attention rotates queries to match,
// and cpu_cache_dequantize rotates back) are quantized in groups of `group`
// features, affinely: feature x is stored as code c in 0..L (L = 2^bits - 1)
// with x ~= c * scale + bias, scale = (max - min) / L and bias = min of its
// group. A position's row holds its head_dim codes (4-bit: byte d holds
// feature d in its low nibble and feature d + head_dim/2 in its high one),
// then per group its scale and bias as float32. Stored in blocks, a block of
// B positions holds its codes [feature][position] (as float32 keys are;
// 4-bit: byte j of a feature's stripe holds positions j and j + B/2), then
// per group the B scales and the B biases: the same bytes as B rows, so to
// everything but these primitives a block is still B whole positions.
inline constexpr int quantized_width(int head_dim, int group, int bits) { return head_dim * bits / 8 + 8 * (head_dim / group); }

// One sequence's share of an attention step: its `n` query tokens follow the
// previous rows' tokens in the flattened step, and sit at positions
// kv_len - n .. kv_len - 1 of the sequence. Its cache holds positions
// first .. kv_len - 1, position p at index p - first (first > 0 once a
// sliding-window layer has dropped the positions no query can see again).
struct AttentionRow {
  int n;
  int kv_len;
  int first;
};

// Causal grouped-query attention of a whole step, float32, on the CPU.
//   q: the step's roped queries, [1, T, n_heads * head_dim] or
//      [T, n_heads, 1, head_dim], any strides.
//   keys[r], values[r]: row r's cache, [1, kv_heads, capacity >= kv_len, head_dim]
//      float32, or `bits`-bit codes in groups of `group` (a uint8 cache,
//      above); rows may differ in this.
// Row r's query i, at position p = kv_len - n + i, attends the keys at
// positions max(first, p - window + 1) ..= p (window 0: no window) with
// scale 1/sqrt(head_dim).
// Rows tile the T tokens in order. Returns [1, T, n_heads * head_dim].
// keys_in_blocks: every row's keys are a whole cache (no view) written in
// blocks by cpu_cache_write.
mlx::core::array cpu_step_attention(
    const mlx::core::array& q,
    const std::vector<mlx::core::array>& keys,
    const std::vector<mlx::core::array>& values,
    const std::vector<AttentionRow>& rows,
    int window,
    bool keys_in_blocks,
    int group,
    int bits);

// One layer's attention for the rows of a step as one node, from the
// layer's fused projection: RoPE on the queries and keys, the new keys and
// values written into each row's cache (as cpu_cache_write), and
// cpu_step_attention over the updated caches. A decode step otherwise
// spends a dozen graph nodes a layer on these (MLX's RoPE on the CPU alone
// is ten), and a node's host cost rivals a small kernel's.
//   qkv: [1, T, (n_heads + 2 kv_heads) * head_dim] float32, any strides:
//      each token's query heads, then key heads, then value heads.
//   rope: [T, head_dim] float32, each token's turn: for the pair (a, b) of
//      features that RoPE rotates together (a = i, b = head_dim/2 + i; or,
//      traditional, a = 2i, b = 2i + 1), cos at a and sin at b. MLX's own
//      RoPE of a unit head (1 at every a, 0 at every b) is exactly that
//      table, and with it the rotation here equals MLX's bit for bit.
//   keys[r], values[r], rows[r]: as cpu_step_attention's; row r's n new
//      tokens go in at cache index kv_len - n - first.
// Returns {the attention [1, T, n_heads * head_dim], then each row's
// updated keys and values}; a cache is written in place when its buffer is
// donatable (the caller must drop its own reference first), else copied.
std::vector<mlx::core::array> cpu_layer_attention(
    const mlx::core::array& qkv,
    const mlx::core::array& rope,
    bool traditional,
    int n_heads,
    const std::vector<mlx::core::array>& keys,
    const std::vector<mlx::core::array>& values,
    const std::vector<AttentionRow>& rows,
    int window,
    bool keys_in_blocks,
    int group,
    int bits);

// Writes tokens start .. start + n of `fresh` (laid out like q above, with
// kv_heads heads) into `cache` ([1, kv_heads, capacity, head_dim]) at
// positions pos .. pos + n and returns the updated cache. The write is in
// place when the cache's buffer is donatable (no other holder), as MLX's own
// slice_update does; otherwise the buffer is copied first, so a shared
// buffer (a copy-on-write snapshot) is never changed. in_blocks: the cache
// stores its positions in blocks (keys for cpu_step_attention). A uint8
// cache stores the tokens as `bits`-bit codes in groups of `group` features.
mlx::core::array cpu_cache_write(const mlx::core::array& cache, const mlx::core::array& fresh, int start, int n, int pos, bool in_blocks, int group, int bits);

// The first `len` positions of a uint8 cache of `bits`-bit codes in groups
// of `group` (stored in blocks or not), as float32 [1, kv_heads, len, head_dim].
mlx::core::array cpu_cache_dequantize(const mlx::core::array& cache, int len, bool in_blocks, int group, int bits);

}  // namespace tether_mlx
