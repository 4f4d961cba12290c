#!/usr/bin/env python3
"""Load benchmark: drives a running server over its streaming API and writes one
JSON line per (engine, workload, setting); `--report` prints them side by side.

Two client backends behind one interface (`Client.open()` / `stream()` / `close()`):
  tether   protocol v1 over WebSocket (ws://HOST:PORT/v1/ws): one session per
           stream, `generate` with `prompt`, `max_tokens`, temperature 0; every
           `delta` arrival is timed (a delta may carry several tokens:
           len(token_ids)), tokens counted from done.usage.completion_tokens.
  mlx-lm   mlx_lm.server's OpenAI-compatible POST /v1/completions, stream: true,
           temperature 0, stream_options.include_usage (tokens counted from the
           final usage chunk), logit_bias -100 on the EOS ids so every stream runs
           to max_tokens; every SSE text chunk is timed as one token.
Tether has no logit_bias, so every prompt is a counting prompt ("1050,1051,
1052,...") that greedy decoding continues to max_tokens; the tokens that really
came are recorded. Every request gets a different prompt (the numbers start at a
fresh value), so no prompt cache (mlx-lm has one) serves any of them. Counting
without spaces ("1050,1051,") makes every token stream as its own chunk on both
servers (mlx-lm holds a lone space token back), so ITL is per token on both.

Workloads:
  decode  N concurrent streams for each N in --streams (prompt ~--prompt-tokens,
          --max-tokens each), started together. Aggregate tok/s = total completion
          tokens / (wall time from the first token of the run to its last token);
          TTFT = time from sending the request to its first token.
  admit   --admit-streams streams decode steadily (--steady-max-tokens, cancelled
          once the measurement is over); --admit-delay s after all have their first
          token, one --long-prompt-tokens prompt joins. Inter-token latency (ITL) of
          the steady streams: every gap between consecutive arrivals of a stream
          (a delta carrying k tokens counts as one gap and k-1 zero gaps); "window"
          = the gaps overlapping [long prompt submitted, its first token] (so a
          stall across the whole prefill counts once, in full), "steady" = the gaps
          after every stream's first token and before the submission. Also the long
          prompt's TTFT. Settings: tether `chunked` (server default chunk) and
          `unchunked` (`chunk_size` 4096 on the long request; the server caps it);
          mlx-lm: one setting per server, given by --mlx-prefill-step (its
          --prefill-step-size): chunked if smaller than the long prompt.

usage (peer venv python: it has aiohttp and tokenizers):
  load.py --engine tether --url http://127.0.0.1:PORT --model-dir DIR --out R.jsonl [--label smollm2-135m]
  load.py --engine mlx-lm --url http://127.0.0.1:PORT --model-dir DIR --out R.jsonl --mlx-prefill-step 2048
  load.py --report R.jsonl
DIR is the HF folder (tokenizer.json; EOS ids from config.json, generation_config.json,
tokenizer_config.json) used to size prompts in tokens; both engines get the same texts.
"""
import argparse
import asyncio
import json
import math
import os
import statistics
import sys
import time

PROMPT_TEXT = (
    "The history of computing is a story of abstraction. Early machines were programmed "
    "by rewiring panels; later, stored programs let the same hardware run many tasks. Compilers turned "
    "human-readable code into machine instructions, operating systems shared one computer among many users, "
    "and networks joined computers into systems larger than any one of them. "
)


def log(*a):
    print("[load]", *a, file=sys.stderr, flush=True)


def pct(xs, p):
    """Percentile with linear interpolation (numpy's default); None if empty."""
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


class Prompts:
    """Prompt texts sized in tokens with the model's own tokenizer."""

    def __init__(self, model_dir):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
        self.next_start = 1000
        self.next_doc = 1

    def count(self, text):
        return len(self.tok.encode(text, add_special_tokens=False).ids)

    def counting(self, n_tokens):
        """ "S,S+1,S+2,...," of about n_tokens tokens, S fresh for every call. No
        spaces: every token of the continuation is a digit or a comma, so both
        servers can stream each token's text as soon as it is sampled (mlx-lm's
        detokenizer holds a lone space token back until the next one)."""
        start = self.next_start
        parts, i = [], start
        while True:
            parts.append(str(i))
            text = ",".join(parts) + ","
            if self.count(text) >= n_tokens:
                break
            i += 1
        # Leave room for the numbers the continuation will count through.
        self.next_start = start + 100 * (1 + (i - start) // 100)
        return text

    def long(self, n_tokens):
        """A distinct English document of about n_tokens tokens (cut at the token
        level), ending in a short counting tail so the first generated token is a
        digit that streams at once on both servers."""
        tail = "\n" + self.counting(16)
        head = f"Document {self.next_doc}. "
        self.next_doc += 1
        body = head + PROMPT_TEXT * (n_tokens // 40 + 2)
        ids = self.tok.encode(body, add_special_tokens=False).ids[: max(1, n_tokens - self.count(tail))]
        return self.tok.decode(ids) + tail


def eos_ids(model_dir):
    ids = set()

    def add(v):
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, list):
            ids.update(x for x in v if isinstance(x, int))

    for name in ("config.json", "generation_config.json"):
        p = os.path.join(model_dir, name)
        if os.path.exists(p):
            add(json.load(open(p)).get("eos_token_id"))
    p = os.path.join(model_dir, "tokenizer_config.json")
    if os.path.exists(p):
        eos = json.load(open(p)).get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        if isinstance(eos, str):
            tj = json.load(open(os.path.join(model_dir, "tokenizer.json")))
            for t in tj.get("added_tokens", []):
                if t.get("content") == eos:
                    ids.add(t["id"])
    return sorted(ids)


class Stream:
    """What one request saw: send time, (arrival, tokens) per delta, the end."""

    def __init__(self, name):
        self.name = name
        self.t_submit = None
        self.arrivals = []  # (perf_counter seconds, tokens in this delta)
        self.t_end = None
        self.completion_tokens = None  # server's usage count
        self.prompt_tokens = None
        self.finish = None
        self.error = None

    @property
    def t_first(self):
        return self.arrivals[0][0] if self.arrivals else None

    @property
    def tokens_seen(self):
        return sum(k for _, k in self.arrivals)

    def tokens(self):
        return self.completion_tokens if self.completion_tokens is not None else self.tokens_seen


class TetherClient:
    """One WebSocket session (one stream)."""

    def __init__(self, http, base):
        self.http = http
        self.url = base.replace("http://", "ws://").rstrip("/") + "/v1/ws"
        self.ws = None
        self.n = 0

    async def open(self):
        self.ws = await self.http.ws_connect(self.url, max_msg_size=0, autoping=True)
        await self.ws.send_json({"type": "session.open"})
        msg = await self.ws.receive_json(timeout=30)
        if msg.get("type") != "session.ready":
            raise RuntimeError(f"expected session.ready, got {msg}")
        self.limits = msg["limits"]

    async def stream(self, st, prompt, max_tokens, stop=None, chunk_size=None):
        self.n += 1
        rid = f"r{self.n}"
        req = {"type": "generate", "request_id": rid, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        if chunk_size is not None:
            req["chunk_size"] = chunk_size
        canceller = None
        if stop is not None:

            async def cancel_on_stop():
                await stop.wait()
                await self.ws.send_json({"type": "cancel", "request_id": rid})

            canceller = asyncio.ensure_future(cancel_on_stop())
        st.t_submit = time.perf_counter()
        await self.ws.send_json(req)
        try:
            while True:
                m = await self.ws.receive()
                now = time.perf_counter()
                if m.type != 1:  # aiohttp.WSMsgType.TEXT
                    st.error = f"socket closed ({m.type})"
                    break
                msg = json.loads(m.data)
                t = msg.get("type")
                if msg.get("request_id") != rid:
                    if t == "error":
                        st.error = f"{msg.get('code')}: {msg.get('message')}"
                        break
                    continue
                if t == "delta":
                    st.arrivals.append((now, len(msg.get("token_ids", []))))
                elif t == "done":
                    st.t_end = now
                    st.finish = msg.get("finish_reason")
                    u = msg.get("usage", {})
                    st.completion_tokens = u.get("completion_tokens")
                    st.prompt_tokens = u.get("prompt_tokens")
                    break
                elif t == "error":
                    if msg.get("code") == "unknown_request":  # cancel raced with done
                        continue
                    st.t_end = now
                    st.error = f"{msg.get('code')}: {msg.get('message')}"
                    break
        finally:
            if canceller is not None:
                canceller.cancel()
        return st

    async def close(self):
        if self.ws is not None and not self.ws.closed:
            try:
                await self.ws.send_json({"type": "session.close"})
            except Exception:
                pass
            await self.ws.close()


class MlxLmClient:
    """One HTTP stream at a time against mlx_lm.server."""

    def __init__(self, http, base, eos):
        self.http = http
        self.url = base.rstrip("/") + "/v1/completions"
        self.bias = {str(i): -100 for i in eos}

    async def open(self):
        pass

    async def stream(self, st, prompt, max_tokens, stop=None, chunk_size=None):
        body = {
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "logit_bias": self.bias,
        }
        st.t_submit = time.perf_counter()
        resp = await self.http.post(self.url, json=body)
        closer = None
        if stop is not None:

            async def close_on_stop():
                await stop.wait()
                st.finish = st.finish or "cancelled"
                resp.close()  # mlx-lm stops the request when its socket breaks

            closer = asyncio.ensure_future(close_on_stop())
        try:
            if resp.status != 200:
                st.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return st
            async for raw in resp.content:
                now = time.perf_counter()
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue  # blank lines and ": keepalive" comments during prefill
                data = line[5:].strip()
                if data == "[DONE]":
                    st.t_end = now
                    break
                msg = json.loads(data)
                for ch in msg.get("choices") or []:
                    if ch.get("text"):
                        st.arrivals.append((now, 1))
                    if ch.get("finish_reason"):
                        st.finish = ch["finish_reason"]
                if msg.get("usage"):
                    st.completion_tokens = msg["usage"].get("completion_tokens")
                    st.prompt_tokens = msg["usage"].get("prompt_tokens")
        except Exception as e:  # the stream closed on purpose, or failed
            if not (stop is not None and stop.is_set()):
                st.error = f"{type(e).__name__}: {e}"
        finally:
            if closer is not None:
                closer.cancel()
            resp.release()
        return st

    async def close(self):
        pass


class Bench:
    def __init__(self, args, http):
        self.a = args
        self.http = http
        self.prompts = Prompts(args.model_dir)
        self.eos = eos_ids(args.model_dir) if args.engine == "mlx-lm" else []
        if args.engine == "mlx-lm" and not self.eos:
            raise SystemExit(f"no EOS ids found in {args.model_dir}")

    def client(self):
        if self.a.engine == "tether":
            return TetherClient(self.http, self.a.url)
        return MlxLmClient(self.http, self.a.url, self.eos)

    async def clients(self, n):
        cs = [self.client() for _ in range(n)]
        await asyncio.wait_for(asyncio.gather(*(c.open() for c in cs)), 60)
        return cs

    def base(self, workload, **kw):
        r = {"engine": self.a.engine, "model": self.a.label, "workload": workload}
        r.update(kw)
        return r

    async def warmup(self):
        (c,) = await self.clients(1)
        st = Stream("warmup")
        try:
            await asyncio.wait_for(c.stream(st, self.prompts.counting(16), 8), self.a.warmup_timeout)
        finally:
            await c.close()
        if st.error or not st.arrivals:
            raise SystemExit(f"warm-up request failed: {st.error or 'no tokens'}")
        log(f"{self.a.engine}: warm-up ok ({st.tokens()} tokens, TTFT {st.t_first - st.t_submit:.2f}s)")

    async def decode(self, n):
        cs = await self.clients(n)
        sts = [Stream(f"s{i}") for i in range(n)]
        prompts = [self.prompts.counting(self.a.prompt_tokens) for _ in range(n)]
        try:
            await asyncio.wait_for(
                asyncio.gather(*(c.stream(s, p, self.a.max_tokens) for c, s, p in zip(cs, sts, prompts))),
                self.a.workload_timeout,
            )
        finally:
            await asyncio.gather(*(c.close() for c in cs), return_exceptions=True)
        errors = [s.error for s in sts if s.error]
        got = [s for s in sts if s.arrivals]
        first = min(s.t_first for s in got) if got else None
        last = max(s.arrivals[-1][0] for s in got) if got else None
        tokens = sum(s.tokens() for s in sts)
        ttft = [s.t_first - s.t_submit for s in got]
        r = self.base(
            "decode",
            streams=n,
            setting="-",
            prompt_tokens=statistics.mean(s.prompt_tokens for s in sts) if all(s.prompt_tokens for s in sts) else None,
            max_tokens=self.a.max_tokens,
            completion_tokens=tokens,
            short_streams=sum(1 for s in sts if s.tokens() < self.a.max_tokens),
            agg_tok_s=tokens / (last - first) if got and last > first else None,
            wall_s=last - first if got else None,
            ttft_mean_s=statistics.mean(ttft) if ttft else None,
            ttft_p50_s=pct(ttft, 50),
            ttft_max_s=max(ttft) if ttft else None,
            tokens_per_delta=tokens / max(1, sum(len(s.arrivals) for s in sts)),
            errors=errors[:3],
        )
        return r

    async def admit(self, setting, chunk_size, label):
        a = self.a
        cs = await self.clients(a.admit_streams + 1)
        steady_cs, long_c = cs[:-1], cs[-1]
        sts = [Stream(f"s{i}") for i in range(a.admit_streams)]
        stop = asyncio.Event()
        deadline = time.perf_counter() + a.workload_timeout
        prompts = [self.prompts.counting(a.prompt_tokens) for _ in sts]
        long_prompt = self.prompts.long(a.long_prompt_tokens)
        tasks = [asyncio.ensure_future(c.stream(s, p, a.steady_max_tokens, stop=stop)) for c, s, p in zip(steady_cs, sts, prompts)]
        lt = Stream("long")
        long_task = None
        try:
            # Every steady stream decoding, then the delay.
            while not all(s.arrivals or s.t_end for s in sts):
                if time.perf_counter() > deadline:
                    raise TimeoutError("steady streams did not start")
                await asyncio.sleep(0.02)
            t_steady = max(s.t_first or s.t_end for s in sts)
            await asyncio.sleep(a.admit_delay)
            long_task = asyncio.ensure_future(long_c.stream(lt, long_prompt, a.long_max_tokens, chunk_size=chunk_size))
            while not (lt.arrivals or long_task.done()):
                if time.perf_counter() > deadline:
                    raise TimeoutError("long prompt got no first token in time")
                await asyncio.sleep(0.01)
            await asyncio.wait_for(long_task, max(1.0, deadline - time.perf_counter()))
            if lt.error or not lt.arrivals:
                raise RuntimeError(f"long prompt failed: {lt.error}")
            t_sub, t_first = lt.t_submit, lt.t_first
            # Wait for every steady stream's next token after the window, so a
            # stall across the window is measured in full.
            end_wait = min(deadline, time.perf_counter() + 30)
            while time.perf_counter() < end_wait and not all(
                s.t_end or (s.arrivals and s.arrivals[-1][0] > t_first) for s in sts
            ):
                await asyncio.sleep(0.02)
        finally:
            stop.set()
            if long_task is not None and not long_task.done():
                long_task.cancel()
            done, pending = await asyncio.wait(tasks, timeout=30)
            for t in pending:
                t.cancel()
            await asyncio.gather(*(c.close() for c in cs), return_exceptions=True)
        window, steady = [], []
        window_tokens = 0
        alive = 0
        for s in sts:
            arr = s.arrivals
            if (s.t_end is None or s.t_end > t_first or s.finish == "cancelled") and not s.error:
                alive += 1
            for (t0, _), (t1, k) in zip(arr, arr[1:]):
                gaps = [t1 - t0] + [0.0] * (k - 1)
                if t1 > t_sub and t0 < t_first:
                    window += gaps
                elif t0 >= t_steady and t1 <= t_sub:
                    steady += gaps
            window_tokens += sum(k for t, k in arr if t_sub < t <= t_first)
        ms = lambda x: None if x is None else x * 1e3
        return self.base(
            "admit",
            streams=a.admit_streams,
            setting=setting,
            chunk=label,
            long_prompt_tokens=lt.prompt_tokens,
            long_ttft_s=t_first - t_sub,
            window_s=t_first - t_sub,
            itl_steady_p50_ms=ms(pct(steady, 50)),
            itl_window_p50_ms=ms(pct(window, 50)),
            itl_window_p99_ms=ms(pct(window, 99)),
            itl_window_max_ms=ms(max(window) if window else None),
            itl_steady_mean_ms=ms(statistics.mean(steady) if steady else None),
            itl_window_mean_ms=ms(statistics.mean(window) if window else None),
            window_gaps=len(window),
            steady_gaps=len(steady),
            window_decode_tok_s=window_tokens / (t_first - t_sub),
            steady_alive=alive,
            errors=[s.error for s in sts if s.error][:3],
        )


async def run(args):
    import aiohttp

    out = open(args.out, "a")

    def emit(r):
        r["time"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        out.write(json.dumps(r) + "\n")
        out.flush()
        log(json.dumps(r))

    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as http:
        b = Bench(args, http)
        await b.warmup()
        work = args.workloads.split(",")
        failed = 0

        async def attempt(coro, **what):
            nonlocal failed
            try:
                emit(await coro)
            except Exception as e:  # a failed workload is recorded, the others still run
                failed += 1
                emit({"engine": args.engine, "model": args.label, **what, "errors": [f"{type(e).__name__}: {e}"]})

        if "decode" in work:
            for n in [int(x) for x in args.streams.split(",") if x]:
                log(f"{args.engine}: decode, {n} streams x {args.max_tokens} tokens")
                await attempt(b.decode(n), workload="decode", streams=n, setting="-")
        if "admit" in work:
            if args.engine == "tether":
                settings = [("chunked", None, "server default"), ("unchunked", 4096, "chunk_size=4096 requested")]
                settings = [s for s in settings if s[0] in args.tether_settings.split(",")]
            else:
                step = args.mlx_prefill_step
                name = "unchunked" if step >= args.long_prompt_tokens else "chunked"
                settings = [(name, None, f"prefill-step-size {step}")]
            for name, chunk, label in settings:
                log(f"{args.engine}: admit a {args.long_prompt_tokens}-token prompt under {args.admit_streams} streams, {name} ({label})")
                await attempt(b.admit(name, chunk, label), workload="admit", streams=args.admit_streams, setting=name, chunk=label)
        if failed:
            raise SystemExit(f"{failed} workload(s) failed; see the errors in {args.out}")


# ---------------------------------------------------------------- report

def report(path):
    rows = [json.loads(l) for l in open(path) if l.strip()]
    models = []
    for r in rows:
        if r["model"] not in models:
            models.append(r["model"])

    def fmt(v, unit):
        if v is None:
            return "-"
        return f"{v:.1f}" if unit in ("tok/s", "ms") else f"{v:.2f}"

    for m in models:
        rs = [r for r in rows if r["model"] == m]
        reps = max(sum(1 for r in rs if r["engine"] == e and r["workload"] == "decode" and r.get("streams") == 1) for e in ("tether", "mlx-lm"))
        runs = f"median of {reps} runs each, " if reps > 1 else ""
        print(f"\n{m}: tether vs mlx-lm, same script; {runs}ratio = tether / mlx-lm")
        print(f"{'metric':<52} {'tether':>9} {'mlx-lm':>9} {'ratio':>7}  better")

        def line(name, unit, better, t, p):
            tv = t.get(unit[0]) if t else None
            pv = p.get(unit[0]) if p else None
            ratio = f"{tv / pv:.2f}x" if tv is not None and pv else "-"
            print(f"{name:<52} {fmt(tv, unit[1]):>9} {fmt(pv, unit[1]):>9} {ratio:>7}  {better}")

        def last(engine, **kw):
            """The matching runs merged: the median of each number over the runs
            (repeats) that have it; other fields from the last run."""
            c = [r for r in rs if r["engine"] == engine and all(r.get(k) == v for k, v in kw.items())]
            if not c:
                return None
            merged = dict(c[-1])
            for k, v in c[-1].items():
                if isinstance(v, float):
                    vals = [r[k] for r in c if isinstance(r.get(k), (int, float))]
                    merged[k] = statistics.median(vals) if vals else None
            for k in ("agg_tok_s", "long_ttft_s"):
                vals = [r[k] for r in c if r.get(k) is not None]
                merged[k] = statistics.median(vals) if vals else None
            merged["runs"] = len(c)
            return merged

        ns = sorted({r["streams"] for r in rs if r["workload"] == "decode"})
        for n in ns:
            t, p = last("tether", workload="decode", streams=n), last("mlx-lm", workload="decode", streams=n)
            line(f"decode tok/s, aggregate, {n} stream{'s' * (n > 1)}", ("agg_tok_s", "tok/s"), "higher", t, p)
        for n in ns:
            t, p = last("tether", workload="decode", streams=n), last("mlx-lm", workload="decode", streams=n)
            line(f"TTFT mean (s), {n} stream{'s' * (n > 1)} started together", ("ttft_mean_s", "s"), "lower", t, p)
        for n in ns:
            t, p = last("tether", workload="decode", streams=n), last("mlx-lm", workload="decode", streams=n)
            line(f"TTFT p50 (s), {n} stream{'s' * (n > 1)} started together", ("ttft_p50_s", "s"), "lower", t, p)
        for setting in ("chunked", "unchunked"):
            t = last("tether", workload="admit", setting=setting)
            p = last("mlx-lm", workload="admit", setting=setting)
            if not t and not p:
                continue
            peer_note = ""
            if t and not p:
                p = last("mlx-lm", workload="admit")
                peer_note = f" (mlx-lm: {p['setting']})" if p else ""
            lp = (t or p).get("long_prompt_tokens") or "long"
            n = (t or p).get("streams")
            print(
                f"-- {lp}-token prompt admitted under {n} decoding streams, {setting}: tether {t.get('chunk') if t else '-'}, "
                f"mlx-lm {p.get('chunk') if p else '-'}{peer_note}"
            )
            line("  ITL p50 before (steady), ms", ("itl_steady_p50_ms", "ms"), "lower", t, p)
            line("  ITL p50 while the prompt is prefilled, ms", ("itl_window_p50_ms", "ms"), "lower", t, p)
            line("  ITL p99 while the prompt is prefilled, ms", ("itl_window_p99_ms", "ms"), "lower", t, p)
            line("  decode tok/s of the streams during the prefill", ("window_decode_tok_s", "tok/s"), "higher", t, p)
            line("  long prompt TTFT (s)", ("long_ttft_s", "s"), "lower", t, p)
    notes = [r for r in rows if r.get("errors") or r.get("short_streams") or (r["workload"] == "admit" and r.get("steady_alive", 0) < (r.get("streams") or 0))]
    for r in notes:
        print(f"note: {r['engine']} {r['workload']} {r.get('streams')} {r.get('setting')}: errors {r.get('errors')}, "
              f"short streams {r.get('short_streams', 0)}, steady streams alive {r.get('steady_alive', '-')}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--report", metavar="RESULTS", help="print the side-by-side table of RESULTS.jsonl and exit")
    ap.add_argument("--engine", choices=["tether", "mlx-lm"])
    ap.add_argument("--url", help="server base URL, http://127.0.0.1:PORT")
    ap.add_argument("--model-dir", help="HF model folder: tokenizer.json (prompt sizing), EOS ids")
    ap.add_argument("--label", help="model name in the results (default: the folder's name)")
    ap.add_argument("--out", help="results file (JSON lines, appended)")
    ap.add_argument("--workloads", default="decode,admit")
    ap.add_argument("--streams", default="1,8,32", help="decode workload: concurrent streams")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--admit-streams", type=int, default=8)
    ap.add_argument("--steady-max-tokens", type=int, default=1024, help="cap of the steady streams (cancelled when done)")
    ap.add_argument("--admit-delay", type=float, default=2.0)
    ap.add_argument("--long-prompt-tokens", type=int, default=2000)
    ap.add_argument("--long-max-tokens", type=int, default=4)
    ap.add_argument("--tether-settings", default="chunked,unchunked")
    ap.add_argument("--mlx-prefill-step", type=int, default=2048, help="the mlx-lm server's --prefill-step-size (a label)")
    ap.add_argument("--warmup-timeout", type=float, default=180)
    ap.add_argument("--workload-timeout", type=float, default=240, help="seconds one workload may take")
    args = ap.parse_args()
    if args.report:
        report(args.report)
        return
    for k in ("engine", "url", "model_dir", "out"):
        if not getattr(args, k):
            ap.error(f"--{k.replace('_', '-')} is required")
    args.label = args.label or os.path.basename(os.path.normpath(args.model_dir))
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
