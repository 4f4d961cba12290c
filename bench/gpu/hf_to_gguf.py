#!/usr/bin/env python3
"""The random Qwen2-shaped checkpoint of make_random_model.py as an f16 GGUF
for llama.cpp's server, so both servers read the same weights: tensors
renamed one to one (matrices in f16, norms and biases in f32), the
tokenizer's metadata from a JSON of Qwen2's GGUF fields (tokens, types,
merges, pre-tokenizer, chat template).

usage: hf_to_gguf.py GGUF_PY_DIR HF_DIR TOKENIZER_META.json OUT.gguf
GGUF_PY_DIR: llama.cpp's gguf-py (in its source tree), so the writer is the
peer's own.
"""
import json
import sys

sys.path.insert(0, sys.argv[1])
import gguf  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

# Qwen2's per-layer tensors: HF name -> GGUF name.
LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def array(x):
    """Matrices in f16 (llama.cpp's f16 file type), vectors in f32 as its converter writes them."""
    return x.to(torch.float16 if x.dim() == 2 else torch.float32).numpy()


def main(hf, meta_path, out):
    cfg = json.load(open(f"{hf}/config.json"))
    meta = json.load(open(meta_path))
    if cfg["model_type"] != "qwen2":
        raise SystemExit(f"hf_to_gguf.py writes qwen2 only, not {cfg['model_type']}")
    t = load_file(f"{hf}/model.safetensors")
    w = gguf.GGUFWriter(out, "qwen2")
    w.add_name("random-" + cfg["model_type"] + "-shape")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_tokenizer_model(meta["model"])
    w.add_tokenizer_pre(meta["pre"])
    w.add_token_list(meta["tokens"])
    w.add_token_types(meta["types"])
    w.add_token_merges(meta["merges"])
    # Qwen2's <|endoftext|> and <|im_end|> where the config names none.
    bos, eos = cfg.get("bos_token_id", 151643), cfg.get("eos_token_id", 151645)
    w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)
    w.add_pad_token_id(bos)
    w.add_add_bos_token(False)
    w.add_chat_template(meta["chat_template"])
    w.add_tensor("token_embd.weight", array(t["model.embed_tokens.weight"]))
    if "lm_head.weight" in t:
        w.add_tensor("output.weight", array(t["lm_head.weight"]))
    w.add_tensor("output_norm.weight", array(t["model.norm.weight"]))
    for i in range(cfg["num_hidden_layers"]):
        for hf_name, gguf_name in LAYER.items():
            w.add_tensor(f"blk.{i}.{gguf_name}", array(t[f"model.layers.{i}.{hf_name}"]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print("wrote", out)


if __name__ == "__main__":
    main(*sys.argv[2:5])
