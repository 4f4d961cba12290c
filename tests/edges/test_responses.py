"""The Responses API: `POST /v1/responses` through the official `openai`
SDK (whole and streamed, `previous_response_id` on the prefix cache), and
its WebSocket mode through `client.responses.connect()`: chained turns
that read only their new tokens, `generate: false` warm-ups, `stream_id`
lanes, cancel, a reconnect that continues where the dropped socket was,
and bad events answered with `error` events on a socket that stays up.
Response objects and events are validated against the OpenResponses
specification's JSON Schemas (openresponses.py).
"""
import json
import os
import socket
import struct
import time
import urllib.request

import openai
import pytest
import websockets
from websockets.sync.client import connect as ws_connect

import openresponses
from conftest import TOKEN, Server

MODEL = "smollm2-135m"
QUESTION = "What is the capital of France? Answer in one sentence."
# The prefix cache keeps whole blocks of this many tokens.
BLOCK = 16


def client(server, api_key="sk-tenant-a"):
    return openai.OpenAI(base_url=server.base_url, api_key=api_key, max_retries=0, timeout=120)


def cached(response):
    return response.usage.input_tokens_details.cached_tokens


def until_done(conn, lane=None):
    """Events of one response from `conn` up to its last; returns (events, final response)."""
    events = []
    for ev in conn:
        if lane is not None and getattr(ev, "stream_id", None) != lane:
            continue
        events.append(ev)
        if ev.type == "error":
            raise AssertionError(f"error event: {ev}")
        if ev.type in ("response.completed", "response.incomplete", "response.failed"):
            return events, ev.response
    raise AssertionError("the socket closed before the response ended")


def test_whole_and_streamed_responses_agree(smollm2):
    c = client(smollm2)
    whole = c.responses.create(model=MODEL, input=QUESTION, max_output_tokens=20, temperature=0)
    assert whole.status in ("completed", "incomplete") and whole.output_text
    assert whole.usage.input_tokens > 0 and whole.usage.output_tokens > 0
    kinds, text = [], ""
    for ev in c.responses.create(model=MODEL, input=QUESTION, max_output_tokens=20, temperature=0, stream=True):
        kinds.append(ev.type)
        if ev.type == "response.output_text.delta":
            text += ev.delta
        if ev.type in ("response.completed", "response.incomplete"):
            final = ev.response
    assert text == whole.output_text == final.output_text
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] == ("response.incomplete" if whole.status == "incomplete" else "response.completed")


def test_previous_response_id_over_http_reuses_the_cache_within_its_tenant(smollm2):
    a = client(smollm2)
    first = a.responses.create(model=MODEL, input=QUESTION, max_output_tokens=8, temperature=0)
    second = a.responses.create(model=MODEL, input="And of Spain?", previous_response_id=first.id, max_output_tokens=8, temperature=0)
    assert second.previous_response_id == first.id
    assert cached(second) >= first.usage.input_tokens // BLOCK * BLOCK > 0
    # The second prompt holds the first turn: more input than the first.
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    with pytest.raises(openai.NotFoundError) as e:
        client(smollm2, api_key="sk-tenant-b").responses.create(model=MODEL, input="hi", previous_response_id=first.id, max_output_tokens=2)
    assert e.value.code == "previous_response_not_found" and e.value.param == "previous_response_id"
    unstored = a.responses.create(model=MODEL, input=QUESTION, max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        a.responses.create(model=MODEL, input="hi", previous_response_id=unstored.id, max_output_tokens=2)


def test_socket_chained_turns_read_only_their_new_tokens(smollm2):
    with client(smollm2).responses.connect() as conn:
        conn.response.create(model=MODEL, input=QUESTION, max_output_tokens=12, temperature=0, store=False)
        _, first = until_done(conn)
        conn.response.create(input="And of Spain?", previous_response_id=first.id, max_output_tokens=12, temperature=0, store=False)
        _, second = until_done(conn)
        conn.response.create(input="And of Italy?", previous_response_id=second.id, max_output_tokens=12, temperature=0, store=False)
        _, third = until_done(conn)
    for earlier, later in ((first, second), (second, third)):
        assert later.previous_response_id == earlier.id
        # Everything before the new turn was cached, up to the last block
        # and the re-encoded end of the answer.
        new_tokens = later.usage.input_tokens - cached(later)
        assert cached(later) >= earlier.usage.input_tokens, (earlier.usage, later.usage)
        assert new_tokens < later.usage.input_tokens - earlier.usage.input_tokens + BLOCK, (earlier.usage, later.usage)


def test_socket_generate_false_warms_the_prefix(smollm2):
    system = "You are a terse geography tutor. " * 12
    with client(smollm2).responses.connect() as conn:
        conn.response.create(model=MODEL, instructions=system, input="Ready?", generate=False)
        events, warm = until_done(conn)
        assert [e.type for e in events] == ["response.created", "response.in_progress", "response.completed"]
        assert warm.output == [] and warm.usage.output_tokens == 0 and warm.usage.input_tokens > 100
        conn.response.create(model=MODEL, instructions=system, input=QUESTION, previous_response_id=warm.id, max_output_tokens=6, temperature=0)
        _, answer = until_done(conn)
    assert answer.output_text
    # All but the warm prompt's last few tokens (its assistant header, which
    # the next turn replaces with the next user message).
    assert cached(answer) >= (warm.usage.input_tokens - 8) // BLOCK * BLOCK


def test_socket_lanes_run_in_order_within_a_lane_and_side_by_side_across(smollm2):
    with client(smollm2).responses.connect() as conn:
        for lane, prompt in (("a", "Name a fruit."), ("b", "Name a color."), ("a", "Name a tree.")):
            conn.response.create(model=MODEL, input=prompt, max_output_tokens=6, temperature=0, stream_id=lane)
        by_lane = {"a": [], "b": []}
        done = 0
        for ev in conn:
            assert ev.type != "error", ev
            by_lane[ev.stream_id].append(ev)
            if ev.type in ("response.completed", "response.incomplete"):
                done += 1
                if done == 3:
                    break
    # Lane a: the first response ends before the second is created.
    a = [(e.type, e.response.id if hasattr(e, "response") else None) for e in by_lane["a"] if e.type.startswith("response.") and hasattr(e, "response")]
    created = [rid for t, rid in a if t == "response.created"]
    ended = [rid for t, rid in a if t in ("response.completed", "response.incomplete")]
    assert len(created) == 2 and ended == created
    first_end = next(i for i, e in enumerate(by_lane["a"]) if e.type in ("response.completed", "response.incomplete"))
    second_start = next(i for i, e in enumerate(by_lane["a"]) if e.type == "response.created" and e.response.id == created[1])
    assert first_end < second_start
    assert [e.sequence_number for e in by_lane["b"]] == list(range(len(by_lane["b"])))


def test_socket_cancel_and_hang_up_free_the_work(smollm2):
    prompt = "Count from 1 to 500, separated by commas."
    with client(smollm2).responses.connect() as conn:
        conn.response.create(model=MODEL, input=prompt, max_output_tokens=2000, temperature=0)
        rid = None
        for ev in conn:
            if ev.type == "response.created":
                rid = ev.response.id
            if ev.type == "response.output_text.delta":
                break
        conn.send({"type": "response.cancel", "response_id": rid})
        for ev in conn:
            assert ev.type != "error", ev
            if ev.type in ("response.completed", "response.incomplete", "response.failed"):
                assert ev.response.status == "cancelled" and ev.response.id == rid
                break
        # Hang up in the middle of the next one.
        conn.response.create(model=MODEL, input=prompt, max_output_tokens=2000, temperature=0)
        for ev in conn:
            if ev.type == "response.output_text.delta":
                break
    deadline = time.time() + 20
    # The engine's numbers are null while a step runs past /healthz's short wait.
    while (h := smollm2.health())["requests_in_flight"] != 0 or (h["engine"] or {"running": 1})["running"] != 0:
        assert time.time() < deadline, h
        time.sleep(0.1)


def test_a_new_socket_continues_a_dropped_sockets_responses(smollm2):
    with client(smollm2).responses.connect() as conn:
        conn.response.create(model=MODEL, input=QUESTION, max_output_tokens=10, temperature=0, store=False)
        _, first = until_done(conn)
    with client(smollm2).responses.connect() as conn:
        conn.response.create(input="And of Spain?", previous_response_id=first.id, max_output_tokens=6, temperature=0, store=False)
        _, second = until_done(conn)
    assert cached(second) >= first.usage.input_tokens // BLOCK * BLOCK > 0
    # Never for another key.
    with client(smollm2, api_key="sk-tenant-b").responses.connect() as conn:
        conn.response.create(input="hi", previous_response_id=first.id, max_output_tokens=2)
        ev = conn.recv()
    assert ev.type == "error" and ev.error.code == "previous_response_not_found" and ev.status == 404


def test_the_socket_wants_the_servers_bearer_token(guarded):
    with pytest.raises(Exception):
        with client(guarded, api_key="sk-wrong").responses.connect() as conn:
            conn.response.create(model=MODEL, input="hi", max_output_tokens=2)
            conn.recv()
    with client(guarded, api_key=TOKEN).responses.connect() as conn:
        conn.response.create(model=MODEL, input="hi", max_output_tokens=2)
        _, r = until_done(conn)
    assert r.usage.output_tokens > 0


OK = {"type": "response.create", "model": MODEL, "input": "hi", "max_output_tokens": 2}

# Bad client events on the socket: (frame, HTTP-like status, error code or None).
BAD_EVENTS = [
    ("{not json", 400, None),
    ("[1, 2]", 400, None),
    ('"response.create"', 400, None),
    ({}, 400, None),
    ({"type": "session.update"}, 400, "unknown_event_type"),
    ({**OK, "surprise": 1}, 400, "unknown_parameter"),
    ({**OK, "background": True}, 400, "unknown_parameter"),
    ({**OK, "stream": False}, 400, None),
    ({**OK, "model": "gpt-nope"}, 404, "model_not_found"),
    ({**OK, "input": 7}, 400, "invalid_value"),
    ({**OK, "input": []}, 400, None),
    ({**OK, "input": [{"role": "wizard", "content": "hi"}]}, 400, None),
    ({**OK, "input": [{"type": "file_search_call", "id": "fs_1"}]}, 400, None),
    ({**OK, "input": [{"type": "function_call_output", "output": "x"}]}, 400, None),
    ({**OK, "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400, None),
    ({**OK, "temperature": 9}, 400, "invalid_parameter"),
    ({**OK, "top_p": 0}, 400, "invalid_parameter"),
    ({**OK, "max_output_tokens": 0}, 400, None),
    ({**OK, "max_output_tokens": -3}, 400, "invalid_value"),
    ({**OK, "max_output_tokens": 100000000}, 400, "invalid_parameter"),
    ({**OK, "tools": [{"type": "web_search"}]}, 400, None),
    ({**OK, "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}}, 400, "invalid_parameter"),
    ({**OK, "reasoning": {"effort": "high"}}, 400, None),
    ({**OK, "text": {"format": {"type": "xml"}}}, 400, None),
    ({**OK, "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}}, 400, "invalid_parameter"),
    ({**OK, "truncation": "auto"}, 400, None),
    ({**OK, "stream_id": ""}, 400, None),
    ({**OK, "metadata": {"k": 1}}, 400, None),
    ({**OK, "previous_response_id": "resp_does_not_exist"}, 404, "previous_response_not_found"),
    ({**OK, "input": "word " * 9000}, 400, "context_length_exceeded"),
    ({"type": "response.cancel"}, 400, None),
    ({"type": "response.cancel", "response_id": "resp_nothing_running"}, 404, "response_not_found"),
    # A binary frame, even one holding a good event: the socket speaks JSON text.
    (json.dumps(OK).encode(), 400, None),
]


def test_bad_events_get_error_events_and_the_socket_stays_up(smollm2):
    url = smollm2.base_url.replace("http://", "ws://") + "/responses"
    with ws_connect(url, additional_headers={"Authorization": "Bearer sk-tenant-a"}) as ws:
        for frame, status, code in BAD_EVENTS:
            ws.send(frame if isinstance(frame, (str, bytes)) else json.dumps(frame))
            got = json.loads(ws.recv(timeout=60))
            assert got["type"] == "error" and got["status"] == status, (frame, got)
            assert set(got["error"]) == {"message", "type", "param", "code"} and got["error"]["message"], got
            openresponses.check("WebSocketErrorEvent", got)
            if code is not None:
                assert got["error"]["code"] == code, (frame, got)
        ws.send(json.dumps({**OK, "stream_id": "after"}))
        while (got := json.loads(ws.recv(timeout=60)))["type"] not in ("response.completed", "response.incomplete"):
            assert got["type"] != "error", got
        assert got["stream_id"] == "after"


def test_an_event_over_the_frame_limit_ends_the_socket(smollm2):
    """As on protocol v1: an event over --max-frame-bytes (1 MiB) gets its
    error and the socket closes; a new socket serves."""
    url = smollm2.base_url.replace("http://", "ws://") + "/responses"
    with ws_connect(url, additional_headers={"Authorization": "Bearer sk-tenant-a"}, max_size=None) as ws:
        ws.send(json.dumps({**OK, "input": "x" * (1 << 20)}))
        got = json.loads(ws.recv(timeout=60))
        assert got["type"] == "error" and got["status"] == 413 and got["error"]["code"] == "request_too_large", got
        openresponses.check("WebSocketErrorEvent", got)
        with pytest.raises(websockets.exceptions.ConnectionClosed):
            ws.recv(timeout=30)
    # Far over (2 MiB, past what the WebSocket layer reads: refused from
    # its header, its bytes unread), and a binary frame over the limit: the
    # same error, and it still arrives before the close.
    for frame in ("y" * (2 << 20), b"z" * ((1 << 20) + 1)):
        with ws_connect(url, additional_headers={"Authorization": "Bearer sk-tenant-a"}, max_size=None) as ws:
            ws.send(frame)
            got = json.loads(ws.recv(timeout=60))
            assert got["type"] == "error" and got["status"] == 413 and got["error"]["code"] == "request_too_large", got
            with pytest.raises(websockets.exceptions.ConnectionClosed):
                ws.recv(timeout=30)
    with ws_connect(url, additional_headers={"Authorization": "Bearer sk-tenant-a"}) as ws:
        ws.send(json.dumps(OK))
        while (got := json.loads(ws.recv(timeout=60)))["type"] not in ("response.completed", "response.incomplete"):
            assert got["type"] != "error", got


# Bad bodies for POST /v1/responses: (body, status, error code or None).
BAD_BODIES = [
    (b"{not json", 400, None),
    (b"[]", 400, None),
    ({"model": MODEL}, 400, None),
    ({"model": MODEL, "input": None}, 400, None),
    ({"model": MODEL, "input": ""}, 400, None),
    ({"model": MODEL, "input": {"role": "user"}}, 400, "invalid_value"),
    ({"model": MODEL, "input": [{"role": "user"}]}, 400, None),
    ({"model": MODEL, "input": [{"role": "user", "content": "hi", "extra": 1}]}, 400, None),
    ({"model": MODEL, "input": [{"type": "item_reference", "id": "msg_1"}]}, 400, None),
    ({"model": "gpt-nope", "input": "hi"}, 404, "model_not_found"),
    ({"model": MODEL, "input": "hi", "generate": False}, 400, "unknown_parameter"),
    ({"model": MODEL, "input": "hi", "stream_id": "a"}, 400, "unknown_parameter"),
    ({"model": MODEL, "input": "hi", "background": True}, 400, None),
    ({"model": MODEL, "input": "hi", "stream_options": {}}, 400, None),
    ({"model": MODEL, "input": "hi", "temperature": "warm"}, 400, "invalid_value"),
    ({"model": MODEL, "input": "hi", "temperature": 3}, 400, "invalid_parameter"),
    ({"model": MODEL, "input": "hi", "top_p": 1.5}, 400, "invalid_parameter"),
    ({"model": MODEL, "input": "hi", "max_output_tokens": 0}, 400, None),
    ({"model": MODEL, "input": "hi", "include": ["reasoning.encrypted_content"]}, 400, None),
    ({"model": MODEL, "input": "hi", "top_logprobs": 21}, 400, None),
    ({"model": MODEL, "input": "hi", "top_logprobs": -1}, 400, "invalid_value"),
    ({"model": MODEL, "input": "hi", "include": ["message.output_text.logprobs", "file_search_call.results"]}, 400, None),
    ({"model": MODEL, "input": "hi", "presence_penalty": 0.5}, 400, None),
    ({"model": MODEL, "input": "hi", "frequency_penalty": -1}, 400, None),
    ({"model": MODEL, "input": "hi", "max_tool_calls": 0}, 400, None),
    ({"model": MODEL, "input": "hi", "service_tier": "turbo"}, 400, None),
    ({"model": MODEL, "input": "hi", "reasoning": {"summary": "auto"}}, 400, None),
    ({"model": MODEL, "input": [{"role": "assistant", "content": "hi", "phase": "thinking"}]}, 400, None),
    ({"model": MODEL, "input": "hi", "tools": [{"type": "function", "name": "f", "strict": "yes"}]}, 400, None),
    ({"model": MODEL, "input": "hi", "tool_choice": "required"}, 400, None),
    ({"model": MODEL, "input": "hi", "metadata": {str(i): "v" for i in range(17)}}, 400, None),
    ({"model": MODEL, "input": "hi", "prompt_cache_key": "k" * 300}, 400, None),
    ({"model": MODEL, "input": "hi", "previous_response_id": "resp_unknown"}, 404, "previous_response_not_found"),
    ({"model": MODEL, "input": "word " * 9000, "max_output_tokens": 4}, 400, "context_length_exceeded"),
]


@pytest.mark.parametrize("body,status,code", BAD_BODIES)
def test_bad_responses_bodies_get_typed_errors(smollm2, body, status, code):
    got_status, got = smollm2.post("/v1/responses", body)
    assert got_status == status, got
    assert set(got) == {"error"} and set(got["error"]) == {"message", "type", "param", "code"}, got
    if code is not None:
        assert got["error"]["code"] == code, got


def test_a_flood_of_requests_gets_429_and_other_keys_are_unharmed(throttled):
    statuses = [throttled.post("/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 1}, {"Authorization": "Bearer sk-flood"})[0] for _ in range(4)]
    assert statuses == [200, 429, 429, 429], statuses
    status, got = throttled.post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}, {"Authorization": "Bearer sk-flood"})
    assert status == 429 and got["error"]["type"] == "rate_limit_error" and got["error"]["code"] == "rate_limit_exceeded"
    with pytest.raises(openai.RateLimitError):
        client(throttled, api_key="sk-flood").responses.create(model=MODEL, input="hi", max_output_tokens=1)
    r = client(throttled, api_key="sk-calm").responses.create(model=MODEL, input="hi", max_output_tokens=1)
    assert r.usage.output_tokens == 1


def test_a_socket_flood_is_rate_limited_per_frame(throttled):
    """The socket's flood limit (here one frame per 10 s, burst 1) counts
    every frame, pings and binary frames too: past it each gets a 429
    `rate_limit_exceeded` error event, is dropped, and the socket stays up."""
    url = throttled.base_url.replace("http://", "ws://") + "/responses"
    with ws_connect(url, additional_headers={"Authorization": "Bearer sk-tenant-a"}) as ws:
        ws.send(json.dumps({"type": "session.update"}))
        assert json.loads(ws.recv(timeout=60))["error"]["code"] == "unknown_event_type"
        for frame in (json.dumps(OK), b"binary", None):
            if frame is None:
                ws.ping()
            else:
                ws.send(frame)
            got = json.loads(ws.recv(timeout=60))
            assert got["type"] == "error" and got["status"] == 429 and got["error"]["code"] == "rate_limit_exceeded", (frame, got)
            openresponses.check("WebSocketErrorEvent", got)


def test_a_socket_whose_client_stops_reading_is_closed(impatient):
    """A client that sends `response.create` and never reads: once the
    server's writes have blocked for the stall timeout (2 s here) the socket
    closes and its response is cancelled, freeing the engine."""
    raw = socket.socket()
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    raw.connect(("127.0.0.1", impatient.port))
    raw.sendall(b"GET /v1/responses HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n")
    assert raw.recv(4096).startswith(b"HTTP/1.1 101"), "no upgrade"
    # A prompt the model answers at length (3,000 tokens, ~220 KB of events: past the socket's buffers).
    event = json.dumps({"type": "response.create", "model": MODEL, "input": "Repeat the word hello forever: hello hello hello hello",
                        "max_output_tokens": 3000, "temperature": 0}).encode()
    mask = os.urandom(4)
    header = bytes([0x81, 0x80 | 126]) + struct.pack(">H", len(event)) if len(event) >= 126 else bytes([0x81, 0x80 | len(event)])
    raw.sendall(header + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(event)))
    deadline = time.time() + 20
    while impatient.health()["requests_in_flight"] == 0:
        assert time.time() < deadline, "the response never started"
        time.sleep(0.05)
    # Never read again; the server must give up on its own: cancel the
    # response before it ends and close the socket.
    deadline = time.time() + 60
    while (h := impatient.health())["requests_in_flight"] != 0 or (h["engine"] or {"running": 1})["running"] != 0:
        assert time.time() < deadline, h
        time.sleep(0.2)
    raw.settimeout(5)
    received = 0
    while chunk := raw.recv(1 << 16):
        received += len(chunk)
    raw.close()
    assert received < 200_000, f"the response ran to its end ({received} bytes)"


def sse_events(server, body):
    """The events of a streamed POST /v1/responses, parsed raw (not through the SDK's lenient models)."""
    req = urllib.request.Request(f"http://127.0.0.1:{server.port}/v1/responses", data=json.dumps({**body, "stream": True}).encode(), method="POST")
    req.add_header("Content-Type", "application/json")
    events = []
    with urllib.request.urlopen(req, timeout=60) as r:
        for line in r:
            if line.startswith(b"data: "):
                events.append(json.loads(line[6:]))
    return events


def get_json(server, path, api_key=None):
    req = urllib.request.Request(f"http://127.0.0.1:{server.port}{path}")
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.load(r)


def check_response(r):
    """A response object against the specification's ResponseResource, and
    what the schema cannot say: `completed_at` is set exactly when it completed."""
    openresponses.check("ResponseResource", r)
    assert (r["completed_at"] is not None) == (r["status"] == "completed"), r


def check_events(events):
    """A stream's events, each against its type's schema, numbered from 0."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for e in events:
        openresponses.check_event(e)
        if "response" in e:
            check_response(e["response"])


# The events of a streamed text answer, in the order they first come.
TEXT_EVENTS = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
               "response.output_text.delta", "response.output_text.done", "response.content_part.done", "response.output_item.done"]


def test_responses_and_their_events_follow_the_openresponses_schemas(smollm2, coder):
    body = {"model": MODEL, "input": QUESTION, "max_output_tokens": 6, "temperature": 0, "user": "u-1", "safety_identifier": "s-1",
            "top_logprobs": 2, "presence_penalty": 0, "max_tool_calls": 3, "reasoning": {"effort": None}}
    status, whole = smollm2.post("/v1/responses", body)
    assert status == 200, whole
    check_response(whole)
    assert (whole["user"], whole["safety_identifier"], whole["top_logprobs"], whole["max_tool_calls"]) == ("u-1", "s-1", 2, 3)
    assert whole["reasoning"] == {"effort": None, "summary": None} and whole["service_tier"] == "default"
    # Read back, it is the same object, and as valid.
    stored = get_json(smollm2, f"/v1/responses/{whole['id']}")
    check_response(stored)
    assert stored == whole

    events = sse_events(smollm2, body)
    check_events(events)
    kinds = list(dict.fromkeys(e["type"] for e in events))
    assert kinds == TEXT_EVENTS + [events[-1]["type"]] and events[-1]["type"] in ("response.completed", "response.incomplete"), kinds
    check_response(get_json(smollm2, f"/v1/responses/{events[-1]['response']['id']}"))
    # The WebSocket mode sends the same events (each with its lane's `stream_id` beside).
    with raw_socket(smollm2) as ws:
        ws.send(json.dumps({"type": "response.create", **body}))
        socket_events = [json.loads(ws.recv(timeout=60))]
        while socket_events[-1]["type"] not in ("response.completed", "response.incomplete", "response.failed", "error"):
            socket_events.append(json.loads(ws.recv(timeout=60)))
    check_events(socket_events)
    assert [e["type"] for e in socket_events] == [e["type"] for e in events]

    # A schema format is shown whole (description and strict filled in).
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    status, shaped = smollm2.post("/v1/responses", {**body, "text": {"format": {"type": "json_schema", "name": "place", "schema": schema}}})
    assert status == 200, shaped
    check_response(shaped)
    assert shaped["text"]["format"] == {"type": "json_schema", "name": "place", "schema": schema, "description": None, "strict": False}

    # A function call's events and item, on a model that calls tools.
    tool = {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}
    events = sse_events(coder, {"model": "qwen2.5-coder-0.5b", "input": "What time is it in Tokyo?", "tools": [tool, {**tool, "name": "other", "strict": False}],
                                "tool_choice": {"type": "function", "name": "get_time"}, "temperature": 0, "max_output_tokens": 60})
    check_events(events)
    assert {"response.function_call_arguments.delta", "response.function_call_arguments.done"} <= {e["type"] for e in events}
    final = events[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["function_call"], final["output"]
    assert [t["strict"] for t in final["tools"]] == [True, False]
    assert final["completed_at"] >= final["created_at"]


def test_compact_answers_follow_the_openresponses_schemas(smollm2):
    status, first = smollm2.post("/v1/responses", {"model": MODEL, "input": "My name is Ada.", "max_output_tokens": 4, "temperature": 0})
    assert status == 200, first
    status, compacted = smollm2.post("/v1/responses/compact", {"model": MODEL, "previous_response_id": first["id"], "input": "I like trains."})
    assert status == 200, compacted
    openresponses.check("CompactResource", compacted)
    assert [item["type"] for item in compacted["output"]] == ["message", "message", "compaction"]


def test_logprobs_on_output_text_and_its_deltas(smollm2):
    c = client(smollm2)
    r = c.responses.create(model=MODEL, input=QUESTION, max_output_tokens=6, temperature=0, top_logprobs=3)
    lps = r.output[0].content[0].logprobs
    assert len(lps) == r.usage.output_tokens and all(len(l.top_logprobs) == 3 and l.logprob <= 0 for l in lps)
    assert "".join(l.token for l in lps) == r.output_text
    # The greedy token is the most likely one.
    assert all(l.logprob == pytest.approx(max(t.logprob for t in l.top_logprobs), abs=1e-4) for l in lps)
    deltas = []
    for ev in c.responses.create(model=MODEL, input=QUESTION, max_output_tokens=6, temperature=0, include=["message.output_text.logprobs"], stream=True):
        if ev.type == "response.output_text.delta":
            deltas.extend(ev.logprobs)
        if ev.type == "response.output_text.done":
            done = ev.logprobs
    assert [(l.token, l.top_logprobs) for l in deltas] == [(l.token, []) for l in lps] and len(done) == len(deltas)
    for plain in (c.responses.create(model=MODEL, input=QUESTION, max_output_tokens=2, temperature=0),
                  c.responses.create(model=MODEL, input=QUESTION, max_output_tokens=2, temperature=0, top_logprobs=0)):
        assert plain.output[0].content[0].logprobs == [] and plain.top_logprobs == 0


def test_phase_on_input_items_is_taken(smollm2):
    c = client(smollm2)
    r = c.responses.create(model=MODEL, max_output_tokens=2, input=[
        {"role": "user", "content": QUESTION},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me think."}], "phase": "commentary"},
        {"type": "message", "role": "assistant", "content": "Paris.", "phase": "final_answer"},
        {"role": "user", "content": "And of Spain?"},
    ])
    assert r.status in ("completed", "incomplete")
    items = c.responses.input_items.list(r.id, order="asc").data
    assert [getattr(i, "phase", None) for i in items] == [None, "commentary", "final_answer", None]
    # Read back raw, each is an item of the specification's (where `phase` is defined).
    for item in get_json(smollm2, f"/v1/responses/{r.id}/input_items?order=asc", "sk-tenant-a")["data"]:
        openresponses.check("ItemField", item)


def test_a_function_call_output_for_no_call_is_refused(smollm2):
    c = client(smollm2)
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model=MODEL, max_output_tokens=2, input=[
            {"role": "user", "content": "hi"},
            {"type": "function_call", "call_id": "call_made", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_made", "output": "ok"},
            {"type": "function_call_output", "call_id": "call_never", "output": "x"},
        ])
    assert e.value.param == "input" and "No tool call found for function call output with call_id call_never" in e.value.message
    first = c.responses.create(model=MODEL, input="hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError):
        c.responses.create(model=MODEL, previous_response_id=first.id, max_output_tokens=2,
                           input=[{"type": "function_call_output", "call_id": "call_x", "output": "x"}])


def test_stored_responses_are_read_back_listed_and_deleted(smollm2):
    c = client(smollm2)
    r = c.responses.create(model=MODEL, input=[{"role": "user", "content": f"Say {i}."} for i in range(5)], max_output_tokens=3, temperature=0)
    got = c.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()
    with pytest.raises(openai.BadRequestError):
        c.responses.retrieve(r.id, stream=True)
    # Input items: newest first by default, in pages the SDK walks.
    items = list(c.responses.input_items.list(r.id, limit=2))
    assert [i.content[0].text for i in items] == [f"Say {i}." for i in reversed(range(5))]
    page = c.responses.input_items.list(r.id, order="asc", limit=2)
    assert [i.content[0].text for i in page.data] == ["Say 0.", "Say 1."] and page.has_more and page.first_id == page.data[0].id
    # Another key sees none of it.
    other = client(smollm2, api_key="sk-tenant-b")
    for call in (lambda: other.responses.retrieve(r.id), lambda: other.responses.delete(r.id), lambda: other.responses.input_items.list(r.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    # Nothing runs in the background here: cancel is refused by name.
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.cancel(r.id)
    assert "background" in e.value.message
    status, body = smollm2.post(f"/v1/responses/{r.id}/cancel", b"", {"Authorization": "Bearer sk-tenant-a"})
    assert status == 400 and set(body["error"]) == {"message", "type", "param", "code"}
    unstored = c.responses.create(model=MODEL, input="hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError) as e:
        c.responses.retrieve(unstored.id)
    assert e.value.body["type"] == "invalid_request_error"
    assert c.responses.delete(r.id) is None
    status, body = smollm2.post(f"/v1/responses/{r.id}", b"{}", {"Authorization": "Bearer sk-tenant-a"})
    assert status == 405
    for call in (lambda: c.responses.retrieve(r.id), lambda: c.responses.delete(r.id), lambda: c.responses.cancel(r.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    with pytest.raises(openai.NotFoundError):
        c.responses.create(model=MODEL, input="hi", previous_response_id=r.id, max_output_tokens=2)


def raw_socket(server):
    url = server.base_url.replace("http://", "ws://") + "/responses"
    return ws_connect(url, additional_headers={"Authorization": "Bearer sk-tenant-a"})


def next_event(ws, kinds):
    while (ev := json.loads(ws.recv(timeout=60)))["type"] not in kinds:
        assert ev["type"] != "error", ev
    return ev


def test_socket_steer_ends_the_running_response_and_its_successor_continues_it(smollm2):
    with raw_socket(smollm2) as ws:
        ws.send(json.dumps({"type": "response.create", "model": MODEL, "input": "Count from 1 to 500, separated by commas.",
                            "max_output_tokens": 300, "temperature": 0, "store": False, "stream_id": "main"}))
        rid = next_event(ws, ["response.created"])["response"]["id"]
        next_event(ws, ["response.output_text.delta"])
        ws.send(json.dumps({"type": "response.steer", "previous_response_id": rid, "input": "Stop. Say hi instead."}))
        events = []
        while (ev := json.loads(ws.recv(timeout=60)))["type"] != "response.created":
            assert ev["type"] not in ("error", "response.steer.failed"), ev
            events.append(ev)
        successor = ev["response"]
        kinds = [e["type"] for e in events]
        accepted = events[kinds.index("response.steer.accepted")]
        assert accepted["steer"]["previous_response_id"] == rid and accepted["steer"]["id"].startswith("steer_") and accepted["stream_id"] == "main"
        steered = events[-1]["response"]
        assert events[-1]["type"] == "response.incomplete" and steered["incomplete_details"] == {"reason": "steered"}, steered
        own = [k for k in kinds if not k.startswith("response.steer.")]
        assert own[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
        assert steered["output"][0]["content"][0]["text"]
        # The successor: same settings and lane, continuing the steered one from the cache.
        assert successor["previous_response_id"] == rid and successor["max_output_tokens"] == 300 and ev["stream_id"] == "main"
        done = next_event(ws, ["response.incomplete", "response.completed"])["response"]
        # Everything before the steer was cached, up to the last block.
        assert done["usage"]["input_tokens_details"]["cached_tokens"] >= steered["usage"]["input_tokens"] // BLOCK * BLOCK > 0, (steered["usage"], done["usage"])
        # What cannot be steered comes back in response.steer.failed, the input with it.
        for steer, code in (
            ({"previous_response_id": rid, "input": "x"}, "response_already_completed"),
            ({"previous_response_id": "resp_nope", "input": "x"}, "response_not_found"),
            ({"previous_response_id": rid, "input": [{"role": "assistant", "content": "x"}]}, "invalid_input"),
            ({"previous_response_id": rid, "input": ""}, "invalid_input"),
            ({"previous_response_id": rid, "input": "x", "stream_id": "main"}, "invalid_input"),
        ):
            ws.send(json.dumps({"type": "response.steer", **steer}))
            failed = next_event(ws, ["response.steer.failed"])
            assert failed["error"]["code"] == code and failed["error"]["type"] == "invalid_request_error", failed
            assert failed["steer"] == {"previous_response_id": steer["previous_response_id"], "input": steer["input"]}


@pytest.fixture(scope="module")
def brief():
    """A server whose Responses sockets live 1 s (OpenAI's live 60 minutes)."""
    s = Server(MODEL, "--responses-socket-secs", "1")
    yield s
    s.stop()


def test_a_socket_past_its_lifetime_is_closed_with_a_typed_error(brief):
    with raw_socket(brief) as ws:
        ws.send(json.dumps({**OK, "store": False}))
        first = next_event(ws, ["response.completed", "response.incomplete"])["response"]
        got = json.loads(ws.recv(timeout=10))
        assert got["type"] == "error" and got["error"]["code"] == "websocket_connection_limit_reached", got
        openresponses.check("WebSocketErrorEvent", got)
        with pytest.raises(Exception):
            ws.recv(timeout=10)
    # A new socket continues where the closed one was.
    with raw_socket(brief) as ws:
        ws.send(json.dumps({**OK, "input": "more", "previous_response_id": first["id"], "store": False}))
        assert next_event(ws, ["response.completed", "response.incomplete"])["response"]["previous_response_id"] == first["id"]


def test_compact_summarizes_a_conversation_that_the_next_turn_continues_from(smollm2):
    c = client(smollm2)
    first = c.responses.create(model=MODEL, input="My name is Ada and I live in Lisbon.", max_output_tokens=8, temperature=0)
    compacted = c.responses.compact(model=MODEL, previous_response_id=first.id, input="I like trains.")
    assert compacted.object == "response.compaction" and compacted.usage.output_tokens > 0
    assert [o.type for o in compacted.output] == ["message", "message", "compaction"]
    assert [o.content[0].text for o in compacted.output[:2]] == ["My name is Ada and I live in Lisbon.", "I like trains."]
    # The summary was read from the cache: the conversation was its prompt.
    assert compacted.usage.input_tokens_details.cached_tokens > 0
    items = [o.model_dump(exclude_none=True, warnings=False) for o in compacted.output]
    later = c.responses.create(model=MODEL, input=[*items, {"role": "user", "content": "Where do I live?"}], max_output_tokens=4, temperature=0)
    assert later.status in ("completed", "incomplete")
    # A compaction this server did not make is refused by name.
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model=MODEL, input=[{"type": "compaction", "encrypted_content": "gAAAAABpM0Yj-opaque"}, {"role": "user", "content": "hi"}], max_output_tokens=2)
    assert e.value.param == "input" and "compaction" in e.value.message
    for body, status in (({"model": MODEL}, 400), ({"model": MODEL, "input": "hi", "tools": []}, 400), ({"input": "hi"}, 400),
                         ({"model": MODEL, "previous_response_id": "resp_nope"}, 404)):
        got_status, got = smollm2.post("/v1/responses/compact", body)
        assert got_status == status and set(got["error"]) == {"message", "type", "param", "code"}, (body, got)
