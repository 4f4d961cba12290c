#!/usr/bin/env python3
"""Single-stream prefill/decode throughput of mlx-lm, in-process (no server).

The peer side of `tether bench` (server/src/cli/bench/throughput.rs), measured the same way:
  - a prompt of exactly P tokens: the same fixed English text, encoded without
    special tokens or BOS and repeated/truncated at the token level;
  - G greedy tokens, never stopping at end-of-text: mlx-lm's `generate_step`
    (the loop under `stream_generate`) has no stop check, so every run yields
    exactly G tokens with no logits processor in the loop (a processor would
    add per-step work Tether's loop doesn't do, and change the tokens);
  - prefill chunks of 512 tokens, as Tether's bench uses;
  - one warm-up run (same prompt, 8 tokens) first;
  - prefill_tok_s = P / (time to the first token on the host),
    decode_tok_s = (G - 1) / (time from the first token to the last).

Prints one JSON line:
  {"engine":"mlx-lm","model":..,"device":..,"weights":..,"prompt_tokens":P,"gen_tokens":G,
   "prefill_tok_s":..,"decode_tok_s":..,"weight_bytes":..,"decode_gb_s":..}

usage: mlx_lm_decode.py --model-dir DIR [--prompt-tokens 512] [--gen-tokens 128] [--device cpu|gpu]
Run it with the peer venv: ~/.cache/tether/peer/venv/bin/python (bench/peer/setup.sh).
"""
import argparse
import json
import os
import time

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm import load
from mlx_lm.generate import generate_step

# Keep identical to PROMPT_TEXT in server/src/cli/bench/throughput.rs.
PROMPT_TEXT = (
    "The history of computing is a story of abstraction. Early machines were programmed "
    "by rewiring panels; later, stored programs let the same hardware run many tasks. Compilers turned "
    "human-readable code into machine instructions, operating systems shared one computer among many users, "
    "and networks joined computers into systems larger than any one of them. "
)
PREFILL_CHUNK = 512
WARMUP_TOKENS = 8


def prompt_tokens(tokenizer, n):
    one = tokenizer.encode(PROMPT_TEXT, add_special_tokens=False)
    if not one:
        raise SystemExit("benchmark text encodes to no tokens")
    return [one[i % len(one)] for i in range(n)]


def run(model, prompt, gen, stream):
    """Returns (seconds to first token, seconds from first to last, tokens)."""
    start = time.perf_counter()
    first = last = None
    out = []
    for token, _ in generate_step(mx.array(prompt), model, stream, max_tokens=gen, prefill_step_size=PREFILL_CHUNK):
        # generate_step hands back host ints (y.item()), so the token is on the host here.
        now = time.perf_counter()
        if first is None:
            first = now
        last = now
        out.append(int(token))
    return first - start, last - first, out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    ap.add_argument("--show-tokens", action="store_true", help="also print the generated ids (stderr)")
    args = ap.parse_args()
    if args.prompt_tokens < 1 or args.gen_tokens < 2:
        raise SystemExit("need --prompt-tokens >= 1 and --gen-tokens >= 2")

    device = mx.cpu if args.device == "cpu" else mx.gpu
    mx.set_default_device(device)
    # mlx_lm's own generation stream is made on the default device at import
    # time; use one on the chosen device instead.
    stream = mx.new_stream(device)
    model, tokenizer = load(args.model_dir)
    prompt = prompt_tokens(tokenizer, args.prompt_tokens)

    run(model, prompt, WARMUP_TOKENS, stream)
    ttft, decode_s, tokens = run(model, prompt, args.gen_tokens, stream)
    assert len(tokens) == args.gen_tokens, (len(tokens), args.gen_tokens)
    if args.show_tokens:
        import sys

        print(tokens, file=sys.stderr)

    weight_bytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    decode = (len(tokens) - 1) / max(decode_s, 1e-9)
    cfg_path = os.path.join(args.model_dir, "config.json")
    quant = json.load(open(cfg_path)).get("quantization") if os.path.exists(cfg_path) else None
    weights = f"q{quant['bits']}g{quant['group_size']}" if quant else "dense"
    print(
        json.dumps(
            {
                "engine": "mlx-lm",
                "model": os.path.basename(os.path.normpath(args.model_dir)),
                "device": args.device,
                "weights": weights,
                "prompt_tokens": len(prompt),
                "gen_tokens": len(tokens),
                "prefill_tok_s": len(prompt) / max(ttft, 1e-9),
                "decode_tok_s": decode,
                "weight_bytes": weight_bytes,
                "decode_gb_s": weight_bytes * decode / 1e9,
            }
        )
    )


if __name__ == "__main__":
    main()
