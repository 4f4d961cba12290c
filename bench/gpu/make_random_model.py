#!/usr/bin/env python3
"""Write an HF-style checkpoint with random bf16 weights of a real model's
shapes, for speed measurements on a machine that has no weights (decode
speed does not depend on the values) and for comparing kernels with each
other (the norms' weights are random too, around 1, so a kernel that
skips one shows).

usage: make_random_model.py OUT_DIR NAME TOKENIZER_DIR
NAME: qwen2.5-0.5b, qwen2.5-1.5b, qwen2.5-7b (Qwen2: q/k/v biases),
qwen3-0.6b (Qwen3: per-head q/k norms, head size 128), llama-135m
(SmolLM2-135M's shapes, Llama; with the Qwen tokenizer's vocabulary).
"""
import json
import os
import shutil
import sys

import torch
from safetensors.torch import save_file

QWEN2 = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", rope_theta=1000000.0, rms_norm_eps=1e-6)
SHAPES = {
    # Qwen2.5 configs (the Coder variants share them).
    "qwen2.5-0.5b": dict(QWEN2, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(QWEN2, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2.5-7b": dict(QWEN2, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False),
    "qwen3-0.6b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", rope_theta=1000000.0, rms_norm_eps=1e-6, hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "llama-135m": dict(architectures=["LlamaForCausalLM"], model_type="llama", rope_theta=100000.0, rms_norm_eps=1e-5, hidden_size=576, intermediate_size=1536,
                       num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True),
}


def main(out, name, tok_dir):
    s = SHAPES[name]
    cfg = dict(vocab_size=151936, max_position_embeddings=32768, torch_dtype="bfloat16", hidden_act="silu", **s)
    d, ff, L = s["hidden_size"], s["intermediate_size"], s["num_hidden_layers"]
    hd = s.get("head_dim", d // s["num_attention_heads"])
    q, kv = s["num_attention_heads"] * hd, s["num_key_value_heads"] * hd
    g = torch.Generator().manual_seed(0)

    def rnd(*shape, scale=0.02):
        return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)

    def norm(n):
        return (1 + torch.randn(n, generator=g) * 0.1).to(torch.bfloat16)

    w = {"model.embed_tokens.weight": rnd(cfg["vocab_size"], d), "model.norm.weight": norm(d)}
    if not s["tie_word_embeddings"]:
        w["lm_head.weight"] = rnd(cfg["vocab_size"], d)
    for i in range(L):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(d)
        w[p + "post_attention_layernorm.weight"] = norm(d)
        w[p + "self_attn.q_proj.weight"] = rnd(q, d)
        w[p + "self_attn.k_proj.weight"] = rnd(kv, d)
        w[p + "self_attn.v_proj.weight"] = rnd(kv, d)
        if s["model_type"] == "qwen2":
            w[p + "self_attn.q_proj.bias"] = rnd(q)
            w[p + "self_attn.k_proj.bias"] = rnd(kv)
            w[p + "self_attn.v_proj.bias"] = rnd(kv)
        if s["model_type"] == "qwen3":
            w[p + "self_attn.q_norm.weight"] = norm(hd)
            w[p + "self_attn.k_norm.weight"] = norm(hd)
        w[p + "self_attn.o_proj.weight"] = rnd(d, q)
        w[p + "mlp.gate_proj.weight"] = rnd(ff, d)
        w[p + "mlp.up_proj.weight"] = rnd(ff, d)
        w[p + "mlp.down_proj.weight"] = rnd(d, ff)
    os.makedirs(out, exist_ok=True)
    save_file(w, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tok_dir, name), out)


if __name__ == "__main__":
    main(*sys.argv[1:4])
