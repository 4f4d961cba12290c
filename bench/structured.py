#!/usr/bin/env python3
"""Structured-output benchmark: what a JSON-Schema constraint costs, and what
grammar-forced drafts buy, on Tether and on llama.cpp's server, same GGUF.

Every request is one agent tool call: a raw ChatML chat prompt (the same
text on both servers; each asks for a different city, so no prompt cache
serves another) answered greedily under SCHEMA, a tool-call record with
long fixed keys and enums, the kind of output where most tokens are forced.

Settings (each at every --streams count, requests started together):
  plain        no constraint (the same prompts: the model writes free text
               until its end token or --max-tokens)
  schema       constrained, no drafts (Tether: speculation off)
  schema+ff    constrained, the grammar's forced tokens verified as drafts
               (Tether only: its server runs with --speculation off, so the
               forced tokens are the only drafts)
llama.cpp: its /completion with `json_schema` (turned into a GBNF grammar
by the server) against the same without; `plain` and `schema` only.

With --rounds N each setting runs N times on new prompts (a row each);
with --interleave the rounds go outermost (plain, schema, plain, schema...),
so one server's settings meet the same machine state;
the report prints medians over rows. Printed per (engine, setting, streams): decode tok/s per stream (median of
(tokens - 1) / (last token - first token)), aggregate tok/s (all tokens /
wall time of the run, so prompt reading counts), all-decoding tok/s (tokens
that arrived while every request was decoding / that window), share of valid outputs (json.loads + required keys),
median time to first token, and, for Tether, whether `schema` and `schema+ff`
produced identical text.

usage (the peer venv's python: aiohttp):
  structured.py --engine tether --url http://127.0.0.1:PORT --settings plain,schema,schema+ff --out R.jsonl
  structured.py --engine llama.cpp --url http://127.0.0.1:PORT --settings plain,schema --out R.jsonl
  structured.py --report R.jsonl
"""
import argparse
import asyncio
import json
import statistics
import sys
import time

import aiohttp

SCHEMA = {
    "type": "object",
    "properties": {
        "function_name": {"enum": ["get_current_weather_conditions", "search_travel_documentation"]},
        "arguments": {
            "type": "object",
            "properties": {
                "destination_city_name": {"type": "string", "maxLength": 24},
                "preferred_temperature_unit": {"enum": ["celsius", "fahrenheit"]},
                "include_extended_forecast": {"type": "boolean"},
                "number_of_forecast_days": {"type": "integer", "minimum": 1, "maximum": 14},
                "requested_information_categories": {
                    "type": "array",
                    "items": {"enum": ["temperature", "precipitation", "wind_speed", "air_quality"]},
                    "minItems": 1,
                    "maxItems": 3,
                },
            },
            "required": [
                "destination_city_name",
                "preferred_temperature_unit",
                "include_extended_forecast",
                "number_of_forecast_days",
                "requested_information_categories",
            ],
            "additionalProperties": False,
        },
        "user_facing_explanation": {"type": "string", "maxLength": 80},
    },
    "required": ["function_name", "arguments", "user_facing_explanation"],
    "additionalProperties": False,
}

CITIES = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Perth", "Quito", "Seoul", "Dakar", "Hanoi", "Porto", "Austin", "Nairobi", "Lisbon", "Denver", "Kyoto",
          "Dublin", "Havana", "Zagreb", "Manila", "Bogota", "Tunis", "Riga", "Accra", "Dhaka", "Minsk", "Sofia", "Doha", "Bern", "Vienna", "Cusco", "Split"]


def prompt(i):
    city = CITIES[i % len(CITIES)]
    ask = (f"Call a tool for this request, as JSON with function_name, arguments and user_facing_explanation. "
           f"Request #{i}: what will the weather be like in {city} over the next few days? I prefer celsius.")
    return ("<|im_start|>system\nYou are a helpful assistant that calls tools.<|im_end|>\n"
            f"<|im_start|>user\n{ask}<|im_end|>\n<|im_start|>assistant\n")


class Run:
    def __init__(self):
        self.t_submit = self.t_first = self.t_end = None
        self.tokens = 0
        self.text = []
        self.arrivals = []  # (time, tokens) per streamed piece
        self.error = None


async def tether(http, url, text, setting, max_tokens, run, rid):
    ws = await http.ws_connect(url.replace("http://", "ws://").rstrip("/") + "/v1/ws", max_msg_size=0)
    try:
        await ws.send_json({"type": "session.open"})
        await ws.receive_json(timeout=60)
        req = {"type": "generate", "request_id": rid, "prompt": text, "max_tokens": max_tokens, "temperature": 0, "cache": "session"}
        if setting != "plain":
            req["response_format"] = {"type": "json_schema", "schema": SCHEMA}
        if setting in ("plain", "schema"):
            req["speculation"] = {"source": "off"}
        run.t_submit = time.perf_counter()
        await ws.send_json(req)
        while True:
            msg = await ws.receive_json(timeout=600)
            now = time.perf_counter()
            if msg["type"] == "delta":
                run.t_first = run.t_first or now
                run.text.append(msg["text"])
                run.arrivals.append((now, len(msg["token_ids"])))
            elif msg["type"] == "done":
                run.t_end, run.tokens = now, msg["usage"]["completion_tokens"]
                return
            elif msg["type"] == "error":
                run.error = msg["message"]
                return
    finally:
        await ws.close()


async def llamacpp(http, url, text, setting, max_tokens, run, rid):
    body = {"prompt": text, "n_predict": max_tokens, "temperature": 0, "stream": True, "cache_prompt": False}
    if setting == "schema":
        body["json_schema"] = SCHEMA
    run.t_submit = time.perf_counter()
    async with http.post(url.rstrip("/") + "/completion", json=body) as r:
        async for line in r.content:
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            msg = json.loads(line[6:])
            now = time.perf_counter()
            if msg.get("content"):
                run.t_first = run.t_first or now
                run.text.append(msg["content"])
                run.arrivals.append((now, len(msg.get("tokens") or [0])))
            if msg.get("stop"):
                run.t_end = now
                run.tokens = msg.get("timings", {}).get("predicted_n") or msg.get("tokens_predicted", 0)
                return


def valid(text):
    try:
        v = json.loads(text)
    except ValueError:
        return False
    return isinstance(v, dict) and set(v) == set(SCHEMA["required"]) and set(v["arguments"]) == set(SCHEMA["properties"]["arguments"]["required"])


async def measure(args, setting, streams, offset):
    client = tether if args.engine == "tether" else llamacpp
    runs = [Run() for _ in range(streams)]
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        start = time.perf_counter()
        await asyncio.gather(*(client(http, args.url, prompt(offset + i), setting, args.max_tokens, r, f"r{i}") for i, r in enumerate(runs)))
        wall = time.perf_counter() - start
    errors = [r.error for r in runs if r.error]
    if errors:
        sys.exit(f"{args.engine} {setting}: {errors[0]}")
    per_stream = [(r.tokens - 1) / (r.t_end - r.t_first) for r in runs if r.tokens > 1 and r.t_end > r.t_first]
    texts = ["".join(r.text) for r in runs]
    # While every request decodes: after the last first token, before the first last token.
    lo, hi = max(r.t_first for r in runs), min(r.t_end for r in runs)
    in_window = sum(n for r in runs for t, n in r.arrivals if lo < t <= hi)
    return {
        "engine": args.engine, "label": args.label, "setting": setting, "streams": streams,
        "decode_tok_s": statistics.median(per_stream) if per_stream else 0.0,
        "aggregate_tok_s": sum(r.tokens for r in runs) / wall,
        "all_decoding_tok_s": in_window / (hi - lo) if hi > lo else None,
        "tokens": sum(r.tokens for r in runs),
        "valid": sum(valid(t) for t in texts) / len(texts),
        "ttft_p50_s": statistics.median(r.t_first - r.t_submit for r in runs if r.t_first),
        "texts": texts,
    }


async def main_async(args):
    rows = []
    for streams in args.streams:
        if args.interleave:
            # Round by round, every setting once, each on prompts of its own
            # (so no setting's prompts are cached by another's).
            order = [(rnd, setting, (rnd * len(args.settings) + k) * streams) for rnd in range(args.rounds) for k, setting in enumerate(args.settings)]
        else:
            # The same prompts for every setting of one stream count; new ones each round.
            order = [(rnd, setting, rnd * streams) for setting in args.settings for rnd in range(args.rounds)]
        for rnd, setting, at in order:
            row = await measure(args, setting, streams, offset=streams * 100 + at)
            row["round"] = rnd
            print(f"[structured] {args.engine} {setting} x{streams} round {rnd + 1}: {row['decode_tok_s']:.1f} tok/s per stream, "
                  f"{row['aggregate_tok_s']:.1f} aggregate, valid {row['valid']:.0%}", file=sys.stderr)
            rows.append(row)
    with open(args.out, "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def report(path):
    # (Step-trace rows kept beside the requests have no engine.)
    rows = [r for r in map(json.loads, open(path)) if "engine" in r]
    key = {}
    for r in rows:
        key.setdefault((r["label"], r["engine"], r["streams"], r["setting"]), []).append(r)
    med = lambda rs, k: statistics.median(r[k] for r in rs)
    print(f"{'model':<22}{'engine':<11}{'streams':>8}{'setting':>11}{'tok/s/stream':>14}{'aggregate':>11}{'all-dec':>9}{'ttft':>7}{'valid':>7}{'vs plain':>10}{'vs schema':>11}")
    for (label, engine, streams, setting), rs in sorted(key.items()):
        plain = key.get((label, engine, streams, "plain"))
        schema = key.get((label, engine, streams, "schema"))
        d = med(rs, "decode_tok_s")
        vs_plain = f"{d / med(plain, 'decode_tok_s'):.2f}x" if plain else ""
        vs_schema = f"{d / med(schema, 'decode_tok_s'):.2f}x" if schema and setting != "schema" and setting != "plain" else ""
        window = [r["all_decoding_tok_s"] for r in rs if r.get("all_decoding_tok_s")]
        window = f"{statistics.median(window):.1f}" if window else "-"
        print(f"{label:<22}{engine:<11}{streams:>8}{setting:>11}{d:>14.1f}{med(rs, 'aggregate_tok_s'):>11.1f}{window:>9}{med(rs, 'ttft_p50_s'):>7.1f}"
              f"{med(rs, 'valid'):>7.0%}{vs_plain:>10}{vs_schema:>11}")
    for (label, engine, streams, setting), rs in sorted(key.items()):
        other = key.get((label, engine, streams, "schema"))
        if setting == "schema+ff" and other:
            same = all(a["texts"] == b["texts"] for a, b in zip(rs, other))
            print(f"{label} {engine} x{streams}: schema+ff text {'identical to' if same else 'DIFFERS from'} schema")
    tether_schema = {(r[0], r[2]): v for r, v in key.items() if r[1] == "tether" and r[3] == "schema+ff"}
    for (label, engine, streams, setting), rs in sorted(key.items()):
        mine = tether_schema.get((label, streams))
        if engine == "llama.cpp" and setting == "schema" and mine:
            print(f"{label} x{streams}: tether schema+ff / llama.cpp schema = {med(mine, 'decode_tok_s') / med(rs, 'decode_tok_s'):.2f}x per stream, "
                  f"{med(mine, 'aggregate_tok_s') / med(rs, 'aggregate_tok_s'):.2f}x aggregate")


def steps(path):
    """Median step time of pure decode steps (no drafts, no prompt tokens)
    by row count, constrained against plain, from a TETHER_TRACE_STEPS log."""
    by = {}
    for line in open(path):
        if not line.startswith("[step] "):
            continue
        f = dict(kv.split("=", 1) for kv in line.split()[1:])
        if "constrained_rows" not in f or f["draft_tokens"] != "0" or f["prefill_tokens"] != "0":
            continue
        rows, constrained = int(f["decode_rows"]), int(f["constrained_rows"])
        if constrained in (0, rows):
            by.setdefault((rows, constrained > 0), []).append(float(f["ms"]))
    print(f"{'decode rows':>12}{'plain ms':>10}{'steps':>7}{'schema ms':>11}{'steps':>7}{'ratio':>8}")
    for rows in sorted({r for r, _ in by}):
        plain, schema = by.get((rows, False)), by.get((rows, True))
        if plain and schema and len(plain) >= 5 and len(schema) >= 5:
            p, c = statistics.median(plain), statistics.median(schema)
            print(f"{rows:>12}{p:>10.1f}{len(plain):>7}{c:>11.1f}{len(schema):>7}{c / p:>7.2f}x")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--engine", choices=["tether", "llama.cpp"])
    p.add_argument("--url")
    p.add_argument("--label", default="model")
    p.add_argument("--settings", default="plain,schema,schema+ff", type=lambda s: s.split(","))
    p.add_argument("--streams", default="1,32", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--max-tokens", type=int, default=160)
    # One request per setting is one sample at one stream: rounds of new prompts, one row each (the report takes medians).
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--interleave", action="store_true", help="rounds outermost: every setting once per round, on one server")
    p.add_argument("--out")
    p.add_argument("--report")
    p.add_argument("--steps", help="a step-trace log: constrained against plain step times")
    args = p.parse_args()
    if args.report:
        report(args.report)
    elif args.steps:
        steps(args.steps)
    else:
        asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
