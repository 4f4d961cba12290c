"""Tether's OpenAI-compatible HTTP edge, driven by the official `openai`
Python SDK (pinned in requirements.txt) against real servers on real ports
with real models: models.list, chat completions whole and streamed,
completions with and without `suffix`, logprobs, stop strings, the prefix
cache across requests within a tenant (never across), errors as the SDK
raises them, and a client that hangs up mid-stream.
"""
import json
import socket
import time

import openai
import pytest

from conftest import TOKEN

MODEL = "smollm2-135m"
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


def client(server, api_key="sk-anything"):
    return openai.OpenAI(base_url=server.base_url, api_key=api_key, max_retries=0, timeout=120)


def assert_answered(r, max_tokens):
    """A chat completion that answered: non-empty text, and usage that adds
    up. The test prompts are questions a greedy SmolLM2 answers at length,
    so a small `max_tokens` is always what ends them."""
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content and choice.message.content.strip(), r
    assert choice.finish_reason == "length" and r.usage.completion_tokens == max_tokens, r
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens, r.usage


def test_models_lists_the_served_model(smollm2):
    models = client(smollm2).models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_chat_whole_and_streamed_give_the_same_greedy_text(smollm2):
    c = client(smollm2)
    whole = c.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0)
    choice = whole.choices[0]
    assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert whole.usage.completion_tokens > 0 and whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens

    chunks = list(c.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == choice.message.content
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finishes == [choice.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_a_conversations_next_turn_reuses_the_cache_within_its_tenant_only(smollm2):
    c = client(smollm2, api_key="sk-tenant-cache")
    turn1 = c.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=16, temperature=0)
    history = QUESTION + [{"role": "assistant", "content": turn1.choices[0].message.content}, {"role": "user", "content": "And of Italy?"}]
    turn2 = c.chat.completions.create(model=MODEL, messages=history, max_tokens=8, temperature=0)
    cached = turn2.usage.prompt_tokens_details.cached_tokens
    assert cached >= 32 and cached < turn2.usage.prompt_tokens, turn2.usage

    other = client(smollm2, api_key="sk-another-tenant").chat.completions.create(model=MODEL, messages=history, max_tokens=8, temperature=0)
    assert other.usage.prompt_tokens_details.cached_tokens == 0, "tenants never share cache entries"
    assert other.choices[0].message.content == turn2.choices[0].message.content, "a cache hit must not change the output"


def test_an_answer_appended_as_returned_continues_the_conversation(smollm2):
    c = client(smollm2)
    first = c.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8, temperature=0)
    # What SDK users do: the returned message (with refusal, annotations...) goes back as is.
    history = QUESTION + [first.choices[0].message.model_dump(exclude_none=False), {"role": "user", "content": "And Spain?"}]
    second = c.chat.completions.create(model=MODEL, messages=history, max_tokens=4, temperature=0)
    assert_answered(second, max_tokens=4)
    # The returned message is in the prompt: the second turn's prompt holds
    # the first turn's prompt and answer, and more.
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + first.usage.completion_tokens, (first.usage, second.usage)
    # An assistant turn that called a tool, and the tool's result, continue it too.
    status, got = smollm2.post("/v1/chat/completions", {"model": MODEL, "max_tokens": 2, "messages": QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}]})
    assert status == 200 and got["choices"][0]["finish_reason"] in ("stop", "length"), got
    # The deprecated function_call is not taken.
    status, got = smollm2.post("/v1/chat/completions", {"model": MODEL, "max_tokens": 2, "messages": QUESTION + [
        {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}}]})
    assert status == 400 and "function_call" in got["error"]["message"], got


def test_continue_final_message_continues_a_prefill(smollm2):
    # vLLM's extension; the same prompt as the Anthropic edge's prefill, whose test writes it out.
    from test_anthropic import PREFILLED, RENDERED, TUTOR

    messages = [{"role": "system", "content": TUTOR}, *PREFILLED]
    r = client(smollm2).chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0, extra_body={"continue_final_message": True})
    status, plain = smollm2.post("/completion", {"prompt": RENDERED, "n_predict": 12, "temperature": 0})
    assert status == 200 and r.choices[0].message.content == plain["content"], (r, plain)
    assert r.usage.prompt_tokens == plain["tokens_evaluated"] and r.usage.completion_tokens == plain["tokens_predicted"]


def test_stop_strings_and_logprobs(smollm2):
    c = client(smollm2)
    r = c.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0, logprobs=True, top_logprobs=2, stop=["Paris"])
    choice = r.choices[0]
    # The greedy answer names Paris; with the stop string it ends just before.
    unstopped = c.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0).choices[0].message.content
    assert "Paris" in unstopped, unstopped
    assert choice.message.content == unstopped[: unstopped.index("Paris")] and choice.message.content.strip(), (choice.message.content, unstopped)
    assert choice.finish_reason == "stop"
    # One entry per generated token, the one that completed the stop string included.
    content = choice.logprobs.content
    assert len(content) == r.usage.completion_tokens > 0, (len(content), r.usage)
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob


def test_completions_raw_prompt_and_fill_in_the_middle(smollm2, coder):
    r = client(smollm2).completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=8, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text.startswith(" 5")
    assert r.usage.completion_tokens > 0

    with pytest.raises(openai.BadRequestError) as e:
        client(smollm2).completions.create(model=MODEL, prompt="def f(", suffix="\n", max_tokens=8)
    assert e.value.code == "fim_unsupported"

    fim = client(coder).completions.create(
        model="qwen2.5-coder-0.5b", prompt="def is_even(n):\n    return ", suffix="\n\nprint(is_even(4))\n", max_tokens=16, temperature=0, stop=["\n"]
    )
    assert "n % 2" in fim.choices[0].text, fim.choices[0].text


def test_completions_stream_with_logprobs(smollm2):
    chunks = list(client(smollm2).completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=6, temperature=0, logprobs=1, stream=True))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text.startswith(" 5")
    offsets = [o for ch in chunks if ch.choices and ch.choices[0].logprobs for o in ch.choices[0].logprobs.text_offset]
    assert offsets == sorted(offsets)


def test_a_request_without_a_length_cap_stops_at_the_servers_default(capped):
    c = client(capped)
    # Sampling at temperature 1 (OpenAI's default), as a user's first request would.
    chat = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Tell me a long story."}], seed=1)
    assert (chat.choices[0].finish_reason, chat.usage.completion_tokens) == ("length", 6), chat
    response = c.responses.create(model=MODEL, input="Tell me a long story.", temperature=0)
    assert response.status == "incomplete" and response.usage.output_tokens == 6, response
    # A cap the request gives is its own.
    asked = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Count to fifty."}], max_tokens=9, temperature=0)
    assert asked.usage.completion_tokens == 9


def test_errors_are_the_sdks_exceptions(smollm2):
    c = client(smollm2)
    before = c.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2, temperature=0)
    assert_answered(before, max_tokens=2)
    with pytest.raises(openai.NotFoundError) as e:
        c.chat.completions.create(model="gpt-nope", messages=QUESTION)
    assert e.value.code == "model_not_found" and e.value.param == "model"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=QUESTION, temperature=5)
    assert "temperature" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=QUESTION, n=2)
    assert e.value.param == "n"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=QUESTION, extra_body={"frobnicate": True})
    assert e.value.code == "unknown_parameter" and "frobnicate" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "word " * 9000}], max_tokens=4)
    assert e.value.code == "context_length_exceeded"
    # The server is unharmed: the same greedy answer as before the errors.
    after = c.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2, temperature=0)
    assert_answered(after, max_tokens=2)
    assert after.choices[0].message.content == before.choices[0].message.content


def test_bearer_tokens(guarded):
    with pytest.raises(openai.AuthenticationError) as e:
        client(guarded, api_key="sk-wrong").models.list()
    assert e.value.code == "invalid_api_key"
    r = client(guarded, api_key=TOKEN).chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2, temperature=0)
    assert_answered(r, max_tokens=2)


def test_a_client_that_hangs_up_mid_stream_frees_its_request(smollm2):
    # Counting goes on for thousands of tokens: only the hang-up ends it.
    stream = client(smollm2).completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=4000, temperature=0, stream=True)
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    deadline = time.time() + 20
    # The engine's numbers are null while a step runs past /healthz's short wait.
    while (h := smollm2.health())["requests_in_flight"] != 0 or (h["engine"] or {"running": 1})["running"] != 0:
        assert time.time() < deadline, h
        time.sleep(0.1)


# Bad requests on the raw wire: (body, status, error type, error code).
BAD_CHAT = [
    (b"{not json", 400, "invalid_request_error", None),
    (b"[1, 2]", 400, "invalid_request_error", None),
    ({}, 400, "invalid_request_error", "invalid_value"),
    ({"model": MODEL}, 400, "invalid_request_error", "invalid_value"),
    ({"model": MODEL, "messages": []}, 400, "invalid_request_error", None),
    ({"model": MODEL, "messages": "hello"}, 400, "invalid_request_error", "invalid_value"),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "invalid_request_error", None),
    ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "invalid_request_error", None),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi", "shout": True}]}, 400, "invalid_request_error", "invalid_value"),
    ({"model": 7, "messages": QUESTION}, 400, "invalid_request_error", "invalid_value"),
    ({"model": "other", "messages": QUESTION}, 404, "invalid_request_error", "model_not_found"),
    ({"model": MODEL, "messages": QUESTION, "temperature": -1}, 400, "invalid_request_error", "invalid_parameter"),
    ({"model": MODEL, "messages": QUESTION, "temperature": "hot"}, 400, "invalid_request_error", "invalid_value"),
    ({"model": MODEL, "messages": QUESTION, "top_p": 0}, 400, "invalid_request_error", "invalid_parameter"),
    ({"model": MODEL, "messages": QUESTION, "max_tokens": -5}, 400, "invalid_request_error", "invalid_value"),
    ({"model": MODEL, "messages": QUESTION, "max_tokens": 100000000}, 400, "invalid_request_error", "invalid_parameter"),
    ({"model": MODEL, "messages": QUESTION, "max_tokens": 4, "max_completion_tokens": 4}, 400, "invalid_request_error", None),
    ({"model": MODEL, "messages": QUESTION, "n": 3}, 400, "invalid_request_error", None),
    ({"model": MODEL, "messages": QUESTION, "stop": ["a"] * 20}, 400, "invalid_request_error", "invalid_parameter"),
    ({"model": MODEL, "messages": QUESTION, "stop": [""]}, 400, "invalid_request_error", "invalid_parameter"),
    ({"model": MODEL, "messages": QUESTION, "top_logprobs": 3}, 400, "invalid_request_error", None),
    ({"model": MODEL, "messages": QUESTION, "logprobs": True, "top_logprobs": 50}, 400, "invalid_request_error", "invalid_parameter"),
    ({"model": MODEL, "messages": QUESTION, "presence_penalty": 1.5}, 400, "invalid_request_error", None),
    ({"model": MODEL, "messages": QUESTION, "tools": [{"type": "web_search"}]}, 400, "invalid_request_error", None),
    ({"model": MODEL, "messages": QUESTION, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "always"}, 400, "invalid_request_error", None),
    ({"model": MODEL, "messages": QUESTION, "stream_options": {"include_usage": True}}, 400, "invalid_request_error", None),
    ({"model": MODEL, "messages": QUESTION, "surprise": 1}, 400, "invalid_request_error", "unknown_parameter"),
    ({"model": MODEL, "messages": QUESTION, "prompt_cache_key": ""}, 400, "invalid_request_error", None),
    ({"model": MODEL, "messages": QUESTION, "continue_final_message": True}, 400, "invalid_request_error", None),
]


@pytest.mark.parametrize("body,status,kind,code", BAD_CHAT)
def test_bad_chat_requests_get_typed_errors(smollm2, body, status, kind, code):
    got_status, got = smollm2.post("/v1/chat/completions", body)
    assert got_status == status, got
    assert set(got) == {"error"} and set(got["error"]) == {"message", "type", "param", "code"}, got
    assert got["error"]["type"] == kind and got["error"]["message"], got
    if code is not None:
        assert got["error"]["code"] == code, got


def raw_request(port, head, body=b"", wait=10.0):
    """Sends `head` and `body` as they are on a fresh connection and reads
    until the server answers and closes (or `wait` runs out): (seconds to the
    answer's first byte, the answer, whether the server closed)."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait) as s:
        s.sendall(head + body)
        started = time.time()
        answer, first = b"", None
        while True:
            try:
                chunk = s.recv(65536)
            except socket.timeout:
                return first, answer, False
            if not chunk:
                return first, answer, True
            first = first if first is not None else time.time() - started
            answer += chunk


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/completion"])
def test_a_declared_oversized_body_is_refused_before_it_is_sent(smollm2, path):
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 99999999999999\r\n\r\n".encode()
    first, answer, closed = raw_request(smollm2.port, head, b'{"model": ')
    assert first is not None and first < 2.0 and answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b"connection: close" in answer.lower() and closed, answer[:300]
    # In the edge's own shape: OpenAI's code, llama.cpp's numeric one.
    assert (b'"code":"request_too_large"' if path.startswith("/v1/") else b'"code":413') in answer, answer[:300]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/completion"])
def test_a_body_that_never_finishes_is_timed_out(impatient, path):
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n".encode()
    first, answer, closed = raw_request(impatient.port, head, b'{"model": "x", ', wait=15.0)
    assert first is not None and 1.5 < first < 6.0 and answer.startswith(b"HTTP/1.1 408"), (first, answer[:200])
    assert closed, answer[:300]
    status, got = impatient.post("/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 2})
    assert status == 200, got


def test_every_connection_counts_toward_the_cap(crowded):
    """Plain HTTP connections count toward --max-connections as WebSockets
    do: three idle ones fill a server of three, a fourth is answered 503 and
    closed, and once one goes the server serves again."""
    idle = [socket.create_connection(("127.0.0.1", crowded.port)) for _ in range(3)]
    time.sleep(0.3)
    head = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    first, answer, closed = raw_request(crowded.port, head)
    assert answer.startswith(b"HTTP/1.1 503") and closed, answer[:300]
    body = json.loads(answer.split(b"\r\n\r\n", 1)[1])
    assert body["error"]["code"] == "server_busy" and body["error"]["type"] == "server_error", body
    idle.pop().close()
    deadline = time.time() + 10
    while not raw_request(crowded.port, head)[1].startswith(b"HTTP/1.1 200"):
        assert time.time() < deadline, "a freed place was not taken back"
        time.sleep(0.1)
    for s in idle:
        s.close()


def test_oversized_bodies_and_wrong_methods(smollm2):
    # (An oversized body: test_a_declared_oversized_body_is_refused_before_it_is_sent. Sent
    # whole, its upload races the early 413's close, and the client may get a broken pipe.)
    status, got = smollm2.post("/v1/models", {})
    assert status == 405
    # Every unknown path and wrong method answers in OpenAI's error shape.
    for path, want in [("/v1/nothing-here", 404), ("/nothing-here", 404), ("/healthz", 405), ("/v1/ws", 405)]:
        status, got = smollm2.post(path, {})
        assert status == want and set(got) == {"error"} and set(got["error"]) == {"message", "type", "param", "code"}, (path, got)
        assert got["error"]["type"] == "invalid_request_error" and path in got["error"]["message"], (path, got)
    # Still serving.
    status, got = smollm2.post("/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 2})
    assert status == 200 and got["choices"][0]["finish_reason"] in ("stop", "length")
