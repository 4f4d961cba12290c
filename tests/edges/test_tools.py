"""Tool calls through the official `openai` SDK on Qwen2.5-Coder-0.5B: the
agent loop (the model calls a tool, the result comes back as a `tool`
message or a `function_call_output` item, and the answer uses it, reading
only the new tokens) over Chat Completions and over the Responses API's
WebSocket mode; streamed calls as `tool_calls` deltas and function-call
events; every call's arguments validated against its tool's schema with
`jsonschema`; bad tools as the SDK raises them.
"""
import json

import jsonschema
import openai
import pytest

MODEL = "qwen2.5-coder-0.5b"

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"], "additionalProperties": False}
CHAT_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "The local time in a time zone", "parameters": TIME}},
]
RESPONSE_TOOLS = [{"type": "function", **t["function"]} for t in CHAT_TOOLS]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
QUESTION = "What is the weather in Paris right now?"
RESULT = json.dumps({"temperature_c": 18, "sky": "cloudy"})
# The prefix cache's granularity: a turn re-reads at most the last partial block of the one before.
BLOCK = 16
# The answer as a JSON object, so the test can read what the model did with the result.
ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"], "additionalProperties": False}


def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="sk-tools", max_retries=0, timeout=300)


def valid_call(name, arguments):
    assert name in SCHEMAS, name
    args = json.loads(arguments)
    jsonschema.validate(args, SCHEMAS[name])
    return args


def test_chat_agent_loop_calls_a_tool_and_answers_from_its_result(coder):
    c = client(coder)
    messages = [{"role": "user", "content": QUESTION}]
    # The model decides to call (tool_choice "auto").
    first = c.chat.completions.create(model=MODEL, messages=messages, tools=CHAT_TOOLS, temperature=0, max_tokens=80)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert valid_call(call.function.name, call.function.arguments)["city"] == "Paris"

    messages += [choice.message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
    answer = c.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=CHAT_TOOLS,
        tool_choice="none",
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA}},
        temperature=0,
        max_tokens=80,
    )
    assert answer.choices[0].finish_reason == "stop"
    assert not answer.choices[0].message.tool_calls
    assert "18" in json.loads(answer.choices[0].message.content)["answer"], answer.choices[0].message.content
    # The second turn continued from the first one's cache (up to its last
    # block: the model wrote the call without its tags, the template shows them).
    assert answer.usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens - BLOCK, (first.usage, answer.usage)


def test_streamed_calls_are_the_whole_answers_calls(coder):
    c = client(coder)
    for tool_choice in ("auto", "required", {"type": "function", "function": {"name": "get_time"}}):
        args = dict(model=MODEL, messages=[{"role": "user", "content": "What time is it in Tokyo?"}], tools=CHAT_TOOLS, tool_choice=tool_choice, temperature=0, max_tokens=80)
        whole = c.chat.completions.create(**args).choices[0]
        calls, finish, content = {}, None, ""
        for chunk in c.chat.completions.create(**args, stream=True):
            delta = chunk.choices[0].delta
            content += delta.content or ""
            for t in delta.tool_calls or []:
                calls.setdefault(t.index, {"id": t.id, "name": t.function.name, "arguments": ""})["arguments"] += t.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        assert finish == whole.finish_reason == "tool_calls", (tool_choice, whole)
        assert content == ""
        streamed = [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)]
        assert streamed == [(t.function.name, json.loads(t.function.arguments)) for t in whole.message.tool_calls], tool_choice
        for name, _ in streamed:
            assert name == "get_time" or tool_choice == "auto"
        for t in whole.message.tool_calls:
            valid_call(t.function.name, t.function.arguments)


def test_required_calls_validate_greedy_and_sampled(coder):
    c = client(coder)
    questions = ["What is the weather in Oslo?", "Is it raining in Lima? Use fahrenheit.", "What time is it in New York?", "Weather in Rome and the time in Cairo?"]
    for q in questions:
        for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 7}):
            r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": q}], tools=CHAT_TOOLS, tool_choice="required", max_tokens=120, **sampling)
            choice = r.choices[0]
            assert choice.message.tool_calls, (q, sampling, choice)
            for t in choice.message.tool_calls:
                valid_call(t.function.name, t.function.arguments)


def test_responses_socket_agent_loop_with_function_call_items(coder):
    c = client(coder)
    with c.responses.connect() as conn:
        conn.response.create(model=MODEL, input=QUESTION, tools=RESPONSE_TOOLS, tool_choice="required", temperature=0, max_output_tokens=80, store=False)
        events = []
        for event in conn:
            events.append(event)
            if event.type in ("response.completed", "response.failed", "response.incomplete", "error"):
                break
        first = events[-1].response
        assert events[-1].type == "response.completed", events[-1]
        [item] = first.output
        assert item.type == "function_call" and item.status == "completed"
        assert valid_call(item.name, item.arguments)["city"] == "Paris"
        kinds = [e.type for e in events]
        assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds, kinds
        done = next(e for e in events if e.type == "response.function_call_arguments.done")
        assert json.loads(done.arguments) == json.loads(item.arguments)

        conn.response.create(
            input=[{"type": "function_call_output", "call_id": item.call_id, "output": RESULT}],
            previous_response_id=first.id,
            tools=RESPONSE_TOOLS,
            tool_choice="none",
            text={"format": {"type": "json_schema", "name": "answer", "schema": ANSWER_SCHEMA}},
            temperature=0,
            max_output_tokens=80,
            store=False,
        )
        for event in conn:
            if event.type in ("response.completed", "response.failed", "response.incomplete", "error"):
                break
        second = event.response
    assert event.type == "response.completed", event
    assert "18" in json.loads(second.output_text)["answer"], second.output_text
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens, (first.usage, second.usage)


def test_responses_http_returns_function_calls_and_takes_them_back(coder):
    c = client(coder)
    first = c.responses.create(model=MODEL, input="What time is it in Tokyo?", tools=RESPONSE_TOOLS, tool_choice={"type": "function", "name": "get_time"}, temperature=0, max_output_tokens=80)
    [item] = first.output
    assert item.type == "function_call" and item.name == "get_time"
    valid_call(item.name, item.arguments)
    assert first.tool_choice.name == "get_time" and [t.name for t in first.tools] == ["get_weather", "get_time"]
    # The whole conversation sent back as items, without previous_response_id.
    second = c.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": "What time is it in Tokyo?"},
            {"type": "function_call", "call_id": item.call_id, "name": item.name, "arguments": item.arguments},
            {"type": "function_call_output", "call_id": item.call_id, "output": "09:41"},
        ],
        tools=RESPONSE_TOOLS,
        tool_choice="none",
        temperature=0,
        max_output_tokens=40,
    )
    assert second.status in ("completed", "incomplete") and second.output[0].type == "message" and second.output_text.strip(), second


def test_auto_beside_a_response_format_calls_or_answers_in_the_format(coder):
    """tool_choice "auto" with a response_format: the model may call (and
    does, for the weather) or answer, and an answer is in the format."""
    c = client(coder)
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA, "strict": True}}
    for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 11}):
        r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}], tools=CHAT_TOOLS, response_format=fmt, max_tokens=80, **sampling)
        choice = r.choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
            for t in choice.message.tool_calls:
                valid_call(t.function.name, t.function.arguments)
        else:
            jsonschema.validate(json.loads(choice.message.content), ANSWER_SCHEMA)
    # Greedy, the weather question is a call, the same through the Responses API.
    first = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}], tools=CHAT_TOOLS, response_format=fmt, temperature=0, max_tokens=80)
    [call] = first.choices[0].message.tool_calls
    assert valid_call(call.function.name, call.function.arguments)["city"] == "Paris"
    text_format = {"format": {"type": "json_schema", "name": "answer", "schema": ANSWER_SCHEMA, "strict": True}}
    r = c.responses.create(model=MODEL, input=QUESTION, tools=RESPONSE_TOOLS, text=text_format, temperature=0, max_output_tokens=80)
    [item] = r.output
    assert item.type == "function_call", r
    assert valid_call(item.name, item.arguments)["city"] == "Paris"


@pytest.mark.parametrize(
    "tools, tool_choice, words",
    [
        ([{"type": "web_search"}], None, "function only"),
        ([{"type": "function", "function": {"description": "no name"}}], None, "name"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}], "required", "nonsense"),
        (CHAT_TOOLS, {"type": "function", "function": {"name": "missing"}}, "missing"),
        (CHAT_TOOLS, "sometimes", "sometimes"),
        ([CHAT_TOOLS[0], CHAT_TOOLS[0]], None, "twice"),
        ([{"type": "function", "function": {"name": "f", "parameters": "object"}}], None, "parameters"),
    ],
)
def test_bad_tools_raise_bad_request_errors(coder, tools, tool_choice, words):
    c = client(coder)
    extra = {} if tool_choice is None else {"tool_choice": tool_choice}
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], tools=tools, max_tokens=8, **extra)
    assert words in str(e.value), str(e.value)
    # The server goes on: a greedy answer to "hi", cut at its four tokens.
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0)
    assert r.choices[0].message.content.strip() and r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4, r
