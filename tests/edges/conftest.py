"""Real `tether serve` processes on real ports for the edge tests (OpenAI
HTTP, the Responses API and its WebSocket mode, llama.cpp's endpoints).

TETHER_BIN names the binary (scripts/test.sh sets it); the test models come
from `tether fetch-model` (scripts/test.sh fetches them first).
"""
import json
import os
import re
import subprocess
import time
import urllib.request

import pytest

TOKEN = "sk-test-tenant-a"


class Server:
    def __init__(self, model, *extra):
        binary = os.environ.get("TETHER_BIN")
        assert binary, "TETHER_BIN must name the tether binary (scripts/test.sh sets it)"
        self.log = open(f"/tmp/tether-openai-{model}-{os.getpid()}.log", "w+")
        self.proc = subprocess.Popen(
            [binary, "serve", "--model", model, "--device", "cpu", "--host", "127.0.0.1", "--port", "0", *extra],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.time() + 120
        while time.time() < deadline:
            assert self.proc.poll() is None, f"tether serve exited: {self.read_log()}"
            m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", self.read_log())
            if m:
                self.port = int(m.group(1))
                break
            time.sleep(0.2)
        else:
            raise AssertionError(f"tether serve did not start: {self.read_log()}")
        self.base_url = f"http://127.0.0.1:{self.port}/v1"

    def read_log(self):
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def health(self):
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/healthz", timeout=10) as r:
            return json.load(r)

    def post(self, path, body, headers=None):
        """Raw POST (for malformed bodies the SDK would not send): (status, parsed JSON or text)."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=data, method="POST")
        req.add_header("Content-Type", "application/json")
        for k, v in (headers or {}).items():
            req.add_header(k, v)
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            text = e.read().decode()
            try:
                return e.code, json.loads(text)
            except ValueError:
                return e.code, text

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


@pytest.fixture(scope="session")
def smollm2():
    s = Server("smollm2-135m")
    yield s
    s.stop()


@pytest.fixture(scope="session")
def guarded():
    """A server that wants a bearer token."""
    s = Server("smollm2-135m", "--auth-token", TOKEN)
    yield s
    s.stop()


@pytest.fixture(scope="session")
def coder():
    """A model with fill-in-the-middle tokens."""
    s = Server("qwen2.5-coder-0.5b")
    yield s
    s.stop()


@pytest.fixture(scope="session")
def impatient():
    """A server that gives a client 2 s to send a request body (and to read)."""
    s = Server("smollm2-135m", "--stall-timeout-secs", "2")
    yield s
    s.stop()


@pytest.fixture(scope="session")
def crowded():
    """A server that takes three connections at a time."""
    s = Server("smollm2-135m", "--max-connections", "3")
    yield s
    s.stop()


@pytest.fixture(scope="session")
def capped():
    """A server whose requests without a length cap stop at 6 tokens."""
    s = Server("smollm2-135m", "--default-max-tokens", "6")
    yield s
    s.stop()


@pytest.fixture(scope="session")
def throttled():
    """A server that takes one request per 10 s per key (burst 1): a second
    request within the test's few seconds is always over the limit."""
    s = Server("smollm2-135m", "--rate-limit", "0.1")
    yield s
    s.stop()
