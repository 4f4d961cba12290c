#!/usr/bin/env python3
"""Load benchmark: drives a running server over its streaming API and writes one
JSON line per (engine, workload, setting); `--report` prints them side by side.

Client backends behind one interface (`Client.open()` / `stream()` / `close()`):
  tether   protocol v1 over WebSocket (ws://HOST:PORT/v1/ws): one session per
           stream, `generate` with `prompt`, `max_tokens`, temperature 0; every
           `delta` arrival is timed (a delta may carry several tokens:
           len(token_ids)), tokens counted from done.usage.completion_tokens.
  mlx-lm   mlx_lm.server's OpenAI-compatible POST /v1/completions, stream: true,
           temperature 0, stream_options.include_usage (tokens counted from the
           final usage chunk), logit_bias -100 on the EOS ids so every stream runs
           to max_tokens; every SSE text chunk is timed as one token.
  tether-openai  the same OpenAI client against Tether's own /v1/completions
           (with `model`, without logit_bias: the counting prompts run to
           max_tokens anyway). Beside `tether` on the same server it measures
           what the HTTP edge costs against /v1/ws (bench/edges.sh). The raw
           completions endpoint, not chat: the same prompt text reaches the
           engine on both edges, so only the edge differs.
  tether-llamacpp  Tether's llama.cpp-compatible POST /completion, streamed
           (`data: {...}` lines; tokens from the final `timings.predicted_n`),
           the editor edge, measured the same way.
  llama.cpp  llama.cpp's own server (bench/peer/llamacpp.sh) on the same GGUF,
           through the same /completion client.
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
          "all decoding" tok/s = the tokens that arrived while every stream was
          decoding (after the last stream's first token, up to the first stream's
          last token) / that window: the same without the ramps of streams still
          reading their prompts or already done. TTFT = time from sending the
          request to its first token.
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

  agent   one agent conversation of --agent-turns turns (default 12), written as
          raw ChatML text (the instruct model's own markup; both servers parse
          its special tokens): turn 1 is a system line and a user message;
          every later turn sends the whole history (every earlier user message
          and assistant reply, verbatim) plus a new user message of
          --agent-user-tokens tokens (default 310-340, varied text: bug reports,
          tool output, code lines, from a seeded generator, the same on every
          run), and generates --agent-max-tokens (32) greedy tokens; the reply
          is appended to the history as text. So the history grows to about
          4,300 tokens by turn 12 (SmolLM2-135M). Measured per turn:
          TTFT (client side: request sent -> first streamed text), the server's
          prompt and cached token counts, and hashes of the prompt and reply
          texts (equal hashes = both engines saw the same history).
          Raw prompts on both servers (Tether `prompt`, mlx-lm /v1/completions),
          so no chat template differs; no logit_bias on either (a reply ends
          where greedy decoding ends it, on both). Settings:
            tether `cache`    one session for the whole conversation: its prefix
                              cache is session-scoped, turn N resumes from turn
                              N-1 (done.usage.cached_tokens);
            tether `nocache`  the same conversation, a fresh session per turn
                              (closed after it): nothing to reuse, the baseline;
            mlx-lm `prompt-cache`  the server's prompt cache: it keeps the KV state
                              of each finished request (prompt + reply tokens) in
                              a trie and the next request resumes from the
                              longest common prefix. /v1/completions, not
                              /v1/chat/completions: a raw prompt is one segment,
                              so the whole previous turn (reply included) is
                              reused; the chat path re-renders the template and
                              splits system/user segments, and its template
                              would differ from Tether's raw prompt.
          --report prints TTFT per turn side by side and, at the last turn, the
          ratios tether cache / no-cache and tether / mlx-lm.

usage (peer venv python: it has aiohttp and tokenizers):
  load.py --engine tether --url http://127.0.0.1:PORT --model-dir DIR --out R.jsonl [--label smollm2-135m]
  load.py --engine mlx-lm --url http://127.0.0.1:PORT --model-dir DIR --out R.jsonl --mlx-prefill-step 2048
  load.py --engine tether --url ... --model-dir DIR --out R.jsonl --workloads agent
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

    def __init__(self, model_dir, first_number=1000):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
        self.next_start = first_number
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


class AgentConversation:
    """The agent workload's user messages: varied text (bug reports, tool
    output, code lines, requests) from a generator seeded per turn, so every
    run and both engines get the same texts. Written in ChatML, the instruct
    models' own format, as raw text (both servers parse the special tokens in
    a raw prompt): turn 1 starts with a system line, every message is
    "<|im_start|>user\n...<|im_end|>\n<|im_start|>assistant\n", and a later
    turn first closes the previous reply with "<|im_end|>\n". Each turn's new
    text is sized to a token count drawn from [lo, hi] (the markup included)."""

    SYSTEM = "<|im_start|>system\nYou are a coding assistant. Answer briefly and precisely.<|im_end|>\n"
    SUBJECTS = ["the parser", "the cache", "the scheduler", "the test suite", "the nightly build", "the tokenizer",
                "the session store", "the socket reader", "the config loader", "the metrics endpoint", "the retry loop",
                "the database migration", "the upload handler", "the rate limiter", "the log rotation job", "the CLI"]
    VERBS = ["fails", "times out", "returns an empty list", "panics", "leaks memory", "logs a warning and goes on",
             "skips the first item", "counts some rows twice", "blocks the event loop", "reads a stale value",
             "hangs forever", "rejects valid input", "writes a truncated file", "retries without a backoff"]
    WHEN = ["when the input is empty", "after a reconnect", "under load", "on the second call", "with a trailing newline",
            "if the file is missing", "only on Linux", "when two requests race", "after the cache is cleared",
            "with non-ASCII names", "right after a deploy", "when the queue is full"]
    FILES = ["src/main.rs", "src/lib.rs", "server/session.rs", "engine/worker.rs", "api/handlers.py", "utils/io.py",
             "tests/test_cache.py", "web/app.ts", "db/schema.sql", "cmd/root.go", "lib/queue.c", "scripts/deploy.sh"]
    IDENTS = ["parse_header", "load_config", "retry_after", "flush_buffer", "open_session", "evict_oldest",
              "read_chunk", "encode_frame", "schedule_step", "merge_ranges", "resolve_path", "drain_queue"]
    VARS = ["buf", "offset", "count", "deadline", "entry", "path", "rows", "limit", "token", "state", "len", "batch"]

    def __init__(self, prompts, lo, hi, seed=5):
        import random

        self.p, self.lo, self.hi, self.seed = prompts, lo, hi, seed
        self.random = random

    def _sentence(self, r):
        k = r.randrange(7)
        f, i, v, v2 = r.choice(self.FILES), r.choice(self.IDENTS), r.choice(self.VARS), r.choice(self.VARS)
        if k == 0:
            return f"I ran it again and {r.choice(self.SUBJECTS)} still {r.choice(self.VERBS)} {r.choice(self.WHEN)}."
        if k == 1:
            return (f"In {f}, line {r.randint(12, 980)}, `{i}` {r.choice(self.VERBS)} {r.choice(self.WHEN)}; "
                    f"the log shows error {r.randint(100, 599)} after {r.randint(2, 9000)} ms.")
        if k == 2:
            return f"\n{f}:{r.randint(1, 700)}:{r.randint(1, 80)}: warning: unused variable `{v}` in `{i}`"
        if k == 3:
            return f"\n    let {v} = {i}(&{v2}, {r.randint(0, 4096)})?;"
        if k == 4:
            return f"Could you check whether `{i}` handles `{v}` = {r.randint(-5, 70000)} before it touches `{v2}`?"
        if k == 5:
            return (f"The test {r.choice(self.IDENTS)}_{r.randint(1, 60)} took {r.randint(1, 99)}.{r.randint(0, 9)} s "
                    f"and {r.choice(['passed', 'failed', 'was skipped', 'flaked'])} on run {r.randint(1, 400)}.")
        return f"Maybe {r.choice(self.SUBJECTS)} is to blame, since it changed in commit {r.getrandbits(28):07x}."

    def user(self, turn):
        """Turn `turn`'s new text (1-based), about n tokens, n drawn from [lo, hi]."""
        r = self.random.Random(f"agent-{self.seed}-{turn}")
        n = r.randint(self.lo, self.hi)
        head = (self.SYSTEM if turn == 1 else "<|im_end|>\n") + "<|im_start|>user\n"
        tail = "<|im_end|>\n<|im_start|>assistant\n"
        budget = n - self.p.count(head) - self.p.count(tail)
        body = ""
        while self.p.count(body) < budget + 8:
            x = self._sentence(r)
            body += (" " if body and not x.startswith("\n") else "") + x
        ids = self.p.tok.encode(body, add_special_tokens=False).ids[:budget]
        return head + self.p.tok.decode(ids).strip() + tail


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
        self.cached_tokens = None  # prompt tokens the server served from its cache
        self.text = []  # streamed text pieces
        self.server_ttft_ms = None
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
                    st.text.append(msg.get("text", ""))
                elif t == "done":
                    st.t_end = now
                    st.finish = msg.get("finish_reason")
                    u = msg.get("usage", {})
                    st.completion_tokens = u.get("completion_tokens")
                    st.prompt_tokens = u.get("prompt_tokens")
                    st.cached_tokens = u.get("cached_tokens")
                    st.server_ttft_ms = (msg.get("timing") or {}).get("ttft_ms")
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


class SseClient:
    """One HTTP stream at a time: POST a JSON body, read `data:` lines until
    the subclass's `event` says the stream is over. Closing the response
    cancels the request (both servers stop a request whose socket breaks)."""

    url = None

    def __init__(self, http):
        self.http = http

    async def open(self):
        pass

    async def close(self):
        pass

    async def stream(self, st, prompt, max_tokens, stop=None, chunk_size=None):
        st.t_submit = time.perf_counter()
        resp = await self.http.post(self.url, json=self.body(prompt, max_tokens))
        closer = None
        if stop is not None:

            async def close_on_stop():
                await stop.wait()
                st.finish = st.finish or "cancelled"
                resp.close()

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
                if self.event(st, line[5:].strip(), now):
                    st.t_end = now
                    break
        except Exception as e:  # the stream closed on purpose, or failed
            if not (stop is not None and stop.is_set()):
                st.error = f"{type(e).__name__}: {e}"
        finally:
            if closer is not None:
                closer.cancel()
            resp.release()
        return st


class OpenAIClient(SseClient):
    """An OpenAI-compatible /v1/completions (mlx_lm.server, or Tether's own
    HTTP edge when `model` is given)."""

    def __init__(self, http, base, eos, bias_eos=True, model=None):
        super().__init__(http)
        self.url = base.rstrip("/") + "/v1/completions"
        self.bias = {str(i): -100 for i in eos} if bias_eos and eos else None
        self.model = model

    def body(self, prompt, max_tokens):
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        if self.model:
            body["model"] = self.model
        if self.bias:
            body["logit_bias"] = self.bias
        return body

    def event(self, st, data, now):
        if data == "[DONE]":
            return True
        msg = json.loads(data)
        for ch in msg.get("choices") or []:
            if ch.get("text"):
                st.arrivals.append((now, 1))
                st.text.append(ch["text"])
            if ch.get("finish_reason"):
                st.finish = ch["finish_reason"]
        if msg.get("usage"):
            st.completion_tokens = msg["usage"].get("completion_tokens")
            st.prompt_tokens = msg["usage"].get("prompt_tokens")
            st.cached_tokens = (msg["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
        return False


class LlamaCppClient(SseClient):
    """A llama.cpp-style POST /completion (Tether's editor edge)."""

    def __init__(self, http, base):
        super().__init__(http)
        self.url = base.rstrip("/") + "/completion"

    def body(self, prompt, max_tokens):
        return {"prompt": prompt, "n_predict": max_tokens, "temperature": 0, "stream": True}

    def event(self, st, data, now):
        msg = json.loads(data)
        if msg.get("content"):
            st.arrivals.append((now, 1))
            st.text.append(msg["content"])
        if not msg.get("stop"):
            return False
        st.finish = msg.get("stop_type")
        timings = msg.get("timings") or {}
        st.completion_tokens = timings.get("predicted_n")
        st.prompt_tokens = msg.get("tokens_evaluated")
        st.cached_tokens = timings.get("cache_n")
        return True


def is_ws(engine):
    """Tether over its own protocol (this build or the previous one)."""
    return engine in ("tether", "tether-prev")


def served_model(url):
    """The one model an OpenAI-compatible server lists."""
    import urllib.request

    with urllib.request.urlopen(url.rstrip("/") + "/v1/models", timeout=30) as r:
        return json.load(r)["data"][0]["id"]


class Bench:
    def __init__(self, args, http):
        self.a = args
        self.http = http
        self.prompts = Prompts(args.model_dir, args.first_number)
        self.eos = eos_ids(args.model_dir) if args.engine == "mlx-lm" else []
        if args.engine == "mlx-lm" and not self.eos:
            raise SystemExit(f"no EOS ids found in {args.model_dir}")

    def client(self, bias_eos=True):
        if is_ws(self.a.engine):
            return TetherClient(self.http, self.a.url)
        if self.a.engine == "tether-openai":
            return OpenAIClient(self.http, self.a.url, [], bias_eos=False, model=self.a.served_model)
        if self.a.engine in ("tether-llamacpp", "llama.cpp"):
            return LlamaCppClient(self.http, self.a.url)
        return OpenAIClient(self.http, self.a.url, self.eos, bias_eos)

    async def clients(self, n):
        cs = [self.client() for _ in range(n)]
        await asyncio.wait_for(asyncio.gather(*(c.open() for c in cs)), 60)
        return cs

    def base(self, workload, **kw):
        r = {"engine": self.a.engine, "model": self.a.label, "workload": workload}
        if self.a.build:
            r["build"] = self.a.build
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

    def cpu_seconds(self):
        """(server, this client) CPU seconds so far; the server's from /proc
        when --server-pid names it (a 2-core machine shares its cores between
        them, so either one's cost slows the other)."""
        server = None
        if self.a.server_pid:
            with open(f"/proc/{self.a.server_pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            server = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        return server, time.process_time()

    async def decode(self, n):
        cs = await self.clients(n)
        cpu_before = self.cpu_seconds()
        sts = [Stream(f"s{i}") for i in range(n)]
        prompts = [self.prompts.counting(self.a.prompt_tokens) for _ in range(n)]
        try:
            await asyncio.wait_for(
                asyncio.gather(*(c.stream(s, p, self.a.max_tokens) for c, s, p in zip(cs, sts, prompts))),
                self.a.workload_timeout,
            )
        finally:
            await asyncio.gather(*(c.close() for c in cs), return_exceptions=True)
        cpu_after = self.cpu_seconds()
        errors = [s.error for s in sts if s.error]
        got = [s for s in sts if s.arrivals]
        first = min(s.t_first for s in got) if got else None
        last = max(s.arrivals[-1][0] for s in got) if got else None
        tokens = sum(s.tokens() for s in sts)
        ttft = [s.t_first - s.t_submit for s in got]
        # Every stream decoding: from the last first token to the first last token.
        start = max(s.t_first for s in got) if got else None
        end = min(s.arrivals[-1][0] for s in got) if got else None
        all_decoding = len(got) == n and end > start
        window_tokens = sum(k for s in got for t, k in s.arrivals if start < t <= end) if all_decoding else 0
        r = self.base(
            "decode",
            streams=n,
            setting="-",
            prompt_tokens=statistics.mean(s.prompt_tokens for s in sts) if all(s.prompt_tokens for s in sts) else None,
            max_tokens=self.a.max_tokens,
            completion_tokens=tokens,
            cached_tokens=sum(s.cached_tokens or 0 for s in sts),
            short_streams=sum(1 for s in sts if s.tokens() < self.a.max_tokens),
            agg_tok_s=tokens / (last - first) if got and last > first else None,
            all_decoding_tok_s=window_tokens / (end - start) if all_decoding and window_tokens else None,
            all_decoding_s=end - start if all_decoding else None,
            wall_s=last - first if got else None,
            ttft_mean_s=statistics.mean(ttft) if ttft else None,
            ttft_p50_s=pct(ttft, 50),
            ttft_max_s=max(ttft) if ttft else None,
            tokens_per_delta=tokens / max(1, sum(len(s.arrivals) for s in sts)),
            server_cpu_s=cpu_after[0] - cpu_before[0] if cpu_before[0] is not None else None,
            client_cpu_s=cpu_after[1] - cpu_before[1],
            errors=errors[:3],
        )
        return r

    async def agent(self, setting):
        """One conversation (see the header): a list of per-turn records."""
        import hashlib

        a = self.a
        conv = AgentConversation(self.prompts, *a.agent_user_tokens)
        sha = lambda t: hashlib.sha256(t.encode()).hexdigest()[:16]
        per_turn_session = setting == "nocache"
        cache = setting != "nocache"
        history, out = "", []
        shared = None
        try:
            for turn in range(1, a.agent_turns + 1):
                history += conv.user(turn)
                c = self.client(bias_eos=False) if per_turn_session or shared is None else shared
                if per_turn_session or shared is None:
                    await asyncio.wait_for(c.open(), 60)
                    if not per_turn_session:
                        shared = c
                st = Stream(f"turn{turn}")
                try:
                    await asyncio.wait_for(c.stream(st, history, a.agent_max_tokens), a.workload_timeout)
                finally:
                    if per_turn_session:
                        await c.close()
                if st.error or not st.arrivals:
                    raise RuntimeError(f"turn {turn}: {st.error or 'no tokens'}")
                reply = "".join(st.text)
                r = self.base(
                    "agent",
                    setting=setting,
                    cache=cache,
                    turn=turn,
                    history_tokens=st.prompt_tokens,
                    cached_tokens=st.cached_tokens,
                    ttft_ms=(st.t_first - st.t_submit) * 1e3,
                    server_ttft_ms=st.server_ttft_ms,
                    completion_tokens=st.tokens(),
                    finish=st.finish,
                    total_ms=((st.t_end or st.arrivals[-1][0]) - st.t_submit) * 1e3,
                    prompt_sha=sha(history),
                    reply_sha=sha(reply),
                    reply=reply,
                    load_avg_1m=os.getloadavg()[0],  # the machine's load as the turn ended (shared CPUs: noise)
                )
                log(f"{a.engine} agent {setting} turn {turn}: history {st.prompt_tokens}, cached {st.cached_tokens}, "
                    f"TTFT {r['ttft_ms'] / 1e3:.2f} s, {st.tokens()} tokens ({st.finish})")
                out.append(r)
                history += reply
        finally:
            if shared is not None:
                await shared.close()
        return out

    async def admit(self, setting, chunk_size, label, rnd=1):
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
            round=rnd,
            chunk=label,
            long_prompt_tokens=lt.prompt_tokens,
            long_ttft_s=t_first - t_sub,
            window_s=t_first - t_sub,
            itl_steady_p50_ms=ms(pct(steady, 50)),
            itl_steady_p99_ms=ms(pct(steady, 99)),
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
                r = await coro
                for x in r if isinstance(r, list) else [r]:
                    emit(x)
            except Exception as e:  # a failed workload is recorded, the others still run
                failed += 1
                emit({"engine": args.engine, "model": args.label, **what, "errors": [f"{type(e).__name__}: {e}"]})

        if "decode" in work:
            for n in [int(x) for x in args.streams.split(",") if x]:
                log(f"{args.engine}: decode, {n} streams x {args.max_tokens} tokens")
                await attempt(b.decode(n), workload="decode", streams=n, setting="-")
        if "admit" in work:
            if is_ws(args.engine):
                settings = [("chunked", None, "server default"), ("unchunked", 4096, "chunk_size=4096 requested")]
                settings = [s for s in settings if s[0] in args.tether_settings.split(",")]
            elif args.engine == "llama.cpp":
                # Its server takes a prompt in batches of -b tokens (2048 by
                # default, bench/load.sh's flags) between other slots' tokens.
                settings = [("unchunked", None, "llama.cpp -b 2048")]
            else:
                step = args.mlx_prefill_step
                name = "unchunked" if step >= args.long_prompt_tokens else "chunked"
                settings = [(name, None, f"prefill-step-size {step}")]
            # Later rounds (each its own document) meet what the server learned
            # from the earlier ones, such as Tether's prefill allowance.
            for rnd in range(1, args.admit_rounds + 1):
                for name, chunk, label in settings:
                    log(f"{args.engine}: admit a {args.long_prompt_tokens}-token prompt under {args.admit_streams} streams, {name} ({label}), round {rnd}")
                    await attempt(b.admit(name, chunk, label, rnd), workload="admit", streams=args.admit_streams, setting=name, chunk=label, round=rnd)
        if "agent" in work:
            # A prefill the size of one turn first (a different text, its own
            # session), so turn 1 does not pay for first-use costs.
            c = b.client(bias_eos=False)
            await asyncio.wait_for(c.open(), 60)
            try:
                await asyncio.wait_for(c.stream(Stream("warmup-agent"), b.prompts.long(330), 4), args.warmup_timeout)
            finally:
                await c.close()
            settings = args.tether_agent_settings.split(",") if is_ws(args.engine) else ["prompt-cache"]
            for setting in settings:
                log(f"{args.engine}: agent, {args.agent_turns} turns, {setting}")
                await attempt(b.agent(setting), workload="agent", setting=setting)
        if failed:
            raise SystemExit(f"{failed} workload(s) failed; see the errors in {args.out}")


# ---------------------------------------------------------------- report

def report_agent(rows):
    """The agent workload per turn: TTFT of tether with its session cache, tether
    with a fresh session per turn, and mlx-lm's or llama.cpp's server with its
    prompt cache (the peer: llama.cpp where its rows are there; medians
    over repeated runs), then the last turn's ratios; one table per model and
    "build" (a label of the code measured, when the rows carry one). Rows of
    `tether bench --turns` (in-process, no "workload" field) are summarized on
    one line."""
    inproc = [r for r in rows if "workload" not in r]
    rows = [r for r in rows if r.get("workload") == "agent" and r.get("ttft_ms") is not None]
    med = lambda xs: statistics.median(xs) if xs else None
    s_ = lambda ms: "-" if ms is None else f"{ms / 1e3:.2f}"
    groups = []
    for r in rows:
        if (r["model"], r.get("build")) not in groups:
            groups.append((r["model"], r.get("build")))
    for m, build in groups:
        rs = [r for r in rows if r["model"] == m and r.get("build") == build]
        by = {}
        for r in rs:
            by.setdefault((r["engine"], r["setting"], r["turn"]), []).append(r)

        def get(engine, setting, turn):
            c = by.get((engine, setting, turn))
            if not c:
                return None
            return {**c[-1], "ttft_ms": med([x["ttft_ms"] for x in c]), "runs": len(c)}

        turns = sorted({r["turn"] for r in rs})
        peer = "llama.cpp" if any(r["engine"] == "llama.cpp" for r in rs) else "mlx-lm"
        runs = max(len(v) for v in by.values())
        built = f" [{build}]" if build else ""
        print(f"\n{m}{built}: agent conversation, time to first token per turn (s){f', median of {runs} runs' if runs > 1 else ''}")
        print("  tether cache: one session (session-scoped prefix cache); tether no-cache: a fresh session per turn;")
        print({"mlx-lm": "  mlx-lm: mlx_lm.server /v1/completions with its prompt cache; raw prompts, the same texts",
               "llama.cpp": "  llama.cpp: its server's /completion with its prompt cache (its defaults); raw prompts, the same texts"}[peer])
        has_prev = any(r["engine"] == "tether-prev" for r in rs)
        if has_prev:
            print("  prev: the previous build of Tether, with its session cache")
        prev_head = f" {'prev':>7} {'new/prev':>8} |" if has_prev else ""
        print(f"{'turn':>4} {'history':>7} | {'cached':>6} {'cache':>7} {'no-cache':>8} {'off/on':>7} |{prev_head} {'cached':>6} {peer:>9} | {'tether/' + peer:>16}")
        same, first_diff, count_diff = 0, None, []
        for t in turns:
            tc, tn, p = get("tether", "cache", t), get("tether", "nocache", t), get(peer, "prompt-cache", t)
            pc = get("tether-prev", "cache", t)
            prev_cols = ""
            if has_prev:
                vs_prev = f"{tc['ttft_ms'] / pc['ttft_ms']:.2f}x" if tc and pc else "-"
                prev_cols = f" {s_(pc and pc['ttft_ms']):>7} {vs_prev:>8} |"
            any_ = tc or tn or p
            hist = any_.get("history_tokens")
            off_on = f"{tn['ttft_ms'] / tc['ttft_ms']:.1f}x" if tc and tn else "-"
            vs = f"{tc['ttft_ms'] / p['ttft_ms']:.2f}x" if tc and p else "-"
            if tc and p:
                if tc.get("prompt_sha") == p.get("prompt_sha"):
                    same += 1
                elif first_diff is None:
                    first_diff = t
                if tc.get("history_tokens") != p.get("history_tokens"):
                    count_diff.append(t)
            print(
                f"{t:>4} {hist if hist is not None else '-':>7} | {tc['cached_tokens'] if tc else '-':>6} "
                f"{s_(tc and tc['ttft_ms']):>7} {s_(tn and tn['ttft_ms']):>8} {off_on:>7} |{prev_cols} "
                f"{p['cached_tokens'] if p and p.get('cached_tokens') is not None else '-':>6} {s_(p and p['ttft_ms']):>9} | {vs:>16}"
            )
        last = turns[-1]
        tc, tn, p = get("tether", "cache", last), get("tether", "nocache", last), get(peer, "prompt-cache", last)
        pc = get("tether-prev", "cache", last)
        if tc and pc:
            total = lambda e: sum(x["ttft_ms"] for x in (get(e, "cache", t) for t in turns) if x)
            print(f"turn {last}: new / previous build TTFT: {tc['ttft_ms'] / pc['ttft_ms']:.2f}x; "
                  f"sum over all turns: {total('tether') / 1e3:.2f} s / {total('tether-prev') / 1e3:.2f} s = {total('tether') / total('tether-prev'):.2f}x")
        if tc and tn:
            x = tn["ttft_ms"] / tc["ttft_ms"]
            print(f"turn {last}: tether cache vs no-cache: {x:.1f}x faster (issue target >= 20x: {'met' if x >= 20 else 'not met'})")
        if tc and p:
            x = tc["ttft_ms"] / p["ttft_ms"]
            target = " (issue target <= 0.20x: " + ("met" if x <= 0.2 else "not met") + ")" if peer == "mlx-lm" else ""
            print(f"turn {last}: tether / {peer} TTFT: {x:.2f}x{target}")
            if first_diff is None:
                print(f"histories: the same text on both engines at every turn ({same} of {len(turns)})")
            else:
                print(f"histories: the same text on both engines up to turn {first_diff - 1}; the replies differ from turn {first_diff - 1} on")
            if count_diff:
                print(f"note: the servers counted different prompt tokens at turns {count_diff}")
    if inproc:
        t = max(r["turn"] for r in inproc)
        on = [r["ttft_ms"] for r in inproc if r["turn"] == t and r.get("cache")]
        off = [r["ttft_ms"] for r in inproc if r["turn"] == t and not r.get("cache")]
        print(f"in-process `tether bench --turns` rows (4-bit weights, no build label): turn {t} TTFT {s_(med(on))} s cached, "
              f"{s_(med(off))} s uncached")


EDGES = {"tether-openai": "openai", "tether-llamacpp": "llamacpp"}


def report_edges(rows):
    """Tether's HTTP edges against its WebSocket edge, same server and
    workload: medians over the runs, ratio = edge / WebSocket."""
    for r in rows:
        for who in ("server", "client"):
            if r.get(f"{who}_cpu_s") is not None and r.get("completion_tokens"):
                r[f"{who}_cpu_ms_per_token"] = r[f"{who}_cpu_s"] * 1e3 / r["completion_tokens"]
    edges = [e for e in EDGES if any(r["engine"] == e for r in rows)]
    print("\nedge overhead: Tether over its HTTP edges (openai: /v1/completions, llamacpp: /completion; SSE) "
          "vs /v1/ws, same server; median of the runs; ratio = edge / ws")
    head = "".join(f" {EDGES[e]:>9} {'ratio':>7}" for e in edges)
    print(f"{'streams':>7} {'metric':<22} {'ws':>9}{head}  better")

    def median(engine, n, key):
        xs = [r[key] for r in rows if r["engine"] == engine and r.get("workload") == "decode" and r.get("streams") == n and r.get(key)]
        return statistics.median(xs) if xs else None

    for n in sorted({r["streams"] for r in rows if r.get("workload") == "decode" and r.get("streams")}):
        for key, name, better in (("ttft_mean_s", "TTFT mean (s)", "lower"), ("agg_tok_s", "aggregate tok/s", "higher"),
                                  ("server_cpu_ms_per_token", "server CPU ms/token", "lower"),
                                  ("client_cpu_ms_per_token", "client CPU ms/token", "lower")):
            digits = 1 if key == "agg_tok_s" else 3
            fmt = lambda v, d=digits: "-" if v is None else f"{v:.{d}f}"
            ws = median("tether", n, key)
            if ws is None and key.endswith("per_token"):
                continue
            cols = ""
            for e in edges:
                v = median(e, n, key)
                cols += f" {fmt(v):>9} {(f'{v / ws:.3f}x' if v and ws else '-'):>7}"
            print(f"{n:>7} {name:<22} {fmt(ws):>9}{cols}  {better}")


def report(path):
    rows = [json.loads(l) for l in open(path) if l.strip()]
    agent = [r for r in rows if "turn" in r]
    rows = [r for r in rows if "turn" not in r and "model" in r]
    if agent:
        report_agent(agent)
    if any(r["engine"] in EDGES for r in rows):
        report_edges(rows)
        return
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
        has_prev = any(r["engine"] == "tether-prev" for r in rs)
        has_llama = any(r["engine"] == "llama.cpp" for r in rs)
        prev_head = f" {'prev':>9} {'new/prev':>8}" if has_prev else ""
        llama_head = f" {'llama.cpp':>9} {'t/llama':>7}" if has_llama else ""
        if has_prev:
            print("prev: the previous build of Tether, same script and flags")
        if has_llama:
            print("llama.cpp: its server on the same GGUF (t/llama = tether / llama.cpp)")
        print(f"{'metric':<52} {'tether':>9}{prev_head} {'mlx-lm':>9} {'ratio':>7}{llama_head}  better")

        def line(name, unit, better, t, p):
            tv = t.get(unit[0]) if t else None
            pv = p.get(unit[0]) if p else None
            ratio = f"{tv / pv:.2f}x" if tv is not None and pv else "-"
            kind = {k: (t or p or {}).get(k) for k in ("workload", "streams", "setting")}
            prev_cols = llama_cols = ""
            if has_prev:
                # The previous build's run of the same kind as `t`.
                q = t and last("tether-prev", **kind)
                qv = q.get(unit[0]) if q else None
                vs_prev = f"{tv / qv:.2f}x" if tv is not None and qv else "-"
                prev_cols = f" {fmt(qv, unit[1]):>9} {vs_prev:>8}"
            if has_llama:
                # llama.cpp's run of the same kind (its one admission setting for either of Tether's).
                lr = last("llama.cpp", **kind) or (kind["workload"] == "admit" and last("llama.cpp", workload="admit")) or None
                lv = lr.get(unit[0]) if lr else None
                vs_llama = f"{tv / lv:.2f}x" if tv is not None and lv else "-"
                llama_cols = f" {fmt(lv, unit[1]):>9} {vs_llama:>7}"
            print(f"{name:<52} {fmt(tv, unit[1]):>9}{prev_cols} {fmt(pv, unit[1]):>9} {ratio:>7}{llama_cols}  {better}")

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
            for k in ("agg_tok_s", "all_decoding_tok_s", "long_ttft_s"):
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
            line(f"decode tok/s, all {n} decoding at once", ("all_decoding_tok_s", "tok/s"), "higher", t, p)
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
            line("  ITL p99 before (steady), ms", ("itl_steady_p99_ms", "ms"), "lower", t, p)
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
    # tether-prev: a previous build of Tether, measured beside the current one.
    # tether-openai: this build of Tether over its OpenAI HTTP edge.
    # tether-llamacpp: this build over its llama.cpp-compatible /completion.
    ap.add_argument("--engine", choices=["tether", "tether-prev", "tether-openai", "tether-llamacpp", "mlx-lm", "llama.cpp"])
    ap.add_argument("--url", help="server base URL, http://127.0.0.1:PORT")
    ap.add_argument("--model-dir", help="HF model folder: tokenizer.json (prompt sizing), EOS ids")
    ap.add_argument("--label", help="model name in the results (default: the folder's name)")
    ap.add_argument("--out", help="results file (JSON lines, appended)")
    ap.add_argument("--build", help="label of the code measured, recorded in each row (load.sh: the git commit)")
    ap.add_argument("--workloads", default="decode,admit")
    ap.add_argument("--streams", default="1,8,32", help="decode workload: concurrent streams")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--server-pid", type=int, help="record the server's CPU seconds per decode workload (Linux /proc)")
    ap.add_argument("--first-number", type=int, default=1000,
                    help="counting prompts start here; runs against one server need different values, "
                         "or a run's prompts are the previous run's, already cached")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--admit-streams", type=int, default=8)
    ap.add_argument("--steady-max-tokens", type=int, default=1024, help="cap of the steady streams (cancelled when done)")
    ap.add_argument("--admit-delay", type=float, default=2.0)
    ap.add_argument("--long-prompt-tokens", type=int, default=2000)
    ap.add_argument("--long-max-tokens", type=int, default=4)
    ap.add_argument("--admit-rounds", type=int, default=1, help="admit: long prompts per setting, one after another")
    ap.add_argument("--tether-settings", default="chunked,unchunked")
    ap.add_argument("--agent-turns", type=int, default=12)
    ap.add_argument("--agent-user-tokens", default="310:340", help="agent: new user tokens per turn, LO:HI")
    ap.add_argument("--agent-max-tokens", type=int, default=32)
    ap.add_argument("--tether-agent-settings", default="cache,nocache", help="agent: tether settings to run")
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
    lo, _, hi = args.agent_user_tokens.partition(":")
    args.agent_user_tokens = (int(lo), int(hi or lo))
    args.label = args.label or os.path.basename(os.path.normpath(args.model_dir))
    args.served_model = served_model(args.url) if args.engine == "tether-openai" else None
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
