#!/usr/bin/env python3
"""Write an HF-style Qwen2 checkpoint with random bf16 weights of a real
model's shapes, for speed measurements on a machine that has no weights
(decode speed does not depend on the values).

usage: make_random_model.py OUT_DIR {qwen2.5-0.5b,qwen2.5-1.5b} TOKENIZER_DIR
"""
import json
import os
import shutil
import sys

import torch
from safetensors.torch import save_file

SHAPES = {
    # Qwen2.5-0.5B / -1.5B configs (the Coder variants share them).
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True),
}


def main(out, name, tok_dir):
    s = SHAPES[name]
    cfg = dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=151936, max_position_embeddings=32768,
        rms_norm_eps=1e-6, rope_theta=1000000.0, torch_dtype="bfloat16", hidden_act="silu", **s,
    )
    d, ff, L = s["hidden_size"], s["intermediate_size"], s["num_hidden_layers"]
    hd = d // s["num_attention_heads"]
    kv = s["num_key_value_heads"] * hd
    g = torch.Generator().manual_seed(0)

    def rnd(*shape, scale=0.02):
        return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)

    w = {"model.embed_tokens.weight": rnd(cfg["vocab_size"], d), "model.norm.weight": torch.ones(d, dtype=torch.bfloat16)}
    for i in range(L):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = torch.ones(d, dtype=torch.bfloat16)
        w[p + "post_attention_layernorm.weight"] = torch.ones(d, dtype=torch.bfloat16)
        w[p + "self_attn.q_proj.weight"] = rnd(d, d)
        w[p + "self_attn.q_proj.bias"] = rnd(d)
        w[p + "self_attn.k_proj.weight"] = rnd(kv, d)
        w[p + "self_attn.k_proj.bias"] = rnd(kv)
        w[p + "self_attn.v_proj.weight"] = rnd(kv, d)
        w[p + "self_attn.v_proj.bias"] = rnd(kv)
        w[p + "self_attn.o_proj.weight"] = rnd(d, d)
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
