#!/usr/bin/env python3
"""Gemma 4 (GGUF arch `gemma4`) on random weights: writes a small GGUF of the
family's real tensor names and metadata layout, and runs an independent
numpy forward over it (the oracle of server/tests/gemma4.rs).

No weights of this family reach this machine, so the proof uses random
weights of its real layout at small sizes, with every feature of the dense
models switched on. The layers, from the published description of Gemma 4
and the GGUF layout llama.cpp reads:

  x = token_embd[ids] * sqrt(d)
  per-layer inputs (E2B/E4B), [T, layers, w]:
    pl = (rmsnorm(x W_pl^T / sqrt(d), per layer) * per_layer_proj_norm
          + per_layer_token_embd[ids] * sqrt(w)) / sqrt(2)
  each layer l (a window layer, or a whole-history one, by the per-layer
  `sliding_window_pattern`; the two kinds have heads of their own widths):
    h = rmsnorm(x) * attn_norm
    q = rmsnorm(W_q h per head) * q_norm, turned by RoPE
    a layer holding KV:  k = rmsnorm(W_k h per head) * k_norm, turned;
                         v = rmsnorm(W_v h per head) (no weight); W_v absent:
                         the keys' projection W_k h before its norm
    a KV-shared layer (the last `shared_kv_layers`): the keys and values of
      the last earlier layer of its kind, no projections of its own
    attention with scores q.k (no 1/sqrt(hd)), causal; a window layer's
      query sees itself and the `sliding_window - 1` positions before it
    x += rmsnorm(W_o attn) * post_attention_norm
    h = rmsnorm(x) * ffn_norm;  x += rmsnorm(W_down(gelu(W_gate h) * W_up h)) * post_ffw_norm
    x += rmsnorm(W_proj(gelu(W_inp_gate x) * pl[:, l])) * post_norm
    x *= layer_output_scale
  logits = output (rmsnorm(x) * output_norm), output = token_embd when tied;
  logits = cap tanh(logits / cap)

  RoPE (split halves): a window layer turns pair i at rope_base_swa^(-2i/hd_swa);
  a whole-history layer "proportionally": pair i at rope_base^(-2i/hd) for the
  first partial * hd/2 pairs, and not at all beyond (the file's `rope_freqs`
  factors 1 and 1e30 say the same to llama.cpp). gelu is the tanh form.

usage:
  gemma4.py write OUT.gguf [--seed N]
  gemma4.py expect MODEL.gguf OUT.json   (logits of the first positions and of
                                          the prompt's last, greedy tokens)
The tokenizer (vocabulary, merges, chat template) is Qwen2.5's, copied from
the Qwen2.5-Coder GGUF in ~/.cache/tether/models (TETHER_MODELS_DIR), as
tests/reference/qwen35.py does. Needs numpy and gguf
(tests/reference/requirements.txt). All arithmetic of the forward is float64.
"""
from __future__ import annotations

import os
import sys

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import gguf  # noqa: E402
import numpy as np  # noqa: E402
from gguf import quants  # noqa: E402
from oracle_common import finish_gguf, write_expect  # noqa: E402

ARCH = "gemma4"
TOKENIZER_GGUF = "Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf"

# Small, with each feature of the dense models on: window layers (heads of
# 32, two KV heads) and whole-history ones (heads of 64, one KV head, no
# W_v: values from the keys' projection, proportional RoPE over a quarter
# of the pairs); the last two layers KV-shared (one of each kind, reading
# layers 3 and 4), with MLPs twice as wide; per-layer inputs of 16; output
# scales; capped logits. A window of 12 positions, so the 24-token prompt
# and the 32 greedy steps run far past it.
CONFIG = {
    "n_layer": 7, "window_layers": [True, True, False, True, False, True, False],
    "shared_kv_layers": 2, "sliding_window": 12,
    "n_embd": 128, "n_ff": [128, 128, 128, 128, 128, 256, 256],
    "n_head": 4, "n_head_kv_swa": 2, "n_head_kv_full": 1, "head_dim_swa": 32, "head_dim_full": 64,
    "partial_rotary_full": 0.25, "rope_base": 1_000_000.0, "rope_base_swa": 10_000.0,
    "n_embd_per_layer": 16, "final_logit_softcapping": 30.0,
    "rms_eps": 1e-6, "context_length": 4096,
}
# 200 ids: a rendered chat turn of Qwen's template and some text, then ids
# from across the vocabulary. Long enough that a cache grown token by token
# drops its window layers' oldest positions (Tether's window caches move in
# whole 64-position blocks, with 128 positions of room) within the prompt.
PROMPT = [151644, 872, 198, 7985, 264, 6419, 38242, 911, 279, 9396, 13, 151645, 198, 151644, 77091, 198,
          785, 3974, 13876, 38835, 34208, 916, 279, 15678] + [(i * 7919 + 13) % 151643 for i in range(176)]
N_FIRST = 8  # logits of the first positions compared
N_GREEDY = 32


def models_dir() -> str:
    return os.environ.get("TETHER_MODELS_DIR", os.path.expanduser("~/.cache/tether/models"))


def first_shared(c: dict) -> int:
    return c["n_layer"] - c["shared_kv_layers"]


def kv_source(c: dict, layer: int) -> int:
    """The layer whose keys and values `layer` attends over (itself unless KV-shared)."""
    if layer < first_shared(c):
        return layer
    kind = c["window_layers"][layer]
    return max(j for j in range(first_shared(c)) if c["window_layers"][j] == kind)


def layer_dims(c: dict, layer: int) -> tuple[int, int]:
    """(kv heads, head dim) of `layer`."""
    if c["window_layers"][layer]:
        return c["n_head_kv_swa"], c["head_dim_swa"]
    return c["n_head_kv_full"], c["head_dim_full"]


# ---------------------------------------------------------------- the file

def random_weights(c: dict, vocab: int, seed: int) -> dict[str, np.ndarray]:
    """numpy shapes are (out, in) for matrices, as GGUF stores them reversed."""
    rng = np.random.default_rng(seed)
    d, nh, w, n = c["n_embd"], c["n_head"], c["n_embd_per_layer"], c["n_layer"]

    def mat(out, inp, gain=1.0):
        return (rng.standard_normal((out, inp)) * gain / np.sqrt(inp)).astype(np.float32)

    def norm(k):
        return (1.0 + 0.1 * rng.standard_normal(k)).astype(np.float32)

    hd_full = c["head_dim_full"]
    turned = int(c["partial_rotary_full"] * hd_full / 2)
    wts = {
        "token_embd.weight": rng.standard_normal((vocab, d)).astype(np.float16),
        "output_norm.weight": norm(d),
        # A head of its own (the real files tie it to token_embd, which the
        # loader reads the same way): a tied head on random weights predicts
        # the input token again and again; a larger gain spreads the logits,
        # so greedy choices have clear margins.
        "output.weight": mat(vocab, d, gain=8.0).astype(np.float16),
        "rope_freqs.weight": np.array([1.0] * turned + [1e30] * (hd_full // 2 - turned), dtype=np.float32),
        "per_layer_token_embd.weight": rng.standard_normal((vocab, n * w)).astype(np.float16),
        "per_layer_model_proj.weight": mat(n * w, d),
        "per_layer_proj_norm.weight": norm(w),
    }
    for L in range(n):
        p = f"blk.{L}."
        kv, hd = layer_dims(c, L)
        ff = c["n_ff"][L]
        wts[p + "attn_norm.weight"] = norm(d)
        wts[p + "attn_q.weight"] = mat(nh * hd, d)
        wts[p + "attn_q_norm.weight"] = norm(hd)
        if kv_source(c, L) == L:
            wts[p + "attn_k.weight"] = mat(kv * hd, d)
            wts[p + "attn_k_norm.weight"] = norm(hd)
            if c["window_layers"][L]:  # whole-history layers take their values from the keys' projection
                wts[p + "attn_v.weight"] = mat(kv * hd, d)
        wts[p + "attn_output.weight"] = mat(d, nh * hd)
        wts[p + "post_attention_norm.weight"] = norm(d)
        wts[p + "ffn_norm.weight"] = norm(d)
        wts[p + "ffn_gate.weight"] = mat(ff, d)
        wts[p + "ffn_up.weight"] = mat(ff, d)
        wts[p + "ffn_down.weight"] = mat(d, ff)
        wts[p + "post_ffw_norm.weight"] = norm(d)
        wts[p + "inp_gate.weight"] = mat(w, d)
        wts[p + "proj.weight"] = mat(d, w)
        wts[p + "post_norm.weight"] = norm(d)
        wts[p + "layer_output_scale.weight"] = rng.uniform(0.5, 1.0, 1).astype(np.float32)
    return wts


def write(path: str, seed: int) -> None:
    c = CONFIG
    src = gguf.GGUFReader(os.path.join(models_dir(), TOKENIZER_GGUF))
    vocab = len(src.fields["tokenizer.ggml.tokens"].data)
    out = gguf.GGUFWriter(path, ARCH)
    k = f"{ARCH}."
    out.add_string("general.name", f"gemma4-random-seed{seed}")
    u32 = {
        "block_count": c["n_layer"], "context_length": c["context_length"], "embedding_length": c["n_embd"],
        "attention.head_count": c["n_head"],
        "attention.key_length": c["head_dim_full"], "attention.value_length": c["head_dim_full"],
        "attention.key_length_swa": c["head_dim_swa"], "attention.value_length_swa": c["head_dim_swa"],
        "rope.dimension_count": c["head_dim_full"], "rope.dimension_count_swa": c["head_dim_swa"],
        "attention.sliding_window": c["sliding_window"], "attention.shared_kv_layers": c["shared_kv_layers"],
        "embedding_length_per_layer_input": c["n_embd_per_layer"],
    }
    for key, v in u32.items():
        out.add_uint32(k + key, v)
    per_layer = {
        "feed_forward_length": c["n_ff"],
        "attention.head_count_kv": [layer_dims(c, L)[0] for L in range(c["n_layer"])],
    }
    for key, v in per_layer.items():
        out.add_key_value(k + key, v, gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.UINT32)
    out.add_array(k + "attention.sliding_window_pattern", c["window_layers"])
    out.add_float32(k + "rope.freq_base", c["rope_base"])
    out.add_float32(k + "rope.freq_base_swa", c["rope_base_swa"])
    out.add_float32(k + "attention.layer_norm_rms_epsilon", c["rms_eps"])
    out.add_float32(k + "final_logit_softcapping", c["final_logit_softcapping"])
    finish_gguf(out, src, random_weights(c, vocab, seed))


# ---------------------------------------------------------------- the oracle

def load(path: str) -> tuple[dict, dict[str, np.ndarray]]:
    """The config from the file's own metadata (the forward reads nothing of CONFIG)."""
    r = gguf.GGUFReader(path)
    f = r.fields
    get = lambda key: f[f"{ARCH}.{key}"].contents()  # noqa: E731
    n = get("block_count")
    kv = get("attention.head_count_kv")
    window_layers = [bool(x) for x in get("attention.sliding_window_pattern")]
    c = {
        "n_layer": n, "window_layers": window_layers, "shared_kv_layers": get("attention.shared_kv_layers"),
        "sliding_window": get("attention.sliding_window"), "n_embd": get("embedding_length"),
        "n_ff": list(get("feed_forward_length")), "n_head": get("attention.head_count"),
        "n_head_kv_swa": next(kv[L] for L in range(n) if window_layers[L]),
        "n_head_kv_full": next(kv[L] for L in range(n) if not window_layers[L]),
        "head_dim_swa": get("attention.key_length_swa"), "head_dim_full": get("attention.key_length"),
        "rope_base": get("rope.freq_base"), "rope_base_swa": get("rope.freq_base_swa"),
        "n_embd_per_layer": get("embedding_length_per_layer_input"),
        "final_logit_softcapping": get("final_logit_softcapping"), "rms_eps": get("attention.layer_norm_rms_epsilon"),
    }
    w = {t.name: quants.dequantize(t.data, t.tensor_type).astype(np.float64) for t in r.tensors}
    # Which pairs of a whole-history head turn: those the factors leave at 1.
    c["partial_rotary_full"] = float(np.sum(w["rope_freqs.weight"] == 1.0)) * 2 / c["head_dim_full"]
    return c, w


def gelu(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))


class State:
    """One sequence's keys and values, per layer that holds them."""

    def __init__(self):
        self.kv: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.n = 0


class Gemma4:
    def __init__(self, path: str):
        self.c, self.w = load(path)
        c = self.c
        hs, hf = c["head_dim_swa"], c["head_dim_full"]
        self.inv_freq_swa = c["rope_base_swa"] ** (-np.arange(hs // 2, dtype=np.float64) * 2.0 / hs)
        turned = int(round(c["partial_rotary_full"] * hf / 2))
        full = c["rope_base"] ** (-np.arange(hf // 2, dtype=np.float64) * 2.0 / hf)
        self.inv_freq_full = np.where(np.arange(hf // 2) < turned, full, 0.0)

    def rms(self, x: np.ndarray, weight=1.0) -> np.ndarray:
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.c["rms_eps"]) * weight

    @staticmethod
    def rope(x: np.ndarray, pos: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
        """x [T, heads, hd], split halves."""
        half = x.shape[-1] // 2
        ang = pos[:, None] * inv_freq[None, :]
        cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        a, b = x[..., :half], x[..., half:]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)

    def attention(self, L: int, h: np.ndarray, s: State) -> np.ndarray:
        c, w, p = self.c, self.w, f"blk.{L}."
        window = c["window_layers"][L]
        T, nh = h.shape[0], c["n_head"]
        nkv, hd = (c["n_head_kv_swa"], c["head_dim_swa"]) if window else (c["n_head_kv_full"], c["head_dim_full"])
        inv_freq = self.inv_freq_swa if window else self.inv_freq_full
        pos = np.arange(s.n, s.n + T, dtype=np.float64)
        q = self.rope(self.rms((h @ w[p + "attn_q.weight"].T).reshape(T, nh, hd), w[p + "attn_q_norm.weight"]), pos, inv_freq)
        if p + "attn_k.weight" in w:
            k_raw = (h @ w[p + "attn_k.weight"].T).reshape(T, nkv, hd)
            v_raw = (h @ w[p + "attn_v.weight"].T).reshape(T, nkv, hd) if p + "attn_v.weight" in w else k_raw
            k = self.rope(self.rms(k_raw, w[p + "attn_k_norm.weight"]), pos, inv_freq)
            v = self.rms(v_raw)
            if L in s.kv:
                k, v = np.concatenate([s.kv[L][0], k]), np.concatenate([s.kv[L][1], v])
            s.kv[L] = (k, v)
        else:
            # A KV-shared layer: the last earlier layer of its kind (it ran this step already).
            first = c["n_layer"] - c["shared_kv_layers"]
            src = max(j for j in range(first) if c["window_layers"][j] == window)
            k, v = s.kv[src]
        S = k.shape[0]
        key_pos, query_pos = np.arange(S)[None, :], (s.n + np.arange(T))[:, None]
        seen = key_pos <= query_pos
        if window:
            seen &= key_pos > query_pos - c["sliding_window"]
        mask = np.where(seen, 0.0, -np.inf)
        out = np.empty((T, nh, hd))
        for head in range(nh):
            kv = head // (nh // k.shape[1])
            scores = q[:, head] @ k[:, kv].T + mask  # scale 1
            scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
            out[:, head] = (scores / scores.sum(axis=-1, keepdims=True)) @ v[:, kv]
        return out.reshape(T, nh * hd) @ w[p + "attn_output.weight"].T

    def per_layer_inputs(self, ids: list[int], x: np.ndarray) -> np.ndarray:
        c, w = self.c, self.w
        T, n, pw, d = len(ids), c["n_layer"], c["n_embd_per_layer"], c["n_embd"]
        proj = (x @ w["per_layer_model_proj.weight"].T / np.sqrt(d)).reshape(T, n, pw)
        tok = w["per_layer_token_embd.weight"][ids].reshape(T, n, pw) * np.sqrt(pw)
        return (self.rms(proj, w["per_layer_proj_norm.weight"]) + tok) / np.sqrt(2.0)

    def forward(self, ids: list[int], s: State) -> np.ndarray:
        """Logits [T, vocab] of every position of `ids` after what `s` holds."""
        c, w = self.c, self.w
        x = w["token_embd.weight"][ids] * np.sqrt(c["n_embd"])
        pl = self.per_layer_inputs(ids, x)
        for L in range(c["n_layer"]):
            p = f"blk.{L}."
            x = x + self.rms(self.attention(L, self.rms(x, w[p + "attn_norm.weight"]), s), w[p + "post_attention_norm.weight"])
            h = self.rms(x, w[p + "ffn_norm.weight"])
            f = (gelu(h @ w[p + "ffn_gate.weight"].T) * (h @ w[p + "ffn_up.weight"].T)) @ w[p + "ffn_down.weight"].T
            x = x + self.rms(f, w[p + "post_ffw_norm.weight"])
            g = gelu(x @ w[p + "inp_gate.weight"].T) * pl[:, L]
            x = x + self.rms(g @ w[p + "proj.weight"].T, w[p + "post_norm.weight"])
            x = x * w[p + "layer_output_scale.weight"][0]
        s.n += len(ids)
        head = w.get("output.weight", w["token_embd.weight"])
        logits = self.rms(x, w["output_norm.weight"]) @ head.T
        cap = c["final_logit_softcapping"]
        return cap * np.tanh(logits / cap)


def expect(path: str, out_path: str) -> None:
    m = Gemma4(path)
    write_expect(m.forward, lambda: State(), PROMPT, N_FIRST, N_GREEDY,
                 "tests/reference/gemma4.py (numpy, float64)", m.c, out_path)


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "write":
        seed = int(sys.argv[sys.argv.index("--seed") + 1]) if "--seed" in sys.argv else 0
        write(sys.argv[2], seed)
    elif len(sys.argv) == 4 and sys.argv[1] == "expect":
        expect(sys.argv[2], sys.argv[3])
    else:
        sys.exit(__doc__)
