"""Structured outputs through the official `openai` SDK: JSON Schemas of the
kinds agents send (nested objects, arrays, enums, required fields, string
formats and patterns, $ref, anyOf, nullables), greedy and sampled, each
answer checked with an independent validator (`jsonschema`, formats
included); `chat.completions.parse` and `responses.parse` with pydantic
models; streamed structured output; bad schemas as the SDK raises them.
"""
import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pydantic
import pytest

MODEL = "qwen2.5-coder-0.5b"


def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="sk-structured", max_retries=0, timeout=300)


def obj(properties, required=None, **extra):
    return {"type": "object", "properties": properties, "required": list(required if required is not None else properties), "additionalProperties": False, **extra}


STR = {"type": "string", "maxLength": 40}

# (name, instruction, schema): what agents ask models for.
SCHEMAS = [
    ("weather_args", "Arguments to get the weather in Paris.", obj({"location": STR, "unit": {"enum": ["celsius", "fahrenheit"]}})),
    ("search_args", "Search the web for rust async tutorials.", obj({"query": STR, "max_results": {"type": "integer", "minimum": 1, "maximum": 10}})),
    ("person_address", "A person and their address.", obj({"name": STR, "address": obj({"street": STR, "city": STR, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}})})),
    ("todo_list", "Three tasks for today.", obj({"tasks": {"type": "array", "items": obj({"title": STR, "done": {"type": "boolean"}}), "minItems": 1, "maxItems": 4}})),
    ("sentiment", "Sentiment of: 'I love this library!'", obj({"label": {"enum": ["positive", "negative", "neutral"]}, "confidence": {"type": "number", "minimum": 0, "maximum": 1}})),
    ("calendar_event", "A meeting on 2026-12-03 at 10:30 with bob@example.com and ann@example.org.", obj({
        "title": STR,
        "date": {"type": "string", "format": "date"},
        "start": {"type": "string", "pattern": "^([01][0-9]|2[0-3]):[0-5][0-9]$"},
        "attendees": {"type": "array", "items": {"type": "string", "format": "email"}, "maxItems": 3},
    })),
    ("code_edit", "Fix the typo on line 12 of main.rs.", obj({"file": STR, "line": {"type": "integer", "minimum": 1}, "replacement": {"type": "string", "maxLength": 80}})),
    ("labels", "Topics of an article about GPUs and compilers.", obj({"labels": {"type": "array", "items": {"enum": ["hardware", "software", "science", "sports", "politics"]}, "minItems": 1, "maxItems": 3}})),
    ("sql_query", "Select names of users older than 30.", obj({"table": STR, "columns": {"type": "array", "items": STR, "minItems": 1, "maxItems": 4}, "limit": {"type": ["integer", "null"]}})),
    ("product", "A product listing for a red bicycle.", obj({"name": STR, "price": {"type": "number", "minimum": 0}, "currency": {"enum": ["USD", "EUR", "GBP"]}, "in_stock": {"type": "boolean"}})),
    ("recipe", "A recipe for pancakes.", obj({
        "name": STR,
        "ingredients": {"type": "array", "items": obj({"item": STR, "quantity": {"type": "number"}, "unit": {"enum": ["g", "ml", "pcs"]}}), "minItems": 1, "maxItems": 4},
        "steps": {"type": "array", "items": {"type": "string", "maxLength": 60}, "minItems": 1, "maxItems": 3},
    })),
    ("route_refs", "A line from point (0,0) to point (3,4).", {
        "$defs": {"point": obj({"x": {"type": "integer"}, "y": {"type": "integer"}})},
        **obj({"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}}),
    }),
    ("any_of", "The answer to 6 times 7.", obj({"result": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 20}]}})),
    ("tool_choice", "Call one tool to learn the time in Tokyo.", {"oneOf": [
        obj({"tool": {"const": "get_time"}, "arguments": obj({"timezone": STR})}),
        obj({"tool": {"const": "get_weather"}, "arguments": obj({"city": STR})}),
    ]}),
    ("formats", "A record with an id and a timestamp.", obj({"id": {"type": "string", "format": "uuid"}, "created": {"type": "string", "format": "date-time"}})),
    ("nullable", "A user with no nickname.", obj({"username": STR, "nickname": {"type": ["string", "null"], "maxLength": 20}})),
    ("matrix", "The 2x2 identity matrix.", obj({"rows": {"type": "array", "items": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2}, "minItems": 2, "maxItems": 2}})),
    ("const_enum", "A config at version 2 with log level 3.", obj({"version": {"const": 2}, "level": {"enum": [1, 2, 3]}, "debug": {"type": "boolean"}})),
    ("optional", "A book title, and its subtitle if it has one.", obj({"title": STR, "subtitle": STR, "year": {"type": "integer"}}, required=["title"])),
    ("top_array", "Three colours.", {"type": "array", "items": {"type": "string", "maxLength": 20}, "minItems": 2, "maxItems": 5}),
    ("codes", "A US state and zip code.", obj({"state": {"type": "string", "pattern": "^[A-Z]{2}$"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}, "country": {"const": "US"}})),
]


def validator(schema):
    cls = jsonschema.Draft202012Validator
    cls.check_schema(schema)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def ask(c, name, instruction, schema, **sampling):
    r = c.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": f"{instruction} Answer in JSON."}],
        max_tokens=300,
        response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}},
        **sampling,
    )
    return r.choices[0]


def test_every_constrained_answer_parses_and_validates(coder):
    assert len(SCHEMAS) >= 20
    c = client(coder)
    jobs = [(s, {"temperature": 0}) for s in SCHEMAS] + [(s, {"temperature": 1.0, "seed": 7 + i}) for i, s in enumerate(SCHEMAS)]
    # Concurrent, as agents send them: constrained rows batch together.
    with ThreadPoolExecutor(max_workers=8) as pool:
        answers = list(pool.map(lambda job: ask(c, *job[0], **job[1]), jobs))
    failures = []
    for ((name, _, schema), sampling), choice in zip(jobs, answers):
        text = choice.message.content
        try:
            validator(schema).validate(json.loads(text))
            assert choice.finish_reason == "stop", choice.finish_reason
        except Exception as e:  # collect every failure, not just the first
            failures.append(f"{name} {sampling}: {type(e).__name__}: {e}\n  {text!r}")
    assert not failures, "\n".join(failures)


class City(pydantic.BaseModel):
    name: str
    country: str
    population_millions: float
    # A bound, as users write them: a 0.5B model may list forever otherwise.
    landmarks: list[str] = pydantic.Field(max_length=3)


def test_parse_helpers_of_the_sdk_get_their_models(coder):
    c = client(coder)
    messages = [{"role": "user", "content": "Describe Paris with two landmarks."}]
    done = c.chat.completions.parse(model=MODEL, messages=messages, max_tokens=200, temperature=0, response_format=City)
    city = done.choices[0].message.parsed
    # Greedy, the model names the city it was asked about (its other facts are a 0.5B model's).
    assert isinstance(city, City) and (city.name, city.country) == ("Paris", "France"), done.choices[0].message.content
    assert done.choices[0].finish_reason == "stop"
    r = c.responses.parse(model=MODEL, input="Describe Rome with two landmarks.", max_output_tokens=200, temperature=0, text_format=City)
    assert isinstance(r.output_parsed, City) and r.output_parsed.name == "Rome", r.output_text
    assert r.status == "completed"
    assert r.text.format.type == "json_schema"


def test_streamed_structured_output_is_the_whole_answers_text(coder):
    c = client(coder)
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "A product listing for a lamp."}], max_tokens=200, temperature=0,
              response_format={"type": "json_schema", "json_schema": {"name": "product", "schema": SCHEMAS[9][2]}})
    whole = c.chat.completions.create(**kw).choices[0].message.content
    streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(stream=True, **kw) if ch.choices)
    assert streamed == whole
    validator(SCHEMAS[9][2]).validate(json.loads(whole))
    name_and_price = [{"role": "user", "content": "The name and price of a lamp, as a JSON object."}]
    any_object = c.chat.completions.create(model=MODEL, messages=name_and_price, max_tokens=200, temperature=0, response_format={"type": "json_object"})
    answer = json.loads(any_object.choices[0].message.content)
    # Any object is allowed; the greedy one holds what was asked for.
    assert isinstance(answer, dict) and {"name", "price"} <= set(answer), answer
    assert any_object.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("fmt, words", [
    ({"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}, "nonsense"),
    ({"type": "json_schema", "json_schema": {"name": "bad", "schema": {"$ref": "#/$defs/nowhere"}}}, "nowhere"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}, "name"),
    ({"type": "xml"}, "xml"),
])
def test_bad_formats_raise_bad_request_errors(coder, fmt, words):
    c = client(coder)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8, response_format=fmt)
    assert words in str(e.value)
    # The server goes on serving: a greedy answer, cut at its two tokens.
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, temperature=0)
    assert r.choices[0].message.content.strip() and r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 2, r
