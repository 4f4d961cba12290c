#!/usr/bin/env python3
"""Fixtures for architectures with no real checkpoint reachable here:
synthetic models of a real model's per-layer shapes (fewer layers, a small
vocabulary) whose weights are a fixed integer hash of (tensor name, index),
so the Rust test (server/tests/synthetic_arch.rs) writes the very same
weights into a Hugging Face folder without any file changing hands, and the
numpy forward pass (forward.py) computes the expected logits and greedy
tokens from them.

Weight element i of tensor `name` (both sides, exactly):
    x = lowbias32((i + fnv1a32(name)) mod 2^32)
    value = float32(((x / 2^32) - 0.5) * scale)
with scale = 2 / sqrt(in_features) for matrices (16 / sqrt(d_model) for the
output matrix, so greedy choices have clear margins), 1 for the embedding, and
norm weights 1 + 0.2 * (x / 2^32 - 0.5) (computed in float64, then rounded).

usage: make_synthetic_fixtures.py   (writes tests/fixtures/synthetic/*.json;
needs numpy and gguf, as forward.py: tests/reference/requirements.txt)
"""
from __future__ import annotations

import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import forward  # noqa: E402

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "synthetic")
N_NEW = 12

MODELS = {
    # Qwen3-0.6B's per-layer shapes (head size 128 over 16 heads: q is wider
    # than d_model), two layers, a 1,024-token vocabulary. The output matrix
    # is its own: with random weights a tied head makes every step repeat the
    # last token (its own embedding dominates the logits).
    "qwen3": {
        "hf_architecture": "Qwen3ForCausalLM",
        "arch": "qwen3",
        "n_layer": 2, "n_embd": 1024, "n_ff": 3072, "n_head": 16, "n_head_kv": 8, "head_dim": 128,
        "vocab": 1024, "rms_eps": 1e-6, "rope_base": 1000000.0, "qk_norm": True,
        "prompt_ids": [17, 900, 4, 511, 233, 1000, 64, 8, 731, 92, 300, 45, 12, 640, 77, 2],
    },
    # Llama-3.2-1B's attention shapes (d_model 2048, 32 heads of 64, 8 KV
    # heads, base 500,000) with its RoPE scaling (factor 32, low 1, high 4),
    # one layer, a narrow MLP. The original context is 64 rather than 8,192
    # so that all three kinds of pair (kept, scaled, blended) turn measurably
    # within the 300-token prompt.
    "llama3": {
        "hf_architecture": "LlamaForCausalLM",
        "arch": "llama",
        "n_layer": 1, "n_embd": 2048, "n_ff": 1024, "n_head": 32, "n_head_kv": 8, "head_dim": 64,
        "vocab": 1024, "rms_eps": 1e-5, "rope_base": 500000.0, "qk_norm": False,
        "rope_scaling": {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_context": 64.0},
        "prompt_ids": [int((i * 7919 + 13) % 1024) for i in range(300)],
    },
}


def fnv1a32(name: str) -> int:
    h = 0x811C9DC5
    for b in name.encode():
        h = ((h ^ b) * 0x01000193) & 0xFFFFFFFF
    return h


def lowbias32(x: np.ndarray) -> np.ndarray:
    """A 32-bit integer hash (x: uint64 holding 32-bit values)."""
    m = np.uint64(0xFFFFFFFF)
    x = x ^ (x >> np.uint64(16))
    x = (x * np.uint64(0x7FEB352D)) & m
    x = x ^ (x >> np.uint64(15))
    x = (x * np.uint64(0x846CA68B)) & m
    x = x ^ (x >> np.uint64(16))
    return x


def unit(name: str, n: int) -> np.ndarray:
    """x / 2^32 - 0.5 in float64 for element indices 0..n of tensor `name`."""
    i = (np.arange(n, dtype=np.uint64) + np.uint64(fnv1a32(name))) & np.uint64(0xFFFFFFFF)
    return lowbias32(i).astype(np.float64) / 4294967296.0 - 0.5


def matrix(name: str, rows: int, cols: int, gain: float = 2.0) -> np.ndarray:
    return (unit(name, rows * cols) * (gain / np.sqrt(cols))).astype(np.float32).reshape(rows, cols)


def norm(name: str, n: int) -> np.ndarray:
    return (1.0 + 0.2 * unit(name, n)).astype(np.float32)


def weights(spec: dict) -> dict:
    """GGUF-named tensors for forward.py, each drawn under the Hugging Face
    name the Rust test writes it as."""
    d, ff, hd = spec["n_embd"], spec["n_ff"], spec["head_dim"]
    nh, nkv, V = spec["n_head"], spec["n_head_kv"], spec["vocab"]
    w = {
        "token_embd.weight": (unit("model.embed_tokens.weight", V * d)).astype(np.float32).reshape(V, d),
        "output_norm.weight": norm("model.norm.weight", d),
        # A larger gain spreads the logits, so greedy choices have clear margins.
        "output.weight": matrix("lm_head.weight", V, d, gain=16.0),
    }
    for L in range(spec["n_layer"]):
        hf, g = f"model.layers.{L}.", f"blk.{L}."
        w[g + "attn_norm.weight"] = norm(hf + "input_layernorm.weight", d)
        w[g + "ffn_norm.weight"] = norm(hf + "post_attention_layernorm.weight", d)
        w[g + "attn_q.weight"] = matrix(hf + "self_attn.q_proj.weight", nh * hd, d)
        w[g + "attn_k.weight"] = matrix(hf + "self_attn.k_proj.weight", nkv * hd, d)
        w[g + "attn_v.weight"] = matrix(hf + "self_attn.v_proj.weight", nkv * hd, d)
        w[g + "attn_output.weight"] = matrix(hf + "self_attn.o_proj.weight", d, nh * hd)
        w[g + "ffn_gate.weight"] = matrix(hf + "mlp.gate_proj.weight", ff, d)
        w[g + "ffn_up.weight"] = matrix(hf + "mlp.up_proj.weight", ff, d)
        w[g + "ffn_down.weight"] = matrix(hf + "mlp.down_proj.weight", d, ff)
        if spec["qk_norm"]:
            w[g + "attn_q_norm.weight"] = norm(hf + "self_attn.q_norm.weight", hd)
            w[g + "attn_k_norm.weight"] = norm(hf + "self_attn.k_norm.weight", hd)
    return w


def fixture(name: str, spec: dict, layout: str) -> dict:
    """Expected outputs of `spec` with RoPE over `layout` pairs: "neox" (split
    halves: Hugging Face checkpoints, qwen GGUFs) or "interleaved" (llama
    GGUFs, whose converter permuted the q/k rows)."""
    hp = {
        "arch": spec["arch"], "n_layer": spec["n_layer"], "n_embd": spec["n_embd"], "n_ff": spec["n_ff"],
        "n_head": spec["n_head"], "n_head_kv": spec["n_head_kv"], "head_dim": spec["head_dim"],
        "n_rot": spec["head_dim"], "rope_base": spec["rope_base"], "rms_eps": spec["rms_eps"],
        "n_ctx_train": 4096, "rope_layout": layout, "tied_embeddings": False,
        "rope_scaling": spec.get("rope_scaling"),
    }
    model = forward.Model(None, weights=(hp, weights(spec)))
    gen, first, steps = model.greedy(spec["prompt_ids"], N_NEW)
    out = {
        "generator": "tests/reference/make_synthetic_fixtures.py (numpy forward.py, float64 arithmetic)",
        "model": {k: v for k, v in spec.items() if k != "prompt_ids"},
        "rope_layout": layout,
        "prompt_ids": spec["prompt_ids"],
        "last_logits": [float(np.float32(x)) for x in first],
        "greedy_ids": gen,
        "min_margin": min(s["margin"] for s in steps),
    }
    if hp["rope_scaling"]:
        # The scaling must matter here, or the test could not fail without it.
        plain = forward.Model(None, weights=(dict(hp, rope_scaling=None), weights(spec)))
        unscaled = plain.forward(spec["prompt_ids"], plain.new_cache())
        change = float(np.linalg.norm(unscaled - first) / np.linalg.norm(first))
        assert change > 1e-2, f"{name}: rope scaling changes the logits by only {change:.2e}"
        print(f"{name}: without the scaling the logits move by {change:.2e} (relative)", file=sys.stderr)
        # What a GGUF stores instead (`rope_freqs.weight`): each pair's period factor.
        out["rope_factors"] = [float(x) for x in (plain.inv_freq / model.inv_freq).astype(np.float32)]
    return out


def main() -> None:
    os.makedirs(FIXTURES, exist_ok=True)
    runs = [("qwen3", "qwen3", "neox"), ("llama3", "llama3", "neox"), ("llama3-gguf", "llama3", "interleaved")]
    for name, model, layout in runs:
        out = fixture(name, MODELS[model], layout)
        path = os.path.join(FIXTURES, f"{name}.json")
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
            f.write("\n")
        print(f"{name}: greedy {out['greedy_ids']}, min margin {out['min_margin']:.3f} -> {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
