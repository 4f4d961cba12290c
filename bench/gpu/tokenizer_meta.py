#!/usr/bin/env python3
"""Qwen2's tokenizer metadata read from one of its GGUF files, as the JSON
hf_to_gguf.py writes into the random checkpoints' GGUFs (tokens, token
types, merges, pre-tokenizer, chat template).

usage: tokenizer_meta.py QWEN2.gguf OUT.json   (needs the `gguf` package)
"""
import json
import sys

import gguf


def field(reader, key):
    f = reader.fields[key]
    kind = f.types[0]
    if kind == gguf.GGUFValueType.ARRAY:
        if f.types[-1] == gguf.GGUFValueType.STRING:
            return [bytes(f.parts[i]).decode("utf-8") for i in f.data]
        return [int(f.parts[i][0]) for i in f.data]
    if kind == gguf.GGUFValueType.STRING:
        return bytes(f.parts[f.data[0]]).decode("utf-8")
    return f.parts[f.data[0]].tolist()[0]


def main(src, out):
    r = gguf.GGUFReader(src)
    keys = {"model": "tokenizer.ggml.model", "pre": "tokenizer.ggml.pre", "tokens": "tokenizer.ggml.tokens",
            "types": "tokenizer.ggml.token_type", "merges": "tokenizer.ggml.merges",
            "chat_template": "tokenizer.chat_template"}
    json.dump({name: field(r, key) for name, key in keys.items()}, open(out, "w"))


if __name__ == "__main__":
    main(*sys.argv[1:3])
