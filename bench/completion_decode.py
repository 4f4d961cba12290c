#!/usr/bin/env python3
"""One-stream decode speed through llama.cpp's streamed `POST /completion`,
which both Tether (its llama.cpp edge) and llama.cpp's own server answer, so
one client measures both the same way.

Each request: a different prompt (a numbered passage, so no prompt cache
serves it), greedy (top_k 1, temperature 0), `n_predict` tokens with
`ignore_eos`. Measured client side from the streamed `data:` lines: time to
first token, and decode tok/s = (tokens - 1) / (last token's arrival - first
token's arrival), tokens from the final message's `timings.predicted_n`.
Prints one JSON line per request and appends it to --out.

    completion_decode.py --url http://127.0.0.1:PORT --server tether --label gemma3-270m --out R.jsonl
"""

import argparse
import json
import time
import urllib.request

PASSAGE = ("Passage {n}. The river ran past the old mill, and the miller's daughter counted the boats "
           "as they went down to the sea. She wrote each name in a small book:")


def one_request(url: str, prompt: str, n_predict: int) -> dict:
    body = {"prompt": prompt, "n_predict": n_predict, "stream": True, "temperature": 0.0, "top_k": 1,
            "ignore_eos": True, "cache_prompt": False}
    req = urllib.request.Request(url + "/completion", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    sent = time.perf_counter()
    arrivals, final = [], None
    with urllib.request.urlopen(req, timeout=600) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            msg = json.loads(line[5:])
            if msg.get("content"):
                arrivals.append(time.perf_counter())
            if msg.get("stop"):
                final = msg
                break
    tokens = final["timings"]["predicted_n"]
    decode_s = arrivals[-1] - arrivals[0]
    return {"ttft_s": arrivals[0] - sent, "tokens": tokens, "decode_tok_s": (tokens - 1) / decode_s if decode_s > 0 else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", required=True)
    ap.add_argument("--server", required=True, help="tether or llama.cpp (recorded)")
    ap.add_argument("--label", required=True, help="model (recorded)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--build", default="", help="the code measured (recorded)")
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--n-predict", type=int, default=128)
    ap.add_argument("--first", type=int, default=0, help="number of the first passage (distinct per run)")
    a = ap.parse_args()
    one_request(a.url, PASSAGE.format(n=a.first - 1), 8)  # warm-up, not recorded
    with open(a.out, "a") as out:
        for i in range(a.requests):
            row = {"server": a.server, "model": a.label, "build": a.build,
                   **one_request(a.url, PASSAGE.format(n=a.first + i), a.n_predict)}
            print(json.dumps(row), flush=True)
            out.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
