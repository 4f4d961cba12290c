#!/usr/bin/env python3
"""Regenerates every oracle fixture under tests/fixtures/ (see README.md).

    ~/.cache/tether/refenv/bin/python tests/reference/make_fixtures.py [--skip-f32-check]

Outputs
  tests/fixtures/tokenizer/smollm2.json, qwen2.5-coder.json
  tests/fixtures/greedy/smollm2.json, qwen2.5-coder-0.5b.json
  tests/fixtures/greedy/<model>/<case>.f32   logits at the last prompt position
                                             (raw little-endian float32)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import time

# Single-threaded BLAS: on the 2-core dev machines other jobs (cargo) compete for
# the cores, and OpenBLAS's spinning worker threads then make matrix-vector
# products 3-4x slower than one thread.  Set OPENBLAS_NUM_THREADS to override.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jinja2.sandbox  # noqa: E402
import numpy as np  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import forward  # noqa: E402
from tokenize_ref import ReferenceTokenizer, tokenizer_fixture  # noqa: E402

REPO = os.path.dirname(os.path.dirname(HERE))
FIXTURES = os.path.join(REPO, "tests", "fixtures")
MODELS_DIR = os.environ.get("TETHER_MODELS_DIR", os.path.expanduser("~/.cache/tether/models"))
N_NEW = 32

CHAT_MESSAGES = [{"role": "user", "content": "What is 2+2?"}]

MODELS = [
    {
        "file": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "tokenizer_fixture": "smollm2.json",
        "greedy_name": "smollm2",
        "expected_chat": ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                          "Hugging Face<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
                          "<|im_start|>assistant\n"),
        "prompts": [
            ("capital", "The capital of France is"),
            ("python_def", 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'),
            ("counting", "1, 2, 3, 4,"),
            ("chat", None),  # rendered from the GGUF chat template
            ("story", "Once upon a time, in a small village by the sea,"),
        ],
    },
    {
        "file": "Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
        "tokenizer_fixture": "qwen2.5-coder.json",
        "greedy_name": "qwen2.5-coder-0.5b",
        "expected_chat": ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
                          "assistant.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
                          "<|im_start|>assistant\n"),
        "prompts": [
            ("capital", "The capital of France is"),
            ("python_def", 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'),
            ("counting", "1, 2, 3, 4,"),
            ("chat", None),
            ("fim", "<|fim_prefix|>def is_prime(n):\n<|fim_suffix|>\n    return True\n<|fim_middle|>"),
        ],
    },
    {
        # No chat template in this file: the chat case is Gemma's turn format
        # written out here (BOS comes from add_bos_token).
        "file": "gemma-3-270m.Q4_K_M.gguf",
        "tokenizer_fixture": "gemma3.json",
        "greedy_name": "gemma3-270m",
        # A 270M base model, not an instruction-tuned one.
        "capital_answer": " the capital of the country of France",
        "chat_text": "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
        "prompts": [
            ("capital", "The capital of France is"),
            ("python_def", 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'),
            ("counting", "1, 2, 3, 4,"),
            ("chat", None),
            # Longer than the 512-token sliding window of the local layers.
            ("past_window", None),
        ],
    },
]

# Token texts treated as end-of-generation (recorded, never used to stop).
EOG_TEXTS = {"<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"}


# Natural text + code used to check that the RoPE layout is the right one: the
# wrong layout still answers "Paris" on short prompts, but its perplexity on a
# few hundred tokens is several times worse.
NLL_TEXT = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. "
    "It is named after the engineer Gustave Eiffel, whose company designed and built the tower from "
    "1887 to 1889. Locally nicknamed \"La dame de fer\" (French for \"Iron Lady\"), it was constructed "
    "as the centerpiece of the 1889 World's Fair, and to crown the centennial anniversary of the French "
    "Revolution. Although initially criticised by some of France's leading artists and intellectuals for "
    "its design, it has since become a global cultural icon of France and one of the most recognisable "
    "structures in the world.\n\n"
    "def quicksort(arr):\n    if len(arr) <= 1:\n        return arr\n    pivot = arr[len(arr) // 2]\n"
    "    left = [x for x in arr if x < pivot]\n    middle = [x for x in arr if x == pivot]\n"
    "    right = [x for x in arr if x > pivot]\n    return quicksort(left) + middle + quicksort(right)\n"
)


# A prompt past a sliding window: three different passages, then the start
# of the first again (what follows is in the window only through the copy).
LONG_TEXT = NLL_TEXT + (
    "The Great Wall of China is a series of fortifications that were built across the historical "
    "northern borders of ancient Chinese states and Imperial China as protection against various "
    "nomadic groups from the Eurasian Steppe. Several walls were built from as early as the 7th "
    "century BC, with selective stretches later joined by Qin Shi Huang, the first emperor of China. "
    "Little of the Qin wall remains. Later on, many successive dynasties built and maintained "
    "multiple stretches of border walls. The best-known sections of the wall were built by the Ming "
    "dynasty.\n\n"
    "fn merge_sort(v: &mut Vec<i64>) {\n    if v.len() <= 1 {\n        return;\n    }\n"
    "    let mid = v.len() / 2;\n    let mut right = v.split_off(mid);\n    merge_sort(v);\n"
    "    merge_sort(&mut right);\n    let mut out = Vec::with_capacity(v.len() + right.len());\n"
    "    let (mut i, mut j) = (0, 0);\n    while i < v.len() && j < right.len() {\n"
    "        if v[i] <= right[j] { out.push(v[i]); i += 1; } else { out.push(right[j]); j += 1; }\n"
    "    }\n    out.extend_from_slice(&v[i..]);\n    out.extend_from_slice(&right[j..]);\n    *v = out;\n}\n\n"
    "Photosynthesis is the process by which green plants, algae and some bacteria convert light "
    "energy into chemical energy. Water is split, oxygen is released, and the energy is stored in "
    "sugars built from carbon dioxide. The light reactions take place in the thylakoid membranes of "
    "the chloroplast; the Calvin cycle runs in the stroma, where the enzyme RuBisCO fixes carbon.\n\n"
) + NLL_TEXT[:160]


def sanity_checks(path: str, tok: ReferenceTokenizer, model: "forward.Model") -> dict:
    """Checks that do not depend on the fixtures themselves; failures abort."""
    out = {}
    # 1. RoPE layout: the layout the oracle uses must have clearly lower NLL.
    ids = tok.encode(NLL_TEXT)
    probe = forward.Model(path, dtype=np.float32)
    nll = {}
    for layout in ("interleaved", "neox"):
        probe.hp["rope_layout"] = layout
        nll[layout] = float(probe.nll(ids).mean())
    used = model.hp["rope_layout"]
    other = "neox" if used == "interleaved" else "interleaved"
    assert nll[used] < 0.6 * nll[other], f"RoPE layout check failed: {nll}"
    out["rope_layout_mean_nll"] = {"text_tokens": len(ids), **nll, "used": used}
    # 2. KV cache: token-by-token decoding must reproduce one-shot prefill.
    ids = tok.encode("The capital of France is Paris, and the capital of Italy is")
    full = model.forward(ids, model.new_cache())
    cache = model.new_cache()
    for t in ids:
        step = model.forward([t], cache)
    d = float(np.abs(full - step).max())
    assert d < 1e-9, d
    out["kv_cache_incremental_vs_prefill_max_abs_diff"] = d
    return out


def render_chat(template: str, messages, bos: str, eos: str) -> str:
    """Renders a GGUF chat template the way HF's apply_chat_template sets up jinja."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template).render(
        messages=messages, add_generation_prompt=True, bos_token=bos, eos_token=eos, tools=None)


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


_NUM_ARRAY = re.compile(r"\[\n\s*([-0-9.eE+,\s]+?)\n\s*\]")


def dumps(obj) -> str:
    """Indented JSON, but arrays of plain numbers kept on one line.

    (A '[' followed by a raw newline can only be structure, never string
    content, because JSON strings escape newlines.)
    """
    text = json.dumps(obj, ensure_ascii=False, indent=1)
    return _NUM_ARRAY.sub(lambda m: "[" + ", ".join(x.strip() for x in m.group(1).split(",")) + "]", text)


def write_json(path: str, obj) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    text = dumps(obj)
    assert json.loads(text) == obj
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text + "\n")
    print(f"wrote {os.path.relpath(path, REPO)} ({os.path.getsize(path)} bytes)", file=sys.stderr)


def run_model(spec: dict, f32_check: bool) -> None:
    path = os.path.join(MODELS_DIR, spec["file"])
    t_model = time.time()
    tok = ReferenceTokenizer(path)
    v = tok.vocab

    # ---- tokenizer fixture ----
    write_json(os.path.join(FIXTURES, "tokenizer", spec["tokenizer_fixture"]),
               tokenizer_fixture(path, spec["greedy_name"], tok))

    # ---- greedy fixture ----
    model = forward.Model(path, dtype=np.float64)
    model32 = forward.Model(path, dtype=np.float32) if f32_check else None
    eog_ids = sorted({v.eos_id} | {i for i in v.special_ids if v.tokens[i] in EOG_TEXTS})
    logits_dir = os.path.join(FIXTURES, "greedy", spec["greedy_name"])
    os.makedirs(logits_dir, exist_ok=True)

    checks = sanity_checks(path, tok, model)
    print(f"  sanity: {checks}", file=sys.stderr)

    cases = []
    for name, text in spec["prompts"]:
        t0 = time.time()
        if name == "past_window":
            text = LONG_TEXT
        elif text is None and "chat_text" in spec:
            text = spec["chat_text"]
        elif text is None:
            text = render_chat(v.chat_template, CHAT_MESSAGES, v.tokens[v.bos_id], v.tokens[v.eos_id])
            assert text == spec["expected_chat"], repr(text)
        prompt_ids = tok.encode(text, parse_special=True)  # adds BOS iff GGUF add_bos_token
        if name == "past_window":
            assert len(prompt_ids) > model.hp["sliding_window"] + 100, len(prompt_ids)
        if name == "fim":
            assert prompt_ids[0] == 151659 and 151661 in prompt_ids and prompt_ids[-1] == 151660, prompt_ids

        gen, first_logits, steps = model.greedy(prompt_ids, N_NEW)
        logits32 = first_logits.astype("<f4")
        rel = os.path.join("greedy", spec["greedy_name"], f"{name}.f32")
        logits32.tofile(os.path.join(FIXTURES, rel))

        case = {
            "name": name,
            "prompt_text": text,
            "prompt_ids": prompt_ids,
            "greedy_ids": gen,
            "greedy_text": tok.decode(gen),
            "eos_produced": v.eos_id in gen,
            "first_eos_step": gen.index(v.eos_id) if v.eos_id in gen else None,
            "first_end_of_generation_step": next((i for i, t in enumerate(gen) if t in eog_ids), None),
            "logits_file": rel,
            "logits_len": int(logits32.size),
            "logits_sha256": hashlib.sha256(logits32.tobytes()).hexdigest(),
            "min_margin": min(s["margin"] for s in steps),
            "min_margin_step": int(np.argmin([s["margin"] for s in steps])),
            "steps": steps,
        }
        if model32 is not None:
            # How far a plain float32 forward drifts from this float64 reference:
            # a lower bound for the tolerance a float32 engine needs.
            gen32, first32, _ = model32.greedy(prompt_ids, N_NEW)
            diff = np.abs(first32.astype(np.float64) - first_logits)
            case["float32_forward_check"] = {
                "first_logits_max_abs_diff": float(diff.max()),
                "first_logits_mean_abs_diff": float(diff.mean()),
                "greedy_ids_identical": gen32 == gen,
                "first_divergent_step": next((i for i, (a, b) in enumerate(zip(gen, gen32)) if a != b), None),
            }
        # Known-good behaviour (see README): the oracle is broken if these fail.
        if name == "capital":
            assert case["greedy_text"].startswith(spec.get("capital_answer", " Paris")), case["greedy_text"]
        if name == "fim":
            assert case["greedy_text"].startswith("    if n <= 1:\n        return False"), case["greedy_text"]
        cases.append(case)
        print(f"  [{spec['greedy_name']}/{name}] {len(prompt_ids)} prompt tokens, "
              f"{time.time() - t0:.1f}s: {case['greedy_text']!r}", file=sys.stderr)

    hp = dict(model.hp)
    out = {
        "model_file": spec["file"],
        "sha256": sha256_file(path),
        "generator": ("tests/reference/make_fixtures.py: numpy forward (tests/reference/forward.py), "
                      "weights dequantized with gguf.quants.dequantize to float32, all arithmetic in "
                      "float64; logits files are the float64 logits rounded to float32"),
        "hparams": hp,
        "add_bos_token": v.add_bos,
        "bos_token_id": v.bos_id,
        "eos_token_id": v.eos_id,
        "end_of_generation_ids": eog_ids,
        "n_generated": N_NEW,
        "sampling": "greedy argmax over float64 logits (lowest id on exact ties); never stops at EOS",
        "chat_messages": CHAT_MESSAGES,
        "sanity_checks": checks,
        "cases": cases,
    }
    write_json(os.path.join(FIXTURES, "greedy", spec["greedy_name"] + ".json"), out)
    print(f"{spec['file']}: {time.time() - t_model:.1f}s", file=sys.stderr)
    forward._WEIGHT_CACHE.clear()  # free memory before the next model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--skip-f32-check", action="store_true",
                    help="do not re-run each case with float32 arithmetic (saves ~40%% of the time)")
    ap.add_argument("--only", choices=[m["greedy_name"] for m in MODELS], help="regenerate one model only")
    args = ap.parse_args()
    t0 = time.time()
    for spec in MODELS:
        if args.only and spec["greedy_name"] != args.only:
            continue
        run_model(spec, f32_check=not args.skip_f32_check)
    print(f"total {time.time() - t0:.1f}s", file=sys.stderr)


if __name__ == "__main__":
    main()
