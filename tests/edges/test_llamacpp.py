"""llama.cpp's editor endpoints, driven with the request bodies llama.vim
and llama.vscode send (recorded in tests/fixtures/llamacpp/, with where
each was read from): the warm-up then completions of consecutive
keystrokes reusing the cached prefix, the editor cut-offs (`n_indent`,
`t_max_predict_ms`), `response_fields`, streaming, `/completion`,
`/health`, `/tokenize`, `/detokenize`, and a table of bad requests
answered in llama.cpp's error shape.
"""
import copy
import json
import pathlib
import urllib.request

import pytest

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "llamacpp"


def fixture(name):
    return json.loads((FIXTURES / f"{name}.json").read_text())


def post_raw(server, path, body, headers=None):
    """The raw reply: (status, body bytes), for checks on the wire form."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{server.port}{path}", data=data, method="POST")
    for k, v in (headers or {}).items():
        req.add_header(k, v)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.mark.parametrize("editor", ["llama-vim", "llama-vscode"])
def test_an_editors_warm_up_then_keystrokes_reuse_the_cached_prefix(coder, editor):
    warm = fixture(f"{editor}-warmup")["body"]
    infill = fixture(f"{editor}-infill")
    # llama.vim sends `Authorization: Bearer ` with an empty key when none is set.
    status, raw = post_raw(coder, "/infill", warm, {"Authorization": "Bearer "})
    assert status == 200, raw
    status, raw = post_raw(coder, "/infill", infill["body"], {"Authorization": "Bearer "})
    assert status == 200, raw
    # llama.vim finds the completion by the literal text `"content":"`.
    assert b'"content":"' in raw and b"\n" not in raw
    got = json.loads(raw)
    # llama.vim also reads `timings/truncated`, which llama.cpp never returns.
    for path in (p for p in infill["reads"] if p != "timings/truncated"):
        value = got.get(path) if "/" in path else got
        if "/" not in path:
            for key in path.split("."):
                value = value[key]
        assert value is not None, (path, got)
    first_cached = got["tokens_cached"]
    # The next keystroke: one more character typed at the cursor.
    body = copy.deepcopy(infill["body"])
    body["prompt"] += "m"
    body["response_fields"] = ["content", "timings/cache_n", "timings/prompt_n", "tokens_cached"]
    status, raw = post_raw(coder, "/infill", body)
    again = json.loads(raw)
    assert status == 200 and set(again) <= {"content", "timings/cache_n", "timings/prompt_n", "tokens_cached"}, again
    # Everything before the cursor stays cached (to the last whole block);
    # the text after it is evaluated again, as the FIM layout puts it after
    # the prefix.
    suffix_tokens = len(json.loads(post_raw(coder, "/tokenize", {"content": body["input_suffix"]})[1])["tokens"])
    assert again["timings/prompt_n"] <= suffix_tokens + 2 * 16, (again, suffix_tokens)
    assert again["timings/cache_n"] > 0.6 * (again["timings/cache_n"] + again["timings/prompt_n"]), again
    assert first_cached > 0


def test_n_indent_ends_the_completion_at_a_line_outside_the_block(coder):
    body = fixture("llama-vscode-infill")["body"] | {"n_predict": 64, "temperature": 0, "n_indent": 40, "t_max_predict_ms": 0, "n_cmpl": 1}
    got = json.loads(post_raw(coder, "/infill", body)[1])
    lines = got["content"].split("\n")
    # Past the first line, only blank lines (or bare indentation) may follow.
    assert all(not line.strip() for line in lines[1:]), got["content"]
    assert got["stop_type"] in ("limit", "eos"), got


def test_t_max_predict_ms_ends_at_a_newline(coder):
    body = {"input_prefix": "def f():\n", "input_suffix": "\n", "prompt": "    ", "n_predict": 200, "temperature": 0, "t_max_predict_ms": 1, "samplers": []}
    got = json.loads(post_raw(coder, "/infill", body)[1])
    assert got["tokens_predicted"] < 200 and got["stop_type"] in ("limit", "eos"), got
    if got["stop_type"] == "limit":
        assert got["content"].endswith("\n") or "\n" in got["content"], got


def test_completion_whole_and_streamed_agree(coder):
    body = {"prompt": "def fibonacci(n):", "n_predict": 12, "temperature": 0, "ignore_eos": True}
    status, raw = post_raw(coder, "/completion", body)
    whole = json.loads(raw)
    assert status == 200 and whole["tokens_predicted"] == 12 and whole["stop_type"] == "limit", whole
    status, raw = post_raw(coder, "/completion", body | {"stream": True})
    events = [json.loads(line[len(b"data: "):]) for line in raw.split(b"\n\n") if line.startswith(b"data: ")]
    assert status == 200 and events[-1]["stop"] is True and all(e["stop"] is False for e in events[:-1])
    assert "".join(e["content"] for e in events) == whole["content"]
    assert events[-1]["timings"]["predicted_n"] == 12


def test_health_tokenize_detokenize(coder):
    with urllib.request.urlopen(f"http://127.0.0.1:{coder.port}/health", timeout=10) as r:
        assert json.load(r) == {"status": "ok"}
    status, raw = post_raw(coder, "/tokenize", {"content": "def main():\n    pass", "with_pieces": True})
    pieces = json.loads(raw)["tokens"]
    assert status == 200 and "".join(p["piece"] for p in pieces) == "def main():\n    pass"
    ids = [p["id"] for p in pieces]
    assert json.loads(post_raw(coder, "/tokenize", {"content": "def main():\n    pass"})[1]) == {"tokens": ids}
    assert json.loads(post_raw(coder, "/detokenize", {"tokens": ids})[1]) == {"content": "def main():\n    pass"}


INFILL = {"input_prefix": "x = ", "input_suffix": "\n", "n_predict": 2}

# Bad requests: (path, body, status, error type).
BAD = [
    ("/infill", b"{nope", 400, "invalid_request_error"),
    ("/infill", b"[1]", 400, "invalid_request_error"),
    ("/infill", {}, 400, "invalid_request_error"),
    ("/infill", {"input_prefix": "x"}, 400, "invalid_request_error"),
    ("/infill", {**INFILL, "input_prefix": 5}, 400, "invalid_request_error"),
    ("/infill", {**INFILL, "input_extra": "file"}, 400, "invalid_request_error"),
    ("/infill", {**INFILL, "input_extra": [{"filename": "a.py"}]}, 400, "invalid_request_error"),
    ("/infill", {**INFILL, "frobnicate": 1}, 400, "invalid_request_error"),
    ("/infill", {**INFILL, "n_predict": -7}, 400, "invalid_request_error"),
    ("/infill", {**INFILL, "n_predict": 10**9}, 400, "invalid_request_error"),
    ("/infill", {**INFILL, "temperature": 9}, 400, "invalid_request_error"),
    ("/infill", {**INFILL, "top_p": 0}, 400, "invalid_request_error"),
    ("/infill", {**INFILL, "top_k": -1}, 400, "invalid_request_error"),
    ("/infill", {**INFILL, "min_p": 2}, 400, "invalid_request_error"),
    ("/infill", {**INFILL, "samplers": ["top_k", "mirostat"]}, 400, "invalid_request_error"),
    ("/infill", {**INFILL, "samplers": "kfypmt"}, 400, "invalid_request_error"),
    ("/infill", {**INFILL, "stop": [""]}, 400, "invalid_request_error"),
    ("/infill", {**INFILL, "prompt": [1, 2, 3]}, 400, "invalid_request_error"),
    ("/infill", {**INFILL, "model": "other-model"}, 400, "invalid_request_error"),
    ("/infill", {**INFILL, "lora": [{"id": 0, "scale": 0.5}]}, 400, "invalid_request_error"),
    ("/infill", {**INFILL, "n_probs": 5}, 400, "invalid_request_error"),
    ("/infill", {**INFILL, "n_cmpl": 0}, 400, "invalid_request_error"),
    ("/infill", {**INFILL, "input_prefix": "word " * 40000}, 400, "exceed_context_size_error"),
    ("/completion", {"prompt": ""}, 400, "invalid_request_error"),
    ("/completion", {"prompt": "hi", "json_schema": {"type": "nonsense"}}, 400, "invalid_request_error"),
    ("/completion", {"prompt": "hi", "json_schema": 3}, 400, "invalid_request_error"),
    ("/completion", {"prompt": "hi", "grammar": "root ::= \"a\""}, 400, "invalid_request_error"),
    ("/completion", {"prompt": "hi", "input_suffix": "x"}, 400, "invalid_request_error"),
    ("/tokenize", {"text": "hi"}, 400, "invalid_request_error"),
    ("/detokenize", {"tokens": [10**9]}, 400, "invalid_request_error"),
    ("/detokenize", {"tokens": "abc"}, 400, "invalid_request_error"),
]


def test_json_schema_constrains_a_completion(coder):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "args": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}},
              "required": ["name", "args"], "additionalProperties": False}
    body = {"prompt": "# a function call as JSON\n", "n_predict": 64, "temperature": 0, "json_schema": schema}
    status, raw = post_raw(coder, "/completion", body)
    got = json.loads(raw)
    out = json.loads(got["content"])
    assert status == 200 and set(out) == {"name", "args"} and isinstance(out["name"], str), got
    assert got["stop_type"] == "eos", got


@pytest.mark.parametrize("path,body,status,kind", BAD)
def test_bad_requests_get_llamacpp_errors(coder, path, body, status, kind):
    got_status, raw = post_raw(coder, path, body)
    got = json.loads(raw)
    assert got_status == status, got
    assert set(got) == {"error"} and got["error"]["code"] == status and got["error"]["type"] == kind and got["error"]["message"], got


def test_infill_on_a_model_without_fim_tokens_is_not_supported(smollm2):
    status, raw = post_raw(smollm2, "/infill", INFILL)
    got = json.loads(raw)
    assert status == 501 and got["error"]["type"] == "not_supported_error", got
    status, raw = post_raw(smollm2, "/health", b"", {})
    assert status == 405


def test_a_guarded_server_wants_its_key(guarded):
    from conftest import TOKEN

    assert post_raw(guarded, "/completion", {"prompt": "hi", "n_predict": 1}, {"Authorization": "Bearer "})[0] == 401
    assert post_raw(guarded, "/completion", {"prompt": "hi", "n_predict": 1}, {"X-Api-Key": TOKEN})[0] == 200
    with urllib.request.urlopen(f"http://127.0.0.1:{guarded.port}/health", timeout=10) as r:
        assert r.status == 200
