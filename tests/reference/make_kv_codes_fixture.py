#!/usr/bin/env python3
"""Fixture for KV codes (mlx/tests/attention.rs): keys and values with
outlier features, what they become as 8- and 4-bit affine codes in groups,
and attention over what the codes stand for, all computed here with numpy.

Each position's key vector is first rotated, x <- H x / sqrt(dim) with H the
Hadamard matrix in Sylvester's order, by the kernel's float32 butterflies
(each an exact IEEE add or subtract, so the rotated values are the kernel's
own); what the codes stand for is rotated back the same way. Values are not
rotated. The codes, per position, head and group of `group` features x
(float32 math, as the kernel does it), L = 2^bits - 1:
    lo, hi = min(x), max(x)
    scale  = (hi - lo) / L              (0 for a constant group)
    code   = rint(clip((x - lo) * (1 / scale), 0, L))   (0 when scale is 0)
    value  = code * scale + lo
Attention: each query head h reads kv head h // (heads / kv_heads); a
chunk's n queries are the cache's last n positions (causal); softmax of
q.k / sqrt(d) in float64.

usage: make_kv_codes_fixture.py   (writes tests/fixtures/kv_codes/; needs numpy)
"""
from __future__ import annotations

import json
import os

import numpy as np

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "kv_codes")
HEADS, KV_HEADS, DIM, LEN, GROUP = 6, 2, 64, 96, 32
# (queries, kv_len) per row: a decode step at the end, a chunk, a short row.
ROWS = [(1, LEN), (8, 70), (3, 3)]


def rotate(x: np.ndarray) -> np.ndarray:
    """x [..., n] float32 -> H x / sqrt(n) along the last axis, by butterflies:
    for h = 1, 2, 4, ...: (x[j], x[j + h]) <- (x[j] + x[j + h], x[j] - x[j + h])."""
    x = x.astype(np.float32).copy()
    n = x.shape[-1]
    h = 1
    while h < n:
        y = x.reshape(*x.shape[:-1], n // (2 * h), 2, h)
        a, b = y[..., 0, :].copy(), y[..., 1, :].copy()
        y[..., 0, :] = a + b
        y[..., 1, :] = a - b
        x = y.reshape(x.shape)
        h *= 2
    return (x * np.float32(1.0 / np.sqrt(n))).astype(np.float32)


def quantize(x: np.ndarray, group: int, bits: int, rotated: bool) -> np.ndarray:
    """x [..., dim] float32 -> what its `bits`-bit codes stand for, float32
    (rotated: the codes are of the rotated vector, and rotated back)."""
    turn = rotate if rotated else (lambda v: v)
    x = turn(x)
    levels = np.float32(2**bits - 1)
    g = x.reshape(*x.shape[:-1], x.shape[-1] // group, group)
    lo = g.min(axis=-1, keepdims=True)
    hi = g.max(axis=-1, keepdims=True)
    scale = ((hi - lo) / levels).astype(np.float32)
    inv = np.where(scale > 0, np.float32(1) / np.where(scale > 0, scale, np.float32(1)), np.float32(0)).astype(np.float32)
    codes = np.rint(np.clip((g - lo) * inv, np.float32(0), levels)).astype(np.float32)
    return turn((codes * scale + lo).astype(np.float32).reshape(x.shape))


def attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, n: int, kv_len: int) -> np.ndarray:
    """q [n, HEADS, DIM]; k, v [KV_HEADS, >= kv_len, DIM] -> [n, HEADS, DIM]."""
    out = np.zeros((n, HEADS, DIM), dtype=np.float64)
    per_kv = HEADS // KV_HEADS
    for t in range(n):
        pos = kv_len - n + t  # this query's position: it sees keys 0..=pos
        for h in range(HEADS):
            kh = k[h // per_kv, : pos + 1].astype(np.float64)
            vh = v[h // per_kv, : pos + 1].astype(np.float64)
            s = kh @ q[t, h].astype(np.float64) / np.sqrt(DIM)
            w = np.exp(s - s.max())
            out[t, h] = (w / w.sum()) @ vh
    return out.astype(np.float32)


def main() -> None:
    rng = np.random.default_rng(7)
    keys = rng.standard_normal((KV_HEADS, LEN, DIM)).astype(np.float32)
    keys[:, :, [3, 35]] *= 12  # outlier features, as real keys have
    values = rng.standard_normal((KV_HEADS, LEN, DIM)).astype(np.float32)
    values[1, 10, :GROUP] = 0.25  # a constant group: exact
    total = sum(n for n, _ in ROWS)
    queries = (rng.standard_normal((total, HEADS, DIM)) * 2).astype(np.float32)
    arrays = {"keys": keys, "values": values, "queries": queries}
    for bits in (8, 4):
        keys_q, values_q = quantize(keys, GROUP, bits, True), quantize(values, GROUP, bits, False)
        outs, t = [], 0
        for n, kv_len in ROWS:
            outs.append(attend(queries[t : t + n], keys_q, values_q, n, kv_len))
            t += n
        arrays[f"keys_dequantized_{bits}bit"] = keys_q
        arrays[f"values_dequantized_{bits}bit"] = values_q
        arrays[f"attention_{bits}bit"] = np.concatenate(outs)
    os.makedirs(OUT, exist_ok=True)
    for name, a in arrays.items():
        a.astype("<f4").tofile(os.path.join(OUT, f"{name}.f32"))
    meta = {
        "generator": "tests/reference/make_kv_codes_fixture.py",
        "heads": HEADS,
        "kv_heads": KV_HEADS,
        "dim": DIM,
        "len": LEN,
        "group": GROUP,
        "rows": ROWS,
        "shapes": {name: list(a.shape) for name, a in arrays.items()},
    }
    with open(os.path.join(OUT, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
