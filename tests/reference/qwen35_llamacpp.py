#!/usr/bin/env python3
"""llama.cpp as a second oracle for tests/reference/qwen35.py's GGUF: asks a
running llama-server (its own `qwen35` implementation) for the greedy tokens
and the top-5 log-probabilities of the first positions, and compares them
with the numpy oracle's expectations.

usage: qwen35_llamacpp.py EXPECT.json [PORT]
  (start it first: llama-server -m MODEL.gguf --port PORT -c 512 -np 1)
Prints the largest log-probability difference over the first positions'
top-5 and whether the 32 greedy tokens agree (where the numpy margin is
clear of the bar). Exits non-zero on a disagreement.
"""
import json
import sys
import urllib.request

import numpy as np

BAR = 2e-2  # log-probability: llama.cpp rounds activations to float16 for the float16 head


def completion(port: int, prompt: list[int], n: int) -> dict:
    req = {"prompt": prompt, "n_predict": n, "temperature": 0, "top_k": 1, "samplers": ["top_k"], "n_probs": 5,
           "cache_prompt": False, "ignore_eos": True}
    r = urllib.request.Request(f"http://localhost:{port}/completion", json.dumps(req).encode(), {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(r))


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max()
    return x - np.log(np.exp(x).sum())


def main() -> None:
    e = json.load(open(sys.argv[1]))
    port = int(sys.argv[2]) if len(sys.argv) > 2 else 18093
    prompt = e["prompt_ids"]
    worst = 0.0
    rows = [(i, np.array(l)) for i, l in enumerate(e["logits_first"])] + [(len(prompt) - 1, np.array(e["logits_last"]))]
    for pos, logits in rows:
        ref = log_softmax(logits.astype(np.float64))
        top = completion(port, prompt[:pos + 1], 1)["completion_probabilities"][0]["top_logprobs"]
        for t in top:
            worst = max(worst, abs(t["logprob"] - ref[t["id"]]))
        assert top[0]["id"] == int(np.argmax(logits)), f"position {pos}: llama.cpp's top token differs"
    r = completion(port, prompt, len(e["greedy_ids"]))
    got = [p["id"] for p in r["completion_probabilities"]]
    clear = next((i for i, m in enumerate(e["margins"]) if m < 2 * BAR), len(got))
    same = got[:clear] == e["greedy_ids"][:clear]
    print(f"top-5 log-prob max abs diff over {len(rows)} positions: {worst:.2e} (bar {BAR})")
    print(f"greedy: {sum(a == b for a, b in zip(got, e['greedy_ids']))}/{len(got)} equal; first {clear} (margin > {2 * BAR}) equal: {same}")
    sys.exit(0 if same and worst < BAR else 1)


if __name__ == "__main__":
    main()
