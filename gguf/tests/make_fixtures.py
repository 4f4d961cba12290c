#!/usr/bin/env python3
"""Write reference dequantization fixtures for gguf/tests/real_models.rs.

For each model file, one tensor of every ggml type present is dequantized with
the official `gguf` Python package (gguf.quants, a NumPy port of ggml's
dequantize_row_* functions) and summarised in a small JSON file: the first 64
values, values at fixed strided indices, and whole-tensor sum / sum of squares /
sum of absolute values (in float64). The Rust test recomputes the same numbers.

Setup (shared with other Tether helpers):
    python3 -m venv ~/.cache/tether/refenv
    ~/.cache/tether/refenv/bin/pip install numpy gguf
Run:
    ~/.cache/tether/refenv/bin/python gguf/tests/make_fixtures.py [MODELS_DIR]
MODELS_DIR defaults to $TETHER_MODELS_DIR, then ~/.cache/tether/models.
"""

import json
import os
import sys
from pathlib import Path

import numpy as np
import gguf
from gguf import GGUFReader
from gguf.quants import dequantize

MODELS = [
    "SmolLM2-135M-Instruct.Q4_1.gguf",
    "Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
]
N_FIRST = 64
# Prefer tensors up to this size so the (debug-build) Rust test stays quick;
# if a type only occurs in bigger tensors, the smallest one is used.
PREFERRED_MAX_ELEMENTS = 5_000_000
OUT_DIR = Path(__file__).resolve().parent / "fixtures"


def sample_indices(n: int) -> list[int]:
    """Evenly spaced indices plus a few on block boundaries and a prime stride."""
    idx = {(k * (n - 1)) // 15 for k in range(16)}
    idx |= {i for i in (1, 31, 32, 33, 255, 256, 257, 4095, 4096) if i < n}
    idx |= {(k * 1_000_003) % n for k in range(1, 17)}
    return sorted(idx)


def pick_tensors(reader: GGUFReader):
    by_type = {}
    for t in reader.tensors:
        by_type.setdefault(t.tensor_type.name, []).append(t)
    picked = []
    for ty in sorted(by_type):
        ts = by_type[ty]
        small = [t for t in ts if int(t.n_elements) <= PREFERRED_MAX_ELEMENTS]
        picked.append(small[0] if small else min(ts, key=lambda t: int(t.n_elements)))
    return picked


def fixture_for(path: Path) -> dict:
    reader = GGUFReader(path)
    tensors = []
    for t in pick_tensors(reader):
        w = dequantize(t.data, t.tensor_type).astype(np.float32).reshape(-1)
        n = int(t.n_elements)
        assert w.size == n, (t.name, w.size, n)
        w64 = w.astype(np.float64)
        # GGUF dims are ne[0]-fastest; the row-major shape is their reverse.
        shape = [int(d) for d in reversed(list(t.shape))]
        tensors.append(
            {
                "name": t.name,
                "type": t.tensor_type.name,
                "shape": shape,
                "n_elements": n,
                # float(np.float32) is exact; repr() round-trips it.
                "first": [float(v) for v in w[:N_FIRST]],
                "samples": [[i, float(w[i])] for i in sample_indices(n)],
                "sum": float(w64.sum()),
                "sum_sq": float((w64 * w64).sum()),
                "sum_abs": float(np.abs(w64).sum()),
            }
        )
        print(f"  {t.name:32} {t.tensor_type.name:5} {shape} sum={tensors[-1]['sum']:.6g}")
    return {
        "model": path.name,
        "generator": f"gguf {getattr(gguf, '__version__', None) or _pkg_version()} / numpy {np.__version__}",
        "tensors": tensors,
    }


def _pkg_version() -> str:
    from importlib.metadata import version

    return version("gguf")


def main() -> int:
    default = os.environ.get("TETHER_MODELS_DIR") or str(Path.home() / ".cache/tether/models")
    models_dir = Path(sys.argv[1] if len(sys.argv) > 1 else default)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    missing = 0
    for name in MODELS:
        path = models_dir / name
        if not path.exists():
            print(f"skipping {name}: not found in {models_dir}", file=sys.stderr)
            missing += 1
            continue
        print(name)
        fx = fixture_for(path)
        out = OUT_DIR / (Path(name).stem + ".json")
        out.write_text(json.dumps(fx, indent=1) + "\n")
        print(f"  -> {out} ({out.stat().st_size} bytes)")
    return 1 if missing == len(MODELS) else 0


if __name__ == "__main__":
    sys.exit(main())
