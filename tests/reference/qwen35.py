#!/usr/bin/env python3
"""Qwen3.5 (GGUF arch `qwen35`) on random weights: writes a small GGUF of the
family's real tensor names and metadata layout, and runs an independent
numpy forward over it (the oracle of server/tests/qwen35.rs).

No weights of this family reach this machine, so the proof uses random
weights of its real layout at small sizes. The layers, from the published
description of Qwen3-Next / Qwen3.5 and the GGUF layout llama.cpp reads:

  x = token_embd[ids]
  each layer:  x += mixer(rmsnorm(x) * attn_norm)
               x += W_down(silu(W_gate h) * W_up h),  h = rmsnorm(x) * post_attention_norm
  logits = W_out (rmsnorm(x) * output_norm)

  mixer of a full-attention layer (every `full_attention_interval`-th):
    [q | gate] per head = W_q h  (each head's 2*hd rows: its query, then its gate)
    q, k = rmsnorm per head * q_norm / k_norm;  RoPE over the first n_rot
    features only, split halves (text positions: the multi-section RoPE's
    sections all turn by the same position);
    out = W_o (attention(q, k, v) * sigmoid(gate))

  mixer of a linear-attention layer (Gated DeltaNet):
    qkv = W_qkv h (key_dim q, key_dim k, value_dim v), z = W_attn_gate h
    a causal depthwise conv of width K over qkv, its last K-1 inputs carried
    from the previous tokens (the conv state), then silu
    q, k l2-normed per head (x / sqrt(sum x^2 + eps)), q scaled by 1/sqrt(dk)
    beta = sigmoid(W_beta h), g = softplus(W_alpha h + dt_bias) * ssm_a (ssm_a = -exp(A_log) < 0)
    per value head h (key head h mod n_k_heads), state S [dk, dv], token by token:
        S = exp(g) S;  d = beta (v - S^T k);  S += k d^T;  o = S^T q
    out = W_ssm_out (rmsnorm(o per head) * ssm_norm * silu(z))

usage:
  qwen35.py write OUT.gguf [--seed N] [--size small|0.8b]
                                          (0.8b: the 0.8B model's shape, its
                                           matrices in float16, ~1.4 GB: for
                                           benchmarks, never committed)
  qwen35.py expect MODEL.gguf OUT.json   (logits of the first positions and of
                                           the prompt's last, greedy tokens)
The tokenizer (vocabulary, merges, chat template) is Qwen2.5's, copied from
the Qwen2.5-Coder GGUF in ~/.cache/tether/models (TETHER_MODELS_DIR).
Needs numpy and gguf (tests/reference/requirements.txt). All arithmetic of
the forward is float64.
"""
from __future__ import annotations

import os
import sys

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import gguf  # noqa: E402
import numpy as np  # noqa: E402
from gguf import quants  # noqa: E402
from oracle_common import finish_gguf, write_expect  # noqa: E402

ARCH = "qwen35"
TOKENIZER_GGUF = "Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf"

# Small, with each kind of layer twice and more value heads than key heads
# (as the 9B has): layers 2 and 5 are full attention.
CONFIG = {
    "n_layer": 6, "full_attention_interval": 3,
    "n_embd": 128, "n_ff": 256,
    "n_head": 4, "n_head_kv": 2, "head_dim": 64, "n_rot": 16, "rope_sections": [3, 3, 2, 0],
    "rope_base": 10_000_000.0, "rms_eps": 1e-6, "context_length": 4096,
    # linear attention: 2 key heads, 4 value heads, 32 features each, conv width 4
    "ssm_conv_kernel": 4, "ssm_state_size": 32, "ssm_group_count": 2, "ssm_time_step_rank": 4,
}
# Qwen3.5-0.8B's shape (as published for the family's smallest dense model:
# 24 layers, every 4th full attention; 16 key and 16 value heads of 128 in
# the DeltaNet layers), with Qwen2.5's vocabulary: for benchmarks. Its
# matrices are written in float16 (the file is ~1.4 GB).
SIZES = {
    "small": CONFIG,
    "0.8b": {
        "n_layer": 24, "full_attention_interval": 4,
        "n_embd": 1024, "n_ff": 3584,
        "n_head": 8, "n_head_kv": 2, "head_dim": 256, "n_rot": 64, "rope_sections": [11, 11, 10, 0],
        "rope_base": 10_000_000.0, "rms_eps": 1e-6, "context_length": 32768,
        "ssm_conv_kernel": 4, "ssm_state_size": 128, "ssm_group_count": 16, "ssm_time_step_rank": 16,
        "matrix_dtype": "float16",
    },
}

# A rendered chat turn of Qwen's template: "<|im_start|>user\nWrite a haiku
# about the sea.<|im_end|>\n<|im_start|>assistant\n" is not needed; ids are
# enough for the logits check. 24 ids from across the vocabulary.
PROMPT = [151644, 872, 198, 7985, 264, 6419, 38242, 911, 279, 9396, 13, 151645, 198, 151644, 77091, 198,
          785, 3974, 13876, 38835, 34208, 916, 279, 15678]
N_FIRST = 8  # logits of the first positions compared
N_GREEDY = 32


def is_recurrent(c: dict, layer: int) -> bool:
    return (layer + 1) % c["full_attention_interval"] != 0


def models_dir() -> str:
    return os.environ.get("TETHER_MODELS_DIR", os.path.expanduser("~/.cache/tether/models"))


# ---------------------------------------------------------------- the file

def random_weights(c: dict, vocab: int, seed: int) -> dict[str, np.ndarray]:
    """numpy shapes are (out, in) for matrices, as GGUF stores them reversed."""
    rng = np.random.default_rng(seed)
    d, ff, hd = c["n_embd"], c["n_ff"], c["head_dim"]
    dk, hk, hv = c["ssm_state_size"], c["ssm_group_count"], c["ssm_time_step_rank"]
    key_dim, value_dim = dk * hk, dk * hv
    conv_dim = 2 * key_dim + value_dim

    matrix_dtype = np.dtype(c.get("matrix_dtype", "float32"))

    def mat(out, inp, gain=1.0):
        if matrix_dtype == np.float32:  # the tests' draws, unchanged
            return (rng.standard_normal((out, inp)) * gain / np.sqrt(inp)).astype(np.float32)
        return (rng.standard_normal((out, inp), dtype=np.float32) * (gain / np.sqrt(inp))).astype(matrix_dtype)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    w = {
        "token_embd.weight": rng.standard_normal((vocab, d)).astype(np.float16),
        "output_norm.weight": norm(d),
        # A larger gain spreads the logits, so greedy choices have clear margins.
        "output.weight": mat(vocab, d, gain=8.0).astype(np.float16),
    }
    for L in range(c["n_layer"]):
        p = f"blk.{L}."
        w[p + "attn_norm.weight"] = norm(d)
        w[p + "post_attention_norm.weight"] = norm(d)
        w[p + "ffn_gate.weight"] = mat(ff, d)
        w[p + "ffn_up.weight"] = mat(ff, d)
        w[p + "ffn_down.weight"] = mat(d, ff)
        if is_recurrent(c, L):
            w[p + "attn_qkv.weight"] = mat(conv_dim, d, gain=2.0)
            w[p + "attn_gate.weight"] = mat(value_dim, d)
            w[p + "ssm_conv1d.weight"] = (rng.standard_normal((conv_dim, c["ssm_conv_kernel"])) * 0.5).astype(np.float32)
            w[p + "ssm_dt.bias"] = (rng.standard_normal(hv) * 0.5).astype(np.float32)
            # -exp(A_log), A_log uniform in log(1)..log(16) as the family's init
            w[p + "ssm_a"] = (-np.exp(rng.uniform(0.0, np.log(16.0), hv))).astype(np.float32)
            w[p + "ssm_beta.weight"] = mat(hv, d)
            w[p + "ssm_alpha.weight"] = mat(hv, d)
            w[p + "ssm_norm.weight"] = norm(dk)
            w[p + "ssm_out.weight"] = mat(d, value_dim)
        else:
            w[p + "attn_q.weight"] = mat(c["n_head"] * hd * 2, d)
            w[p + "attn_k.weight"] = mat(c["n_head_kv"] * hd, d)
            w[p + "attn_v.weight"] = mat(c["n_head_kv"] * hd, d)
            w[p + "attn_output.weight"] = mat(d, c["n_head"] * hd)
            w[p + "attn_q_norm.weight"] = norm(hd)
            w[p + "attn_k_norm.weight"] = norm(hd)
    return w


def write(path: str, seed: int, size: str = "small") -> None:
    c = SIZES[size]
    src = gguf.GGUFReader(os.path.join(models_dir(), TOKENIZER_GGUF))
    vocab = len(src.fields["tokenizer.ggml.tokens"].data)
    out = gguf.GGUFWriter(path, ARCH)
    k = f"{ARCH}."
    out.add_string("general.name", f"qwen35-random-seed{seed}" + ("" if size == "small" else f"-{size}"))
    u32 = {
        "block_count": c["n_layer"], "context_length": c["context_length"], "embedding_length": c["n_embd"],
        "feed_forward_length": c["n_ff"], "attention.head_count": c["n_head"], "attention.head_count_kv": c["n_head_kv"],
        "attention.key_length": c["head_dim"], "attention.value_length": c["head_dim"], "rope.dimension_count": c["n_rot"],
        "ssm.conv_kernel": c["ssm_conv_kernel"], "ssm.state_size": c["ssm_state_size"], "ssm.group_count": c["ssm_group_count"],
        "ssm.time_step_rank": c["ssm_time_step_rank"], "ssm.inner_size": c["ssm_state_size"] * c["ssm_time_step_rank"],
        "full_attention_interval": c["full_attention_interval"],
    }
    for key, v in u32.items():
        out.add_uint32(k + key, v)
    out.add_float32(k + "rope.freq_base", c["rope_base"])
    out.add_float32(k + "attention.layer_norm_rms_epsilon", c["rms_eps"])
    out.add_array(k + "rope.dimension_sections", c["rope_sections"])
    # Both ways a file names its recurrent layers, as llama.cpp's converter writes them.
    out.add_array(k + "attention.recurrent_layers", [is_recurrent(c, L) for L in range(c["n_layer"])])
    finish_gguf(out, src, random_weights(c, vocab, seed))


# ---------------------------------------------------------------- the oracle

def load(path: str) -> tuple[dict, dict[str, np.ndarray]]:
    r = gguf.GGUFReader(path)
    f = r.fields
    get = lambda key: f[f"{ARCH}.{key}"].contents()  # noqa: E731
    c = {
        "n_layer": get("block_count"), "full_attention_interval": get("full_attention_interval"),
        "n_embd": get("embedding_length"), "n_ff": get("feed_forward_length"), "n_head": get("attention.head_count"),
        "n_head_kv": get("attention.head_count_kv"), "head_dim": get("attention.key_length"), "n_rot": get("rope.dimension_count"),
        "rope_base": get("rope.freq_base"), "rms_eps": get("attention.layer_norm_rms_epsilon"),
        "ssm_conv_kernel": get("ssm.conv_kernel"), "ssm_state_size": get("ssm.state_size"),
        "ssm_group_count": get("ssm.group_count"), "ssm_time_step_rank": get("ssm.time_step_rank"),
    }
    key = f"{ARCH}.attention.recurrent_layers"
    n, every = c["n_layer"], c["full_attention_interval"]
    c["recurrent"] = [bool(x) for x in f[key].contents()] if key in f else [(L + 1) % every != 0 for L in range(n)]
    w = {t.name: quants.dequantize(t.data, t.tensor_type).astype(np.float64) for t in r.tensors}
    return c, w


class State:
    """One sequence's memory: keys and values of the attention layers, the
    conv inputs and delta state of the linear ones."""

    def __init__(self, c: dict):
        self.kv: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.conv: dict[int, np.ndarray] = {}
        self.delta: dict[int, np.ndarray] = {}
        self.n = 0


class Qwen35:
    def __init__(self, path: str):
        self.c, self.w = load(path)
        c = self.c
        half = c["n_rot"] // 2
        self.inv_freq = c["rope_base"] ** (-np.arange(half, dtype=np.float64) * 2.0 / c["n_rot"])

    def rms(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.c["rms_eps"]) * weight

    def rope(self, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """x [T, heads, hd]: the first n_rot features turn, split halves."""
        half = self.c["n_rot"] // 2
        ang = pos[:, None] * self.inv_freq[None, :]
        cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        a, b = x[..., :half], x[..., half:2 * half]
        out = x.copy()
        out[..., :half] = a * cos - b * sin
        out[..., half:2 * half] = b * cos + a * sin
        return out

    def attention(self, L: int, h: np.ndarray, s: State) -> np.ndarray:
        c, w, p = self.c, self.w, f"blk.{L}."
        T, nh, nkv, hd = h.shape[0], c["n_head"], c["n_head_kv"], c["head_dim"]
        qg = (h @ w[p + "attn_q.weight"].T).reshape(T, nh, 2 * hd)
        q, gate = qg[..., :hd], qg[..., hd:].reshape(T, nh * hd)
        k = (h @ w[p + "attn_k.weight"].T).reshape(T, nkv, hd)
        v = (h @ w[p + "attn_v.weight"].T).reshape(T, nkv, hd)
        q, k = self.rms(q, w[p + "attn_q_norm.weight"]), self.rms(k, w[p + "attn_k_norm.weight"])
        pos = np.arange(s.n, s.n + T, dtype=np.float64)
        q, k = self.rope(q, pos), self.rope(k, pos)
        if L in s.kv:
            k, v = np.concatenate([s.kv[L][0], k]), np.concatenate([s.kv[L][1], v])
        s.kv[L] = (k, v)
        S = k.shape[0]
        mask = np.where(np.arange(S)[None, :] <= (s.n + np.arange(T))[:, None], 0.0, -np.inf)
        out = np.empty((T, nh, hd))
        for head in range(nh):
            kv = head // (nh // nkv)
            scores = q[:, head] @ k[:, kv].T / np.sqrt(hd) + mask
            scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
            out[:, head] = (scores / scores.sum(axis=-1, keepdims=True)) @ v[:, kv]
        gated = out.reshape(T, nh * hd) * (1.0 / (1.0 + np.exp(-gate)))
        return gated @ w[p + "attn_output.weight"].T

    def delta_net(self, L: int, h: np.ndarray, s: State) -> np.ndarray:
        c, w, p = self.c, self.w, f"blk.{L}."
        T, K = h.shape[0], c["ssm_conv_kernel"]
        dk, hk, hv = c["ssm_state_size"], c["ssm_group_count"], c["ssm_time_step_rank"]
        key_dim = dk * hk
        qkv = h @ w[p + "attn_qkv.weight"].T  # [T, conv_dim]
        z = (h @ w[p + "attn_gate.weight"].T).reshape(T, hv, dk)
        beta = 1.0 / (1.0 + np.exp(-(h @ w[p + "ssm_beta.weight"].T)))  # [T, hv]
        a = h @ w[p + "ssm_alpha.weight"].T + w[p + "ssm_dt.bias"]
        g = np.logaddexp(0.0, a) * w[p + "ssm_a"]  # softplus, times a negative rate
        past = s.conv.get(L, np.zeros((K - 1, qkv.shape[1])))
        inputs = np.concatenate([past, qkv])  # [K-1+T, conv_dim]
        s.conv[L] = inputs[-(K - 1):]
        kernel = w[p + "ssm_conv1d.weight"]  # [conv_dim, K]: column K-1 meets the newest input
        conv = sum(inputs[j:j + T] * kernel[:, j] for j in range(K))
        conv = conv / (1.0 + np.exp(-conv))  # silu
        q = conv[:, :key_dim].reshape(T, hk, dk)
        k = conv[:, key_dim:2 * key_dim].reshape(T, hk, dk)
        v = conv[:, 2 * key_dim:].reshape(T, hv, dk)
        l2 = lambda x: x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + c["rms_eps"])  # noqa: E731
        q, k = l2(q) / np.sqrt(dk), l2(k)
        S = s.delta.get(L, np.zeros((hv, dk, dk)))
        o = np.empty((T, hv, dk))
        for t in range(T):
            for head in range(hv):
                kh = head % hk  # value head h reads key head h mod n_k_heads
                St = S[head] * np.exp(g[t, head])
                d = beta[t, head] * (v[t, head] - St.T @ k[t, kh])
                St = St + np.outer(k[t, kh], d)
                o[t, head] = St.T @ q[t, kh]
                S[head] = St
        s.delta[L] = S
        o = self.rms(o, w[p + "ssm_norm.weight"]) * (z / (1.0 + np.exp(-z)))
        return o.reshape(T, hv * dk) @ w[p + "ssm_out.weight"].T

    def forward(self, ids: list[int], s: State) -> np.ndarray:
        """Logits [T, vocab] of every position of `ids` after what `s` holds."""
        c, w = self.c, self.w
        x = w["token_embd.weight"][ids]
        for L in range(c["n_layer"]):
            h = self.rms(x, w[f"blk.{L}.attn_norm.weight"])
            mixer = self.delta_net if c["recurrent"][L] else self.attention
            x = x + mixer(L, h, s)
            h = self.rms(x, w[f"blk.{L}.post_attention_norm.weight"])
            gate = h @ w[f"blk.{L}.ffn_gate.weight"].T
            x = x + ((gate / (1.0 + np.exp(-gate))) * (h @ w[f"blk.{L}.ffn_up.weight"].T)) @ w[f"blk.{L}.ffn_down.weight"].T
        s.n += len(ids)
        return self.rms(x, w["output_norm.weight"]) @ w["output.weight"].T


def expect(path: str, out_path: str) -> None:
    m = Qwen35(path)
    write_expect(m.forward, lambda: State(m.c), PROMPT, N_FIRST, N_GREEDY,
                 "tests/reference/qwen35.py (numpy, float64)", m.c, out_path)


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "write":
        seed = int(sys.argv[sys.argv.index("--seed") + 1]) if "--seed" in sys.argv else 0
        size = sys.argv[sys.argv.index("--size") + 1] if "--size" in sys.argv else "small"
        write(sys.argv[2], seed, size)
    elif len(sys.argv) == 4 and sys.argv[1] == "expect":
        expect(sys.argv[2], sys.argv[3])
    else:
        sys.exit(__doc__)
