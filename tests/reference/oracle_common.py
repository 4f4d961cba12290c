"""What the random-weights oracles (qwen35.py, gemma4.py) share: the end of
writing their GGUF files, and the expectations they write for the Rust
tests: the float64 forward over the prompt (the first positions' logits and
the last's), the same prompt read token by token as a check of the
reference itself, and greedy tokens with their top-2 margins, so a test
compares tokens only while the margin is clear of its bar."""
import json
import sys

import gguf
import numpy as np


def finish_gguf(out, src, weights):
    """Copies the tokenizer's fields of `src` (a GGUFReader) into `out` (a
    GGUFWriter whose own fields are set), adds `weights` and writes the file."""
    for name, field in src.fields.items():
        if name.startswith("tokenizer."):
            vtype = field.types[0]
            sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
            out.add_key_value(name, field.contents(), vtype, sub)
    for name, t in weights.items():
        out.add_tensor(name, t)
    out.write_header_to_file()
    out.write_kv_data_to_file()
    out.write_tensors_to_file()
    out.close()


def write_expect(forward, new_state, prompt, n_first, n_greedy, generator, config, out_path):
    """`forward(ids, state)` -> logits [len(ids), vocab], carrying `state`;
    `new_state()` -> an empty state."""
    s = new_state()
    logits = forward(prompt, s)
    s1 = new_state()
    one = np.stack([forward([t], s1)[0] for t in prompt])
    drift = float(np.abs(one - logits).max())
    assert drift < 1e-9, f"token-by-token forward drifts {drift}"
    ids, margins, last = [], [], logits[-1]
    for _ in range(n_greedy):
        top2 = np.sort(last)[-2:]
        margins.append(float(top2[1] - top2[0]))
        ids.append(int(np.argmax(last)))
        last = forward([ids[-1]], s)[-1]
    with open(out_path, "w") as f:
        json.dump({
            "generator": generator,
            "config": config, "prompt_ids": prompt,
            "first_positions": n_first,
            "logits_first": [[float(np.float32(v)) for v in row] for row in logits[:n_first]],
            "logits_last": [float(np.float32(v)) for v in logits[-1]],
            "greedy_ids": ids, "margins": margins,
            "chunked_vs_token_by_token_max_abs": drift,
        }, f)
    print(f"greedy {ids}\nmin margin {min(margins):.3f}, logits std {logits.std():.2f}", file=sys.stderr)
