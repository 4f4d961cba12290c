#!/usr/bin/env python3
"""Independent numpy forward pass for llama / qwen2 / qwen3 / gemma3 models (test oracle).

Written from the architecture descriptions, not from any inference engine:

    x = token_embd[ids]
    for each layer:
        h  = rmsnorm(x) * attn_norm
        q  = Wq h (+bq)   k = Wk h (+bk)   v = Wv h (+bv)        # qwen2 has biases
        q, k = rmsnorm(q) * q_norm, rmsnorm(k) * k_norm           # qwen3, per head
        q, k = rope(q, pos), rope(k, pos)
        x += Wo · softmax(q kᵀ / sqrt(head_dim) + causal_mask) v  # grouped-query
        h  = rmsnorm(x) * ffn_norm
        x += W_down (silu(W_gate h) * (W_up h))                   # SwiGLU
    logits = W_out rmsnorm(x) * output_norm                        # W_out = token_embd if tied

Gemma 3 on top of that (from its model card and paper): x starts as
token_embd[ids] * sqrt(d_model); the attention output and the MLP output are
each RMS-normed (post_attention_norm, post_ffw_norm) before they are added to
x; the MLP is GeGLU, gelu_tanh(W_gate h) * (W_up h); of every 6 layers the
first 5 are local: a query sees only the last `sliding_window` positions
(itself included) and RoPE uses base 10,000 there, the 6th is global with the
file's RoPE base. The GGUF's norm weights already hold 1 + w (the converter
adds the one), so every RMSNorm is x / rms(x) * weight here too.

Conventions verified against the files:
  * Quantized weights are dequantized once with ``gguf.quants.dequantize``.
    GGUF lists dims fastest-first: a tensor listed [896, 4864] is stored as 4864
    rows of 896 values.  ``GGUFReader`` already exposes numpy shapes
    (rows, row_len), and ``dequantize`` returns (rows, row_len) float32, i.e.
    W with y = W @ x (out_features x in_features).  ``_load_weights`` asserts
    that the numpy shape equals the reversed GGUF dims.
  * RoPE: theta_i = freq_base ** (-2i / n_rot), angle = pos * theta_i.
      - llama arch: the GGUF converter permuted Wq/Wk rows so the rotation acts
        on interleaved pairs (x[2i], x[2i+1])  ("normal"/GPT-J layout).
      - qwen2 arch: split-half pairs (x[i], x[i + n_rot/2])  ("NeoX" layout).
  * GQA: query head h reads kv head h // (n_head / n_head_kv).

Precision: weights are the exact dequantized float32 values; all arithmetic
(matmuls, RMSNorm, RoPE, softmax) is done in ``dtype`` -- float64 by default, so
this reference is the *accurate* side; pass dtype=np.float32 to see how much a
straightforward float32 implementation drifts.
"""

from __future__ import annotations

import os
import sys
import time

# One BLAS thread unless told otherwise (see make_fixtures.py); must be set
# before numpy is imported.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import gguf  # noqa: E402
import numpy as np  # noqa: E402
from gguf import quants  # noqa: E402

# In-process cache: path -> (hparams, {name: float32 array})
_WEIGHT_CACHE: dict[str, tuple[dict, dict]] = {}


def _read_hparams(r: gguf.GGUFReader) -> dict:
    f = r.fields

    def get(key, default=None):
        return f[key].contents() if key in f else default

    arch = get("general.architecture")
    if arch not in ("llama", "qwen2", "qwen3", "gemma3"):
        raise ValueError(f"unsupported architecture {arch!r}")
    n_embd = int(get(f"{arch}.embedding_length"))
    n_head = int(get(f"{arch}.attention.head_count"))
    head_dim = int(get(f"{arch}.attention.key_length", n_embd // n_head))
    hp = {
        "arch": arch,
        "n_layer": int(get(f"{arch}.block_count")),
        "n_embd": n_embd,
        "n_ff": int(get(f"{arch}.feed_forward_length")),
        "n_head": n_head,
        "n_head_kv": int(get(f"{arch}.attention.head_count_kv", n_head)),
        "head_dim": head_dim,
        "n_rot": int(get(f"{arch}.rope.dimension_count", head_dim)),
        "rope_base": float(get(f"{arch}.rope.freq_base", 10000.0)),
        "rms_eps": float(get(f"{arch}.attention.layer_norm_rms_epsilon")),
        "n_ctx_train": int(get(f"{arch}.context_length")),
        # llama arch GGUFs use interleaved pairs; qwen2 uses split halves.
        "rope_layout": "interleaved" if arch == "llama" else "neox",
    }
    if arch == "gemma3":
        hp.update({
            "sliding_window": int(get(f"{arch}.attention.sliding_window")),
            "local_every": 6,              # layers 0-4 local, 5 global, ...
            "rope_base_local": 10000.0,
            "embed_scale": float(np.sqrt(n_embd)),
            "ffn_act": "gelu_tanh",
        })
    # This oracle implements plain RoPE only; refuse files that ask for scaling.
    for key in (f"{arch}.rope.scaling.type", f"{arch}.rope.scaling.factor"):
        if key in f and get(key) not in ("none", 1.0, None):
            raise ValueError(f"rope scaling not supported by the oracle: {key}={get(key)}")
    return hp


def _load_weights(path: str) -> tuple[dict, dict]:
    """Dequantizes every tensor to float32 once per process."""
    if path in _WEIGHT_CACHE:
        return _WEIGHT_CACHE[path]
    t0 = time.time()
    r = gguf.GGUFReader(path)
    hp = _read_hparams(r)
    w = {}
    for t in r.tensors:
        arr = quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        expected = tuple(int(d) for d in reversed(list(t.shape)))  # GGUF dims are fastest-first
        if arr.ndim == 1:
            expected = (int(t.shape[0]),)
        assert arr.shape == expected, (t.name, arr.shape, expected)
        w[t.name] = arr
    hp["tied_embeddings"] = "output.weight" not in w
    print(f"[forward] dequantized {len(w)} tensors of {os.path.basename(path)} "
          f"in {time.time() - t0:.1f}s", file=sys.stderr)
    _WEIGHT_CACHE[path] = (hp, w)
    return hp, w


def llama3_scaled(inv_freq: np.ndarray, factor: float, low_freq_factor: float, high_freq_factor: float,
                  original_context: float) -> np.ndarray:
    """Llama 3's RoPE scaling of the angular frequencies: a pair whose
    wavelength 2*pi/f exceeds original_context/low_freq_factor turns `factor`
    times slower, one under original_context/high_freq_factor is kept, and in
    between the two are mixed with weight
    (original_context/wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    on the kept one."""
    wavelength = 2.0 * np.pi / inv_freq
    w = (original_context / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    mixed = (1.0 - w) * inv_freq / factor + w * inv_freq
    out = np.where(wavelength > original_context / low_freq_factor, inv_freq / factor, mixed)
    return np.where(wavelength < original_context / high_freq_factor, inv_freq, out)


class KVCache:
    """Per-layer keys/values, shape (n_head_kv, n_tokens, head_dim), grown by append."""

    def __init__(self, n_layer: int):
        self.k = [None] * n_layer
        self.v = [None] * n_layer

    @property
    def n_tokens(self) -> int:
        return 0 if self.k[0] is None else self.k[0].shape[1]

    def append(self, layer: int, k: np.ndarray, v: np.ndarray):
        if self.k[layer] is None:
            self.k[layer], self.v[layer] = k, v
        else:
            self.k[layer] = np.concatenate([self.k[layer], k], axis=1)
            self.v[layer] = np.concatenate([self.v[layer], v], axis=1)
        return self.k[layer], self.v[layer]


class Model:
    def __init__(self, path: str | None, dtype=np.float64, weights: tuple[dict, dict] | None = None):
        """A GGUF file's model, or (``path=None``) ``weights = (hparams, {gguf
        tensor name: float32 array})`` built elsewhere (synthetic models)."""
        self.path = path
        self.dtype = np.dtype(dtype)
        hp, w32 = weights if weights is not None else _load_weights(path)
        self.hp = dict(hp)  # private copy: tests may flip e.g. rope_layout
        # Weights in the compute dtype (a no-op view for float32).
        self.w = {k: v.astype(self.dtype, copy=False) for k, v in w32.items()}
        hp = self.hp
        self.out_w = self.w["token_embd.weight"] if hp["tied_embeddings"] else self.w["output.weight"]
        half = hp["n_rot"] // 2
        # theta_i = base^(-2i/n_rot), computed in float64.
        self.inv_freq = hp["rope_base"] ** (-np.arange(half, dtype=np.float64) * 2.0 / hp["n_rot"])
        if hp.get("rope_scaling"):
            self.inv_freq = llama3_scaled(self.inv_freq, **hp["rope_scaling"])
        self.inv_freq_local = (hp["rope_base_local"] ** (-np.arange(half, dtype=np.float64) * 2.0 / hp["n_rot"])
                               if hp.get("sliding_window") else None)

    def is_local(self, layer: int) -> bool:
        """Gemma 3: a sliding-window layer (5 of every 6)."""
        return bool(self.hp.get("sliding_window")) and (layer + 1) % self.hp["local_every"] != 0

    # -- building blocks ------------------------------------------------------
    def rmsnorm(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        ms = np.mean(x * x, axis=-1, keepdims=True)
        return x / np.sqrt(ms + self.dtype.type(self.hp["rms_eps"])) * weight

    def rope(self, x: np.ndarray, pos: np.ndarray, inv_freq: np.ndarray | None = None) -> np.ndarray:
        """x: (n_heads, n_tokens, head_dim); rotates the first n_rot dims."""
        n_rot = self.hp["n_rot"]
        inv_freq = self.inv_freq if inv_freq is None else inv_freq
        ang = pos[:, None].astype(np.float64) * inv_freq[None, :]        # (T, n_rot/2)
        cos = np.cos(ang).astype(self.dtype)[None]
        sin = np.sin(ang).astype(self.dtype)[None]
        out = x.copy()
        if self.hp["rope_layout"] == "interleaved":
            a, b = x[..., 0:n_rot:2], x[..., 1:n_rot:2]        # pairs (2i, 2i+1)
            out[..., 0:n_rot:2] = a * cos - b * sin
            out[..., 1:n_rot:2] = a * sin + b * cos
        else:
            half = n_rot // 2
            a, b = x[..., :half], x[..., half:n_rot]            # pairs (i, i+half)
            out[..., :half] = a * cos - b * sin
            out[..., half:n_rot] = a * sin + b * cos
        return out

    def linear(self, name: str, x: np.ndarray) -> np.ndarray:
        y = x @ self.w[name + ".weight"].T
        bias = self.w.get(name + ".bias")
        return y if bias is None else y + bias

    # -- forward ---------------------------------------------------------------
    def new_cache(self) -> KVCache:
        return KVCache(self.hp["n_layer"])

    def forward(self, ids: list[int], cache: KVCache, all_logits: bool = False) -> np.ndarray:
        """Runs ``ids`` at positions cache.n_tokens... and returns logits.

        Returns logits of the last token, shape (n_vocab,), or of every token
        (n_tokens, n_vocab) when all_logits=True.  Logits are in self.dtype.
        """
        hp = self.hp
        T = len(ids)
        start = cache.n_tokens
        pos = np.arange(start, start + T)
        nh, nkv, hd = hp["n_head"], hp["n_head_kv"], hp["head_dim"]
        group = nh // nkv
        scale = self.dtype.type(1.0 / np.sqrt(hd))

        x = self.w["token_embd.weight"][np.asarray(ids)]                     # (T, d)
        if hp.get("embed_scale"):
            x = x * self.dtype.type(hp["embed_scale"])
        for L in range(hp["n_layer"]):
            local = self.is_local(L)
            p = f"blk.{L}."
            h = self.rmsnorm(x, self.w[p + "attn_norm.weight"])
            q = self.linear(p + "attn_q", h).reshape(T, nh, hd).transpose(1, 0, 2)
            k = self.linear(p + "attn_k", h).reshape(T, nkv, hd).transpose(1, 0, 2)
            v = self.linear(p + "attn_v", h).reshape(T, nkv, hd).transpose(1, 0, 2)
            if p + "attn_q_norm.weight" in self.w:                          # qwen3
                q = self.rmsnorm(q, self.w[p + "attn_q_norm.weight"])
                k = self.rmsnorm(k, self.w[p + "attn_k_norm.weight"])
            inv_freq = self.inv_freq_local if local else None
            q, k = self.rope(q, pos, inv_freq), self.rope(k, pos, inv_freq)
            K, V = cache.append(L, k, v)                                    # (nkv, S, hd)
            S = K.shape[1]
            # causal mask: query at absolute position start+i sees keys 0..start+i
            mask = np.arange(S)[None, :] > (start + np.arange(T))[:, None]  # (T, S)
            if local:  # ... and only the last sliding_window of them
                mask |= np.arange(S)[None, :] <= (start + np.arange(T))[:, None] - hp["sliding_window"]
            attn = np.empty((nh, T, hd), dtype=self.dtype)
            for hq in range(nh):
                kv = hq // group
                s = (q[hq] @ K[kv].T) * scale                               # (T, S)
                s = np.where(mask, -np.inf, s)
                s = s - s.max(axis=-1, keepdims=True)
                e = np.exp(s)
                attn[hq] = (e / e.sum(axis=-1, keepdims=True)) @ V[kv]
            attn = attn.transpose(1, 0, 2).reshape(T, nh * hd)
            out = self.linear(p + "attn_output", attn)
            if p + "post_attention_norm.weight" in self.w:                  # gemma3
                out = self.rmsnorm(out, self.w[p + "post_attention_norm.weight"])
            x = x + out

            h = self.rmsnorm(x, self.w[p + "ffn_norm.weight"])
            g = self.linear(p + "ffn_gate", h)
            u = self.linear(p + "ffn_up", h)
            if hp.get("ffn_act") == "gelu_tanh":
                act = 0.5 * g * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (g + 0.044715 * g ** 3)))
            else:
                act = g / (1.0 + np.exp(-g))                                # silu
            out = self.linear(p + "ffn_down", act * u)
            if p + "post_ffw_norm.weight" in self.w:                        # gemma3
                out = self.rmsnorm(out, self.w[p + "post_ffw_norm.weight"])
            x = x + out

        x = self.rmsnorm(x if all_logits else x[-1:], self.w["output_norm.weight"])
        logits = x @ self.out_w.T
        return logits if all_logits else logits[0]

    def nll(self, ids: list[int]) -> np.ndarray:
        """Per-token negative log-likelihood of ids[1:] given the prefix (float64)."""
        lg = self.forward(ids, self.new_cache(), all_logits=True).astype(np.float64)
        lg = lg - lg.max(axis=-1, keepdims=True)
        logp = lg - np.log(np.exp(lg).sum(axis=-1, keepdims=True))
        return -logp[np.arange(len(ids) - 1), ids[1:]]

    def greedy(self, prompt_ids: list[int], n_new: int, top_k: int = 5):
        """Greedy decoding; always produces n_new tokens (EOS does not stop it).

        Returns (generated_ids, first_logits, steps) where first_logits are the
        logits at the last prompt position and steps[i] holds the top-k ids and
        logits and the top1-top2 margin for generated token i.
        """
        cache = self.new_cache()
        logits = self.forward(prompt_ids, cache)
        first = logits.copy()
        out, steps = [], []
        for i in range(n_new):
            order = np.argsort(-logits, kind="stable")[:top_k]
            nxt = int(order[0])                     # == np.argmax (lowest id on ties)
            steps.append({
                "top_ids": [int(t) for t in order],
                "top_logits": [float(logits[t]) for t in order],
                "margin": float(logits[order[0]] - logits[order[1]]),
            })
            out.append(nxt)
            if i + 1 < n_new:
                logits = self.forward([nxt], cache)
        return out, first, steps


if __name__ == "__main__":
    # Ad-hoc use: forward.py MODEL.gguf "prompt text" [n_new]
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from tokenize_ref import ReferenceTokenizer
    path, text = sys.argv[1], sys.argv[2]
    n_new = int(sys.argv[3]) if len(sys.argv) > 3 else 16
    tok = ReferenceTokenizer(path)
    ids = tok.encode(text)
    m = Model(path)
    gen, _, steps = m.greedy(ids, n_new)
    print(ids)
    print(gen)
    print(repr(tok.decode(gen)))
    print("min margin", min(s["margin"] for s in steps))
