#!/usr/bin/env python3
"""Warm sessions benchmark: many sessions with long histories, idle between
turns, each coming back for one more turn. What it measures is what a
server that holds sessions is for: how fast a returning session starts,
wherever its state was kept, and what holding the sessions costs.

One run on one `tether serve` (protocol v1 over WebSocket):
  1. A shared prefix of --shared-tokens tokens (seeded text) is put in the
     shared cache scope (`cache: "shared"`, `max_tokens: 0`), as a common
     system prompt would be.
  2. --sessions sessions are built one after another: each opens, sends the
     shared prefix plus --own-tokens tokens of its own text (so every
     session's state is its own, not shared), takes --max-tokens greedy
     tokens, and detaches (its socket closes; the session waits for a resume).
  3. The sessions come back one at a time in a seeded random order: each
     resumes and sends its whole history plus a new ~30-token user line.
     Time to first token (client side, send to first delta) is recorded with
     the tier that served the history: `disk` or `host` when the server's
     tether_kv_disk_hits or tether_kv_host_hits counter rose during that
     turn, else `ram` when cached tokens covered the history, else
     `recomputed`; with the server's time restoring the state (for a file:
     reading, checking and restoring it; tether_kv_{disk_read,
     host_restore}_seconds), so the rest of the wait shows apart.
With --cold-files DIR, the KV files under DIR are flushed and dropped from
the operating system's page cache after building (posix_fadvise), so a
`disk` turn reads the device, not RAM the kernel kept.
Printed and written (one JSON line): build time, the server's RSS before
building (the shared prefix cached) and after, KV bytes in RAM and on
disk after building, next-turn TTFT p50/p99 per tier, per restored tier
its restore time p50/p99 and TTFT in the run's first and second halves,
cached tokens, and every turn (order, tier, TTFT, restore seconds).

usage (the peer venv's python: aiohttp):
  sessions.py --url http://127.0.0.1:PORT --server-pid PID --label L --setting S --out R.jsonl
  sessions.py --report R.jsonl
"""
import argparse
import asyncio
import json
import os
import random
import re
import statistics
import sys
import time
import urllib.request

import aiohttp

WORDS = ("agent tool call result file line error module test branch build cache request token stream session "
         "history prompt model layer value key block page disk memory budget queue socket frame client server "
         "parser schema field number string array object status retry timeout offset length buffer window").split()


def text(seed, words):
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def log(*a):
    print("[sessions]", *a, file=sys.stderr, flush=True)


def pct(xs, p):
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def metric(url, name):
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        body = r.read().decode()
    m = re.search(rf"^tether_{name}(?:_total)? ([0-9.e+]+)$", body, re.M)
    return float(m.group(1)) if m else 0.0


def drop_from_page_cache(folder):
    """Flushes every file under `folder` and asks the kernel to drop its
    cached pages; returns the bytes asked about."""
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:  # removed meanwhile (superseded or evicted)
                continue
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                total += os.fstat(fd).st_size
            finally:
                os.close(fd)
    return total


def rss_bytes(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


async def turn(session, ws_url, body, request_id="t1", resume=None):
    """One request on a new socket: (ttft_s, done, session_ready). The socket
    closes after the request without session.close: the session detaches."""
    async with session.ws_connect(ws_url, max_msg_size=0) as ws:
        await ws.send_json({"type": "session.open", **(resume or {})})
        ready = await ws.receive_json()
        assert ready["type"] == "session.ready", ready
        sent = time.perf_counter()
        await ws.send_json({"type": "generate", "request_id": request_id, **body})
        ttft = None
        while True:
            m = await ws.receive_json()
            if m["type"] == "delta" and ttft is None:
                ttft = time.perf_counter() - sent
            elif m["type"] == "done":
                return (ttft if ttft is not None else time.perf_counter() - sent), m, ready
            elif m["type"] == "error":
                raise RuntimeError(m)


async def run(args):
    ws_url = args.url.replace("http://", "ws://") + "/v1/ws"
    shared = text(1, args.shared_tokens)  # ~1 token a word for these words
    rows = {}
    async with aiohttp.ClientSession() as http:
        _, done, _ = await turn(http, ws_url, {"prompt": shared, "max_tokens": 0, "cache": "shared"})
        log(f"shared prefix: {done['usage']['prompt_tokens']} tokens")
        await asyncio.sleep(2)  # idle: the engine returns freed pages to the system
        rss_base = rss_bytes(args.server_pid) if args.server_pid else None
        started = time.perf_counter()
        sessions = []
        for i in range(args.sessions):
            prompt = shared + "\n" + text(1000 + i, args.own_tokens)
            body = {"prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0}
            _, done, ready = await turn(http, ws_url, body)
            sessions.append({"id": ready["session_id"], "token": ready["resume_token"], "prompt": prompt,
                             "history_tokens": done["usage"]["prompt_tokens"], "built_cached": done["usage"]["cached_tokens"],
                             "answer_tokens": done["usage"]["completion_tokens"], "text": ""})
            if (i + 1) % 16 == 0:
                log(f"built {i + 1}/{args.sessions} sessions ({time.perf_counter() - started:.0f} s)")
        build_s = time.perf_counter() - started
        await asyncio.sleep(2)  # the last turns' state settles (written to disk, if it goes there)
        rss = rss_bytes(args.server_pid) if args.server_pid else None
        ram_bytes = metric(args.url, "prefix_cache_bytes")
        disk_bytes = metric(args.url, "kv_disk_bytes")
        host_bytes = metric(args.url, "kv_host_bytes")
        if args.cold_files:
            dropped = drop_from_page_cache(args.cold_files)
            log(f"dropped {dropped / 2**30:.2f} GiB of KV files from the page cache")
        log(f"built in {build_s:.0f} s; RSS {rss / 2**30 if rss else 0:.2f} GiB, KV in RAM {ram_bytes / 2**30:.2f} GiB, "
            f"host tier {host_bytes / 2**30:.2f} GiB, on disk {disk_bytes / 2**30:.2f} GiB")

        order = list(range(args.sessions))
        random.Random(7).shuffle(order)
        by_tier = {}
        cached = []
        turns = []
        for i in order:
            s = sessions[i]
            before = {t: metric(args.url, f"kv_{t}_hits") for t in ("disk", "host")}
            restore_before = metric(args.url, "kv_disk_read_seconds") + metric(args.url, "kv_host_restore_seconds")
            # The history as the session's own prompt (its answer's text is
            # not needed: the cache matches the prompt's tokens, and the
            # prompt alone is the part every tier holds).
            body = {"prompt": s["prompt"] + "\n" + text(5000 + i, 30), "max_tokens": 1, "temperature": 0}
            ttft, done, _ = await turn(http, ws_url, body, "t2", resume={"session_id": s["id"], "resume_token": s["token"]})
            hit = done["usage"]["cached_tokens"]
            cached.append(hit)
            restored = [t for t in ("disk", "host") if metric(args.url, f"kv_{t}_hits") > before[t]]
            if restored:
                tier = restored[0]
            elif hit >= s["history_tokens"] - 32:
                tier = "ram"
            else:
                tier = "recomputed"
            by_tier.setdefault(tier, []).append(ttft)
            restore_s = metric(args.url, "kv_disk_read_seconds") + metric(args.url, "kv_host_restore_seconds") - restore_before
            turns.append({"session": i, "tier": tier, "ttft_s": round(ttft, 5), "restore_s": round(restore_s, 5)})
        row = {
            "label": args.label, "setting": args.setting, "sessions": args.sessions,
            "history_tokens": statistics.median(s["history_tokens"] for s in sessions),
            "build_s": build_s, "cold_files": bool(args.cold_files), "rss_bytes": rss, "rss_base_bytes": rss_base,
            "kv_ram_bytes": ram_bytes, "kv_disk_bytes": disk_bytes,
            "kv_host_bytes": host_bytes, "cached_tokens_p50": statistics.median(cached),
            "tiers": {t: {"turns": len(v), "ttft_p50_s": pct(v, 50), "ttft_p99_s": pct(v, 99)} for t, v in by_tier.items()},
        }
        for tier in ("disk", "host"):
            restored = [t for t in turns if t["tier"] == tier]
            if len(restored) < 2:
                continue
            half = len(restored) // 2
            times = [t["restore_s"] for t in restored]
            v = row["tiers"][tier]
            v["restore_p50_s"], v["restore_p99_s"] = pct(times, 50), pct(times, 99)
            v["ttft_p50_by_half_s"] = [pct([t["ttft_s"] for t in part], 50) for part in (restored[:half], restored[half:])]
            log(f"{args.setting}: {tier}: restoring took p50 {v['restore_p50_s'] * 1e3:.0f} ms, p99 {v['restore_p99_s'] * 1e3:.0f} ms; "
                f"TTFT p50 in the first / second half {v['ttft_p50_by_half_s'][0] * 1e3:.0f} / {v['ttft_p50_by_half_s'][1] * 1e3:.0f} ms")
        row["turns"] = turns
        for t, v in sorted(by_tier.items()):
            log(f"{args.setting}: {t}: {len(v)} turns, TTFT p50 {pct(v, 50) * 1e3:.0f} ms, p99 {pct(v, 99) * 1e3:.0f} ms")
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")


def report(path):
    rows = [json.loads(line) for line in open(path) if line.strip()]
    print(f"{'setting':<10} {'sessions':>8} {'history':>8} {'build s':>8} {'RSS GiB':>8} {'RAM GiB':>8} {'host GiB':>8} {'disk GiB':>8}  next-turn TTFT by tier (p50 / p99 ms, turns)")
    hot = None
    for r in rows:
        for t, v in r["tiers"].items():
            if r["setting"] == "hot" and t == "ram":
                hot = v["ttft_p50_s"]
    for r in rows:
        tiers = "  ".join(f"{t}: {v['ttft_p50_s'] * 1e3:.0f} / {v['ttft_p99_s'] * 1e3:.0f} ({v['turns']})" for t, v in sorted(r["tiers"].items()))
        rss = (r["rss_bytes"] or 0) / 2**30
        print(f"{r['setting']:<10} {r['sessions']:>8} {r['history_tokens']:>8.0f} {r['build_s']:>8.0f} {rss:>8.2f} {r['kv_ram_bytes'] / 2**30:>8.2f} {r.get('kv_host_bytes', 0) / 2**30:>8.2f} {r['kv_disk_bytes'] / 2**30:>8.2f}  {tiers}")
    for r in rows:
        per_session = (r["kv_ram_bytes"] + r.get("kv_host_bytes", 0) + r["kv_disk_bytes"]) / r["sessions"]
        rss = (r["rss_bytes"] or 0) / 2**30
        print(f"  {r['setting']}: {per_session / 2**20:.1f} MiB of KV a session (all tiers); "
              f"{r['sessions'] / rss if rss else 0:.0f} sessions per GiB of server RSS")
        if r.get("rss_base_bytes") and r["rss_bytes"]:
            grown = (r["rss_bytes"] - r["rss_base_bytes"]) / r["sessions"]
            print(f"  {r['setting']}: RSS grew {grown / 2**20:.1f} MiB a session (from {r['rss_base_bytes'] / 2**30:.2f} GiB "
                  f"with the shared prefix cached)")
        for t, v in sorted(r["tiers"].items()):
            if "restore_p50_s" in v:
                first, second = v["ttft_p50_by_half_s"]
                print(f"  {r['setting']} {t}: restoring took {v['restore_p50_s'] * 1e3:.0f} / {v['restore_p99_s'] * 1e3:.0f} ms (p50 / p99); "
                      f"TTFT p50 {first * 1e3:.0f} ms in the run's first half, {second * 1e3:.0f} ms in its second")
    if hot:
        for r in rows:
            for t, v in sorted(r["tiers"].items()):
                print(f"  {r['setting']} {t}: p50 {v['ttft_p50_s'] / hot:.2f}x, p99 {v['ttft_p99_s'] / hot:.2f}x of hot p50")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url")
    ap.add_argument("--server-pid", type=int)
    ap.add_argument("--label", default="")
    ap.add_argument("--setting", default="")
    ap.add_argument("--sessions", type=int, default=32)
    ap.add_argument("--shared-tokens", type=int, default=3000)
    ap.add_argument("--own-tokens", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--cold-files", help="drop the KV files under this folder from the page cache before the turns")
    ap.add_argument("--out")
    ap.add_argument("--report")
    args = ap.parse_args()
    if args.report:
        return report(args.report)
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
