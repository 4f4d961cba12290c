#!/usr/bin/env python3
"""What MLX's CUDA backend charges the first time it meets a shape.

A serving step's attention over batched KV slots is `[slots, heads, n,
head_dim]` queries against `[slots, kv_heads, capacity, head_dim]` keys with
an additive mask; n (tokens per slot) changes with the prompt chunk size. On
a GPU the first step with a new n has measured several milliseconds slower
than the next ones (bench/results/gpu-h200-admit-trace-prefill-in-slots.log).
This times each op the first and the second time it runs a shape, so the
cost can be pinned on one of them. Prints one JSON line per (op, shape).

usage: PYTHONPATH=/opt/py python first_shape_cost.py
"""
import json
import time

import mlx.core as mx

SLOTS, HEADS, KV_HEADS, HEAD_DIM, CAPACITY, D_MODEL = 16, 12, 2, 128, 2304, 1536


def timed(f):
    start = time.perf_counter()
    mx.eval(f())
    return (time.perf_counter() - start) * 1e3


def report(op, shape, f):
    first, second = timed(f), timed(f)
    print(json.dumps({"op": op, "shape": shape, "first_ms": round(first, 3), "second_ms": round(second, 3)}), flush=True)


def main():
    mx.set_default_device(mx.gpu)
    bf16 = mx.bfloat16
    keys = mx.random.normal((SLOTS, KV_HEADS, CAPACITY, HEAD_DIM)).astype(bf16)
    values = mx.random.normal((SLOTS, KV_HEADS, CAPACITY, HEAD_DIM)).astype(bf16)
    weight = mx.random.normal((3 * D_MODEL, D_MODEL)).astype(bf16)
    mx.eval(keys, values, weight)
    for n in [16, 32, 48, 16, 64, 80, 96]:
        q = mx.random.normal((SLOTS, HEADS, n, HEAD_DIM)).astype(bf16)
        mask = mx.zeros((SLOTS, 1, n, CAPACITY), dtype=bf16)
        x = mx.random.normal((1, 8 + n, D_MODEL)).astype(bf16)
        rows = mx.arange(SLOTS * n) % (8 + n)
        mx.eval(q, mask, x, rows)
        report("sdpa_masked", [SLOTS, HEADS, n, CAPACITY], lambda: mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.088, mask=mask))
        grouped = q.reshape(SLOTS, KV_HEADS, HEADS // KV_HEADS * n, HEAD_DIM)
        report("scores_matmul", [SLOTS, KV_HEADS, HEADS // KV_HEADS * n, CAPACITY], lambda: grouped @ keys.swapaxes(-1, -2))
        report("projection_matmul", [8 + n, D_MODEL, 3 * D_MODEL], lambda: x @ weight.T)
        report("gather_rows", [SLOTS * n, D_MODEL], lambda: mx.take(x, rows, axis=1))


if __name__ == "__main__":
    main()
