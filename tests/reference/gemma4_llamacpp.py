#!/usr/bin/env python3
"""llama.cpp as a second oracle for tests/reference/gemma4.py's GGUF: starts
llama-server (its own `gemma4` implementation) on the file, then runs the
comparison of qwen35_llamacpp.py (top-5 log-probabilities of the first
positions and the prompt's last against the numpy oracle's, and the 32
greedy tokens where the numpy margin is clear of the bar), and stops it.

usage: gemma4_llamacpp.py MODEL.gguf EXPECT.json [PORT]
  (gemma4.py write MODEL.gguf --seed 1; gemma4.py expect MODEL.gguf EXPECT.json)
llama-server is $LLAMA_SERVER, else the one bench/peer/llamacpp.sh builds
(the vendored llama.cpp of llama-cpp-python 0.3.36). Exits non-zero on a
disagreement.
"""
import os
import subprocess
import sys
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import qwen35_llamacpp  # noqa: E402  (the comparison is the same for every family)


def llama_server() -> str:
    if os.environ.get("LLAMA_SERVER"):
        return os.environ["LLAMA_SERVER"]
    script = os.path.join(HERE, "../../bench/peer/llamacpp.sh")
    return subprocess.run([script], check=True, capture_output=True, text=True).stdout.strip()


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    model, expect = sys.argv[1], sys.argv[2]
    port = sys.argv[3] if len(sys.argv) > 3 else "18094"
    log = open(os.path.join(os.path.dirname(os.path.abspath(expect)), "llama-server.log"), "w")
    server = subprocess.Popen([llama_server(), "-m", model, "--host", "127.0.0.1", "--port", port, "-c", "1024", "-np", "1", "-t", "2", "--no-webui"],
                              stdout=log, stderr=subprocess.STDOUT)
    try:
        for _ in range(240):
            if server.poll() is not None:
                sys.exit(f"llama-server exited ({server.returncode}); see {log.name}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                time.sleep(0.5)
        sys.argv = [sys.argv[0], expect, port]
        qwen35_llamacpp.main()
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
