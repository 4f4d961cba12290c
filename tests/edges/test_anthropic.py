"""Anthropic's Messages API through the official `anthropic` SDK: whole and
streamed messages (the same greedy text, the event sequence Anthropic's
clients parse), stop reasons and sequences, the agent loop with `tool_use`
and `tool_result` blocks held to the tools' schemas (the next turn reading
only its new tokens), a prefill continued as the same prompt written out
continues, `count_tokens`, and errors in Anthropic's shape and statuses as
the SDK raises them.
"""
import json

import anthropic
import urllib.error
import urllib.request
import jsonschema
import pytest

from conftest import TOKEN

SMOL = "smollm2-135m"
CODER = "qwen2.5-coder-0.5b"
# The prefix cache's granularity: a turn re-reads at most the last partial block of the one before.
BLOCK = 16
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {"name": "get_weather", "description": "The current weather in a city", "input_schema": WEATHER},
    {
        "name": "get_time",
        "description": "The local time in a time zone",
        "input_schema": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]},
    },
]
ANSWER = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"], "additionalProperties": False}
HELLO = [{"role": "user", "content": "Write one sentence about the sea."}]
# The current SDK has no sampling fields; older clients send them in the body.
GREEDY = {"temperature": 0}


def client(server, key="sk-anthropic"):
    return anthropic.Anthropic(base_url=f"http://127.0.0.1:{server.port}", api_key=key, max_retries=0, timeout=300)


def text_of(message):
    return "".join(b.text for b in message.content if b.type == "text")


def test_whole_and_streamed_messages_agree(smollm2):
    c = client(smollm2)
    whole = c.messages.create(model=SMOL, max_tokens=12, messages=HELLO, extra_body=GREEDY)
    assert whole.type == "message" and whole.role == "assistant" and whole.id.startswith("msg_")
    assert whole.stop_reason == "max_tokens" and whole.stop_sequence is None
    assert whole.usage.output_tokens == 12
    assert whole.usage.input_tokens + whole.usage.cache_read_input_tokens == c.messages.count_tokens(model=SMOL, messages=HELLO).input_tokens

    with c.messages.stream(model=SMOL, max_tokens=12, messages=HELLO, extra_body=GREEDY) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert text_of(streamed) == text_of(whole) and text_of(whole)
    assert streamed.stop_reason == "max_tokens" and streamed.usage.output_tokens == 12
    # The same prompt again: read from the prefix cache.
    assert streamed.usage.cache_read_input_tokens >= whole.usage.input_tokens + whole.usage.cache_read_input_tokens - BLOCK
    assert kinds[0] == "message_start" and kinds[1] == "content_block_start"
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]

    # Raw events: Anthropic's names, a ping after message_start.
    raw = urllib.request.Request(
        f"http://127.0.0.1:{smollm2.port}/v1/messages",
        data=json.dumps({"model": SMOL, "max_tokens": 4, "messages": HELLO, "stream": True, **GREEDY}).encode(),
        headers={"anthropic-version": "2023-06-01", "x-api-key": "sk-anthropic", "content-type": "application/json"},
    )
    with urllib.request.urlopen(raw, timeout=120) as r:
        assert r.status == 200 and r.headers["content-type"] == "text/event-stream"
        names = [line.decode().strip().removeprefix("event: ") for line in r if line.startswith(b"event: ")]
    assert names[:3] == ["message_start", "ping", "content_block_start"], names


def test_a_stop_sequence_ends_the_turn_and_is_named(smollm2):
    c = client(smollm2)
    text = text_of(c.messages.create(model=SMOL, max_tokens=12, messages=HELLO, extra_body=GREEDY))
    word = text.split()[2]
    stopped = c.messages.create(model=SMOL, max_tokens=12, messages=HELLO, stop_sequences=["never appears", word], extra_body=GREEDY)
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert text.startswith(text_of(stopped)) and word not in text_of(stopped)


def test_agent_loop_with_tool_use_and_tool_result_blocks(coder):
    c = client(coder)
    messages = [{"role": "user", "content": "What is the weather in Paris right now?"}]
    first = c.messages.create(model=CODER, max_tokens=80, messages=messages, tools=TOOLS, extra_body=GREEDY)
    assert first.stop_reason == "tool_use", first
    [call] = [b for b in first.content if b.type == "tool_use"]
    assert call.name == "get_weather"
    jsonschema.validate(call.input, WEATHER)
    assert call.input["city"] == "Paris"

    messages += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "18C and cloudy"}]},
    ]
    # The answer as a JSON object, so the test can read what the model did with the result.
    answer = c.messages.create(
        model=CODER,
        max_tokens=80,
        messages=messages,
        tools=TOOLS,
        tool_choice={"type": "none"},
        output_config={"format": {"type": "json_schema", "schema": ANSWER}},
        extra_body=GREEDY,
    )
    assert answer.stop_reason == "end_turn" and not [b for b in answer.content if b.type == "tool_use"]
    assert "18" in json.loads(text_of(answer))["answer"], text_of(answer)
    # The second turn continued from the first one's cache.
    first_prompt = first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert answer.usage.cache_read_input_tokens > first_prompt - BLOCK, (first.usage, answer.usage)

    # A named tool, streamed: its input arrives as input_json_delta.
    with c.messages.stream(
        model=CODER, max_tokens=60, messages=messages[:1], tools=TOOLS, tool_choice={"type": "tool", "name": "get_time"}, extra_body=GREEDY
    ) as stream:
        deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert "input_json_delta" in deltas and final.stop_reason == "tool_use"
    [timed] = [b for b in final.content if b.type == "tool_use"]
    assert timed.name == "get_time" and isinstance(timed.input["zone"], str)


# A prefill and the same conversation as SmolLM2's chat template (ChatML)
# writes it, the final turn left open after the prefill's text.
TUTOR = "You are a geography tutor."
PREFILLED = [{"role": "user", "content": "What is the capital of France?"}, {"role": "assistant", "content": "The capital of France is"}]
RENDERED = (
    "<|im_start|>system\nYou are a geography tutor.<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    "<|im_start|>assistant\nThe capital of France is"
)


def test_a_prefill_is_continued_not_repeated(smollm2):
    c = client(smollm2)
    whole = c.messages.create(model=SMOL, max_tokens=12, system=TUTOR, messages=PREFILLED, extra_body=GREEDY)
    # The same prompt as plain text, through llama.cpp's /completion: the same tokens follow it.
    status, plain = smollm2.post("/completion", {"prompt": RENDERED, "n_predict": 12, "temperature": 0})
    assert status == 200 and plain["content"], plain
    assert text_of(whole) == plain["content"] and whole.usage.output_tokens == plain["tokens_predicted"], (whole, plain)
    prompt_tokens = whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    assert prompt_tokens == len(smollm2.post("/tokenize", {"content": RENDERED})[1]["tokens"])
    assert c.messages.count_tokens(model=SMOL, system=TUTOR, messages=PREFILLED).input_tokens == prompt_tokens
    # The answer continues the prefill; it does not repeat it.
    assert not text_of(whole).lstrip().startswith("The capital")
    with c.messages.stream(model=SMOL, max_tokens=12, system=TUTOR, messages=PREFILLED, extra_body=GREEDY) as stream:
        streamed = stream.get_final_message()
    assert text_of(streamed) == text_of(whole)
    # As Anthropic's API: a prefill that ends in whitespace is refused.
    trailing = [PREFILLED[0], {"role": "assistant", "content": "The capital of France is "}]
    status, body = smollm2.post("/v1/messages", {"model": SMOL, "max_tokens": 4, "messages": trailing})
    assert (status, body) == (
        400,
        {"type": "error", "error": {"type": "invalid_request_error", "message": "messages: final assistant content cannot end with trailing whitespace"}},
    )
    with pytest.raises(anthropic.BadRequestError):
        c.messages.create(model=SMOL, max_tokens=4, messages=trailing)


def test_structured_output_follows_its_schema(smollm2):
    schema = {"type": "object", "properties": {"sea": {"type": "string", "maxLength": 40}}, "required": ["sea"], "additionalProperties": False}
    m = client(smollm2).messages.create(
        model=SMOL, max_tokens=60, messages=HELLO, output_config={"format": {"type": "json_schema", "schema": schema}}, extra_body=GREEDY
    )
    assert m.stop_reason == "end_turn"
    jsonschema.validate(json.loads(text_of(m)), schema)


def test_errors_come_in_anthropics_shape(smollm2, guarded):
    c = client(smollm2)
    ok = dict(model=SMOL, max_tokens=4, messages=HELLO)
    cases = [
        (anthropic.BadRequestError, dict(ok, extra_body={"frobnicate": 1}), "frobnicate: Extra inputs are not permitted"),
        (anthropic.BadRequestError, dict(ok, messages=[{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}]), "image"),
        (anthropic.BadRequestError, dict(ok, thinking={"type": "enabled", "budget_tokens": 1024}), "extended thinking"),
        (anthropic.BadRequestError, dict(ok, messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x"}]}]), "tool_use_id"),
        (anthropic.BadRequestError, dict(ok, messages=[{"role": "user", "content": "word " * 9000}]), "token"),
        (anthropic.NotFoundError, dict(ok, model="another-model"), "does not exist"),
    ]
    for error, kwargs, words in cases:
        with pytest.raises(error) as e:
            c.messages.create(**kwargs)
        assert e.value.body["type"] == "error" and words in e.value.body["error"]["message"], e.value.body
        assert e.value.request_id and e.value.request_id.startswith("req_")
    with pytest.raises(anthropic.AuthenticationError):
        client(guarded, key="sk-wrong").messages.create(**ok)
    assert text_of(client(guarded, key=TOKEN).messages.create(**ok))
    status, body = smollm2.post("/v1/messages", {"model": SMOL, "messages": HELLO})
    assert status == 400 and body["error"] == {"type": "invalid_request_error", "message": "max_tokens: Field required"}
    status, body = smollm2.post("/v1/messages", b'{"model": ', {"anthropic-version": "2023-06-01"})
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    status, body = smollm2.post("/v1/messages", dict(ok), {"anthropic-version": "latest"})
    assert status == 400 and "anthropic-version" in body["error"]["message"]
    # The server still serves.
    assert text_of(c.messages.create(**ok))


U = [{"role": "user", "content": "hi"}]
# (body, status, error type, words in the message): each refused whole, in Anthropic's shape.
BAD_BODIES = [
    (b"not json", 400, "invalid_request_error", ""),
    (b"[1, 2]", 400, "invalid_request_error", "object"),
    (b'{"model": "smollm2-135m", "max_tokens": 4, "max_tokens": 8, "messages": []}', 400, "invalid_request_error", "duplicate field `max_tokens`"),
    ({"max_tokens": 4, "messages": U}, 400, "invalid_request_error", "model: Field required"),
    ({"model": SMOL, "max_tokens": 4}, 400, "invalid_request_error", "messages: Field required"),
    ({"model": SMOL, "max_tokens": 4, "messages": []}, 400, "invalid_request_error", "at least one message"),
    ({"model": SMOL, "max_tokens": 4, "messages": "hi"}, 400, "invalid_request_error", "messages: Input should be a valid list"),
    ({"model": SMOL, "max_tokens": -1, "messages": U}, 400, "invalid_request_error", "max_tokens"),
    ({"model": SMOL, "max_tokens": "8", "messages": U}, 400, "invalid_request_error", "max_tokens"),
    ({"model": SMOL, "max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}, 400, "invalid_request_error", "messages.0.role"),
    ({"model": SMOL, "max_tokens": 4, "messages": [{"role": "user"}]}, 400, "invalid_request_error", "messages.0.content: Field required"),
    ({"model": SMOL, "max_tokens": 4, "messages": [{"role": "user", "content": 5}]}, 400, "invalid_request_error", "messages.0.content"),
    ({"model": SMOL, "max_tokens": 4, "messages": [{"role": "user", "content": "x", "name": "n"}]}, 400, "invalid_request_error", "messages.0.name: Extra inputs"),
    ({"model": SMOL, "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400, "invalid_request_error", "messages.0.content.0.text: Field required"),
    ({"model": SMOL, "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, 400, "invalid_request_error", "document"),
    ({"model": SMOL, "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "thinking", "thinking": "x"}]}]}, 400, "invalid_request_error", "thinking"),
    ({"model": SMOL, "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]}, 400, "invalid_request_error", "assistant messages"),
    ({"model": SMOL, "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "banana"}]}]}, 400, "invalid_request_error", "unknown content block"),
    ({"model": SMOL, "max_tokens": 4, "messages": U, "system": 7}, 400, "invalid_request_error", "system"),
    ({"model": SMOL, "max_tokens": 4, "messages": U, "system": [{"type": "image"}]}, 400, "invalid_request_error", "system.0"),
    ({"model": SMOL, "max_tokens": 4, "messages": U, "temperature": "hot"}, 400, "invalid_request_error", "temperature"),
    ({"model": SMOL, "max_tokens": 4, "messages": U, "top_p": 0}, 400, "invalid_request_error", "top_p"),
    ({"model": SMOL, "max_tokens": 4, "messages": U, "top_k": -3}, 400, "invalid_request_error", "top_k"),
    ({"model": SMOL, "max_tokens": 4, "messages": U, "stop_sequences": "END"}, 400, "invalid_request_error", "stop_sequences"),
    ({"model": SMOL, "max_tokens": 4, "messages": U, "stop_sequences": [""]}, 400, "invalid_request_error", "stop"),
    ({"model": SMOL, "max_tokens": 4, "messages": U, "stream": "yes"}, 400, "invalid_request_error", "stream"),
    ({"model": SMOL, "max_tokens": 4, "messages": U, "metadata": {"session": "x"}}, 400, "invalid_request_error", "metadata.session"),
    ({"model": SMOL, "max_tokens": 4, "messages": U, "tools": [{"name": "f"}]}, 400, "invalid_request_error", "tools.0.input_schema: Field required"),
    ({"model": SMOL, "max_tokens": 4, "messages": U, "tools": [{"name": "f", "input_schema": {"type": "array"}}]}, 400, "invalid_request_error", "input_schema.type"),
    ({"model": SMOL, "max_tokens": 4, "messages": U, "tools": [{"name": "bad name!", "input_schema": {"type": "object"}}]}, 400, "invalid_request_error", "name"),
    ({"model": SMOL, "max_tokens": 4, "messages": U, "tool_choice": {"type": "any"}}, 400, "invalid_request_error", "tools` is empty"),
    ({"model": SMOL, "max_tokens": 4, "messages": U, "tool_choice": {"type": "sometimes"}}, 400, "invalid_request_error", "tool_choice.type"),
    ({"model": SMOL, "max_tokens": 4, "messages": U, "output_config": {"format": {"type": "json_object"}}}, 400, "invalid_request_error", "output_config.format.type"),
    ({"model": SMOL, "max_tokens": 4, "messages": U, "cache_control": {"type": "forever"}}, 400, "invalid_request_error", "cache_control.type"),
    ({"model": SMOL, "max_tokens": 4, "messages": U, "mcp_servers": []}, 400, "invalid_request_error", "mcp_servers"),
    ({"model": SMOL, "max_tokens": 4, "messages": [*U, {"role": "assistant", "content": "Hello\n"}]}, 400, "invalid_request_error", "trailing whitespace"),
    ({"model": SMOL, "max_tokens": 4, "messages": [*U, {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
     400, "invalid_request_error", "messages.1: tool_use blocks in a final assistant message are not supported"),
    ({"model": "gpt-4o", "max_tokens": 4, "messages": U}, 404, "not_found_error", "does not exist"),
]


@pytest.mark.parametrize("body,status,kind,words", BAD_BODIES, ids=range(len(BAD_BODIES)))
def test_bad_bodies_are_refused_in_anthropics_shape(smollm2, body, status, kind, words):
    got, reply = smollm2.post("/v1/messages", body, {"anthropic-version": "2023-06-01"})
    assert (got, reply["type"], reply["error"]["type"]) == (status, "error", kind), reply
    assert words in reply["error"]["message"], reply


def test_the_edge_answers_methods_and_keeps_serving(smollm2):
    req = urllib.request.Request(f"http://127.0.0.1:{smollm2.port}/v1/messages", method="GET")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 405 and e.value.headers["allow"] == "POST"
    assert json.loads(e.value.read())["error"]["type"] == "invalid_request_error"
    assert text_of(client(smollm2).messages.create(model=SMOL, max_tokens=4, messages=U))
