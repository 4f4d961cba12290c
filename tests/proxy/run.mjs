#!/usr/bin/env node
// Session affinity across replicas on a real proxy: three `tether serve`
// replicas on loopback behind HAProxy (Debian's package, with the config
// file docker/compose.yaml uses: docker/haproxy.cfg), driven by the real
// TypeScript client (client-ts/dist, built first). Checks:
//   1. 100 sessions x 3 chat turns: every turn from the second on lands on its
//      session's replica (its prefix cache answers: cached_tokens > 0), and
//      the sessions spread over all three replicas; HTTP conversations keyed
//      by bearer token or X-Tether-Affinity likewise; no health check failed;
//   2. every socket dropped mid-stream: each session resumes through the
//      proxy on its own replica, no token lost or repeated;
//   3. one replica killed mid-stream: its sessions go on elsewhere through the
//      client (new sessions, the full expected text), the others' streams
//      are untouched;
//   4. a rolling restart (SIGTERM, restart, one replica at a time) while
//      streams run: no request lost;
// then prints the proxy's added latency per connection and per token.
//
// Env: TETHER_BIN (default ../../target/release/tether), HAPROXY (default
// `haproxy` on PATH: scripts/setup-proxy.sh installs it).
import { spawn } from 'node:child_process';
import { createServer } from 'node:net';
import { createWriteStream, existsSync, mkdtempSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import assert from 'node:assert/strict';

const here = dirname(fileURLToPath(import.meta.url));
const repo = resolve(here, '../..');
const { connect } = await import(join(repo, 'client-ts/dist/index.js'));
const { dropConnection } = await import(join(repo, 'client-ts/dist/testing.js'));
const bin = process.env.TETHER_BIN ?? join(repo, process.env.CARGO_TARGET_DIR ?? 'target', 'release/tether');
const haproxyBin = process.env.HAPROXY ?? 'haproxy';
assert.ok(existsSync(bin), `tether binary not found at ${bin}`);
const logs = mkdtempSync(join(tmpdir(), 'tether-proxy-test-'));
const MODEL = 'smollm2-135m';
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
const log = (...a) => console.log('[proxy-test]', ...a);

async function freePort() {
  return new Promise((res, rej) => {
    const s = createServer();
    s.listen(0, '127.0.0.1', () => {
      const { port } = s.address();
      s.close(() => res(port));
    });
    s.on('error', rej);
  });
}

function run(name, cmd, args, env = {}) {
  const out = createWriteStream(join(logs, `${name}.log`), { flags: 'a' });
  const child = spawn(cmd, args, { stdio: ['ignore', 'pipe', 'pipe'], env: { ...process.env, ...env } });
  child.stdout.pipe(out);
  child.stderr.pipe(out);
  return child;
}

async function healthy(url, timeoutMs = 120_000) {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    try {
      const r = await fetch(`${url}/healthz`);
      if (r.ok) return r.json();
    } catch {
      // not yet
    }
    assert.ok(Date.now() < deadline, `${url} not healthy in time (logs: ${logs})`);
    await sleep(100);
  }
}

const replicas = [];
function startReplica(i) {
  const r = replicas[i];
  // A long TTL: sessions must outlive the drop-and-resume checks.
  r.child = run(`replica-${i + 1}`, bin, ['serve', '--model', MODEL, '--device', 'cpu', '--host', '127.0.0.1', '--port', String(r.port),
    '--session-ttl-secs', '120', '--max-sessions', '512', '--drain-timeout-secs', '30']);
  r.exited = new Promise((res) => r.child.once('exit', res));
  return healthy(r.url);
}

async function stopReplica(i, signal) {
  const r = replicas[i];
  r.child.kill(signal);
  await r.exited;
}

/** The replica's session count (/healthz). */
async function sessionsOn(i) {
  return (await (await fetch(`${replicas[i].url}/healthz`)).json()).sessions;
}

/** Opens `n` sessions through the proxy one by one, learning each one's replica from the session counts. */
async function openPlaced(n, options) {
  const sessions = [];
  const places = [];
  for (let k = 0; k < n; k++) {
    const before = await Promise.all([0, 1, 2].map(sessionsOn));
    sessions.push(await connect(options));
    const after = await Promise.all([0, 1, 2].map(sessionsOn));
    places.push(after.findIndex((c, i) => c > before[i]));
  }
  return { sessions, places };
}

/** Waits until HAProxy's health checks mark replica `i` up (true) or down (false). */
async function proxySees(i, up, statsUrl) {
  for (let t = 0; t < 300; t++) {
    try {
      const csv = await (await fetch(statsUrl)).text();
      const line = csv.split('\n').find((l) => l.startsWith(`replicas,r${i + 1},`));
      if (line && (line.split(',')[17] === 'UP') === up) return;
    } catch {
      // HAProxy is still starting
    }
    await sleep(100);
  }
  throw new Error(`HAProxy did not see replica ${i + 1} ${up ? 'up' : 'down'}`);
}

const QUESTIONS = ['What is the capital of France?', 'Name a prime number.', 'What colour is the sky?', 'Say hello.'];
const COUNT = { prompt: '1, 2, 3, 4, 5,', max_tokens: 40 };

async function main() {
  for (let i = 0; i < 3; i++) {
    const port = await freePort();
    replicas.push({ port, url: `http://127.0.0.1:${port}` });
  }
  const proxyPort = await freePort();
  const statsPort = await freePort();
  await Promise.all(replicas.map((_, i) => startReplica(i)));
  // The stats page is the test's own addition (a second config file), so
  // the shipped config stays the one compose runs.
  const statsCfg = join(logs, 'stats.cfg');
  const { writeFileSync } = await import('node:fs');
  writeFileSync(statsCfg, `frontend stats\n    mode http\n    bind 127.0.0.1:${statsPort}\n    stats enable\n    stats uri /stats\n`);
  const env = { TETHER_PROXY_BIND: `127.0.0.1:${proxyPort}` };
  replicas.forEach((r, i) => (env[`TETHER_REPLICA_${i + 1}`] = `127.0.0.1:${r.port}`));
  const proxy = run('haproxy', haproxyBin, ['-db', '-f', join(repo, 'docker/haproxy.cfg'), '-f', statsCfg], env);
  const statsUrl = `http://127.0.0.1:${statsPort}/stats;csv`;
  const proxyUrl = `ws://127.0.0.1:${proxyPort}/v1/ws`;
  for (let i = 0; i < 3; i++) await proxySees(i, true, statsUrl);
  log(`3 replicas on ${replicas.map((r) => r.port).join(', ')}, HAProxy on ${proxyPort}; logs in ${logs}`);
  try {
    await affinity(proxyUrl, statsUrl);
    await dropEverySocket(proxyUrl);
    await killOne(proxyUrl, statsUrl);
    await rollingRestart(proxyUrl, statsUrl);
    await latency(proxyUrl);
  } finally {
    proxy.kill('SIGTERM');
    for (const r of replicas) if (r.child.exitCode === null) r.child.kill('SIGKILL');
  }
  log('all checks passed');
}

/** The greedy result of `input` on a fresh session straight to replica 0. */
async function reference(input) {
  const s = await connect({ url: `${replicas[0].url}/v1/ws` });
  try {
    return await s.generate(input).result;
  } finally {
    await s.close();
  }
}

async function affinity(url, statsUrl) {
  const before = await Promise.all([0, 1, 2].map(sessionsOn));
  const started = Date.now();
  let uncached = 0;
  async function conversation(k) {
    const s = await connect({ url });
    try {
      const messages = [{ role: 'system', content: `You are assistant number ${k}. Answer in a few words.` }];
      for (let turn = 0; turn < 3; turn++) {
        messages.push({ role: 'user', content: QUESTIONS[(k + turn) % QUESTIONS.length] });
        const r = await s.generate({ messages, max_tokens: 6 }).result;
        if (turn > 0 && r.usage.cached_tokens === 0) uncached++;
        messages.push({ role: 'assistant', content: r.text });
      }
      return s;
    } catch (e) {
      await s.close();
      throw e;
    }
  }
  const sessions = [];
  for (let batch = 0; batch < 100; batch += 25) {
    sessions.push(...(await Promise.all(Array.from({ length: 25 }, (_, j) => conversation(batch + j)))));
  }
  const after = await Promise.all([0, 1, 2].map(sessionsOn));
  const spread = after.map((n, i) => n - before[i]);
  await Promise.all(sessions.map((s) => s.close()));
  log(`1. 100 sessions x 3 turns in ${((Date.now() - started) / 1e3).toFixed(1)} s: sessions per replica ${spread.join(' / ')}, later turns without a cache hit: ${uncached}`);
  assert.equal(uncached, 0, 'every later turn hits its own replica\'s cache');
  assert.ok(spread.every((n) => n > 0), `sessions spread over all replicas: ${spread}`);
  await httpAffinity(url.replace('ws://', 'http://').replace('/v1/ws', ''));
  // Under this load no health check failed: a busy replica is not taken out
  // (which would move its keys and lose their caches).
  const csv = await (await fetch(statsUrl)).text();
  const head = csv.split('\n')[0].replace('# ', '').split(',');
  for (const line of csv.split('\n').filter((l) => l.startsWith('replicas,r'))) {
    const f = line.split(',');
    assert.equal(f[head.indexOf('chkdown')], '0', `a replica was marked down under load: ${line}`);
  }
}

/** The HTTP edges have no session: a key's requests (bearer token, or X-Tether-Affinity) stay on one replica. */
async function httpAffinity(base) {
  let hits = 0;
  const conversation = async (k, headers) => {
    const messages = [{ role: 'user', content: `Tenant ${k}: ${QUESTIONS[k % QUESTIONS.length]}` }];
    for (let turn = 0; turn < 2; turn++) {
      const r = await fetch(`${base}/v1/chat/completions`, {
        method: 'POST',
        headers: { 'content-type': 'application/json', ...headers },
        body: JSON.stringify({ model: MODEL, messages, max_tokens: 6, temperature: 0 }),
      });
      const body = await r.json();
      assert.equal(r.status, 200, JSON.stringify(body));
      if (turn === 1 && body.usage.prompt_tokens_details.cached_tokens > 0) hits++;
      messages.push(body.choices[0].message, { role: 'user', content: 'And then?' });
    }
  };
  await Promise.all(Array.from({ length: 12 }, (_, k) =>
    conversation(k, k % 2 ? { authorization: `Bearer sk-tenant-${k}` } : { 'x-tether-affinity': `conv-${k}`, authorization: 'Bearer shared' })));
  log(`   HTTP: 12 conversations (by bearer token or X-Tether-Affinity), second turns from the cache: ${hits} of 12`);
  assert.equal(hits, 12);
}

async function dropEverySocket(url) {
  const expected = await reference(COUNT);
  const sessions = await Promise.all(Array.from({ length: 12 }, () => connect({ url })));
  const ids = sessions.map((s) => s.id);
  const results = await Promise.all(
    sessions.map(async (s) => {
      const stream = s.generate(COUNT);
      let n = 0;
      for await (const _ of stream) if (++n === 3) dropConnection(s);
      return stream.result;
    }),
  );
  for (const [i, r] of results.entries()) {
    assert.equal(r.text, expected.text, `session ${i}: no token lost or repeated`);
    assert.equal(r.resumes, 1, `session ${i} resumed once`);
    assert.equal(sessions[i].id, ids[i], `session ${i} resumed on its own replica (same session)`);
  }
  await Promise.all(sessions.map((s) => s.close()));
  log('2. 12 sockets dropped mid-stream: every session resumed on its own replica with the exact text');
}

async function killOne(url, statsUrl) {
  const expected = await reference(COUNT);
  const chat = { messages: [{ role: 'user', content: 'Count from 1 to 20.' }], max_tokens: 30 };
  const expectedChat = await reference(chat);
  const { sessions, places } = await openPlaced(12, { url, reconnect: { initialDelayMs: 200 } });
  // The replica holding the most of them is killed; the others must not notice.
  const victim = [0, 1, 2].reduce((a, b) => (places.filter((p) => p === b).length > places.filter((p) => p === a).length ? b : a));
  const ids = sessions.map((s) => s.id);
  const errors = sessions.map(() => []);
  sessions.forEach((s, i) => s.on('error', (e) => errors[i].push(e.code)));
  let killed = false;
  const results = await Promise.all(
    sessions.map(async (s, i) => {
      const input = i % 2 ? chat : COUNT;
      const stream = s.generate(input);
      let n = 0;
      for await (const _ of stream) {
        if (++n === 3 && !killed) {
          killed = true;
          stopReplica(victim, 'SIGKILL');
        }
      }
      return { r: await stream.result, input };
    }),
  );
  let moved = 0;
  for (const [i, { r, input }] of results.entries()) {
    assert.equal(r.text, (input === chat ? expectedChat : expected).text, `session ${i}: the full expected text`);
    if (places[i] === victim) {
      moved++;
      assert.notEqual(sessions[i].id, ids[i], `session ${i} went on in a new session`);
      assert.ok(errors[i].every((c) => c === 'session_not_found'), `session ${i}: ${errors[i]}`);
    } else {
      assert.equal(sessions[i].id, ids[i], `session ${i} on a surviving replica kept its session`);
      assert.deepEqual(errors[i], [], `session ${i} on a surviving replica saw no error`);
      assert.equal(r.resumes, 0, `session ${i} on a surviving replica was untouched`);
    }
  }
  assert.ok(moved > 0, 'the killed replica held sessions');
  await Promise.all(sessions.map((s) => s.close()));
  await startReplica(victim);
  await proxySees(victim, true, statsUrl);
  log(`3. replica ${victim + 1} killed mid-stream: its ${moved} of 12 sessions went on elsewhere with the full text, the other ${12 - moved} untouched`);
}

async function rollingRestart(url, statsUrl) {
  const expected = await reference(COUNT);
  const sessions = await Promise.all(Array.from({ length: 9 }, () => connect({ url, reconnect: { initialDelayMs: 200, maxAttempts: 50 } })));
  let done = 0;
  let running = true;
  const workers = sessions.map(async (s) => {
    while (running) {
      const r = await s.generate(COUNT).result;
      assert.equal(r.text, expected.text, 'a request across the restart lost nothing');
      done++;
    }
  });
  for (let i = 0; i < 3; i++) {
    await stopReplica(i, 'SIGTERM');
    await proxySees(i, false, statsUrl);
    await startReplica(i);
    await proxySees(i, true, statsUrl);
  }
  running = false;
  await Promise.all(workers);
  await Promise.all(sessions.map((s) => s.close()));
  log(`4. rolling restart of the 3 replicas under 9 streaming sessions: ${done} requests, none lost`);
}

/** The proxy's cost: session.open round trips and inter-token gaps, through it and direct. */
async function latency(proxyUrl) {
  const pct = (xs, p) => xs.sort((a, b) => a - b)[Math.floor((xs.length - 1) * p)];
  async function measure(url) {
    const opens = [];
    for (let i = 0; i < 30; i++) {
      const t = performance.now();
      const s = await connect({ url, affinity: 'latency-probe' });
      opens.push(performance.now() - t);
      await s.close();
    }
    const gaps = [];
    const s = await connect({ url, affinity: 'latency-probe' });
    for (let i = 0; i < 3; i++) {
      let last;
      for await (const _ of s.generate({ prompt: '1, 2, 3, 4, 5,', max_tokens: 48 })) {
        const now = performance.now();
        if (last !== undefined) gaps.push(now - last);
        last = now;
      }
    }
    await s.close();
    return { open: pct(opens, 0.5), gap: pct(gaps, 0.5), gap99: pct(gaps, 0.99) };
  }
  // The replica HAProxy places the probe key on, measured direct too.
  const via = await measure(proxyUrl);
  const target = replicas.find((r) => r.child.exitCode === null);
  let direct = null;
  for (const r of replicas) {
    const before = await sessionsOn(replicas.indexOf(r));
    const s = await connect({ url: proxyUrl, affinity: 'latency-probe' });
    const after = await sessionsOn(replicas.indexOf(r));
    await s.close();
    if (after > before) {
      direct = await measure(`${r.url}/v1/ws`);
      break;
    }
  }
  direct ??= await measure(`${target.url}/v1/ws`);
  log(`5. latency, median (proxy / direct): connect + session.open ${via.open.toFixed(2)} / ${direct.open.toFixed(2)} ms; ` +
    `inter-token gap ${via.gap.toFixed(2)} / ${direct.gap.toFixed(2)} ms (p99 ${via.gap99.toFixed(2)} / ${direct.gap99.toFixed(2)} ms)`);
}

main().catch((e) => {
  console.error(e);
  console.error(`[proxy-test] logs: ${logs}`);
  process.exit(1);
});
