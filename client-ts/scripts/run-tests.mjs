#!/usr/bin/env node
// Runs the client's tests against real servers: starts `tether serve` twice on
// free ports (SmolLM2-135M with the playground as --ui-dir and a 2 s session
// TTL; Qwen2.5-Coder-0.5B with an auth token, for FIM and auth), waits for
// /healthz, runs node's test runner over test/*.test.mjs one file at a time,
// and stops the servers.
//
// Env: TETHER_BIN (default: $CARGO_TARGET_DIR or ../target, then release/tether);
// TETHER_TEST_FILTER: a substring of the test files to run.
import { spawn } from 'node:child_process';
import { createWriteStream, existsSync, mkdtempSync, readdirSync, readFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';

const root = join(dirname(fileURLToPath(import.meta.url)), '..');
const repo = join(root, '..');
const bin =
  process.env.TETHER_BIN ?? join(resolve(repo, process.env.CARGO_TARGET_DIR ?? 'target'), 'release/tether');
if (!existsSync(bin)) {
  console.error(`tether binary not found at ${bin}: run \`cargo build --release -p tether\` (or set TETHER_BIN)`);
  process.exit(1);
}
const logs = mkdtempSync(join(tmpdir(), 'tether-client-test-'));
const AUTH_TOKEN = 'client-test-token';

function start(name, args) {
  const log = join(logs, `${name}.log`);
  const out = createWriteStream(log);
  const child = spawn(bin, ['serve', '--port', '0', ...args], { stdio: ['ignore', 'pipe', 'pipe'] });
  child.stderr.pipe(out);
  const url = new Promise((resolve, reject) => {
    let buf = '';
    child.stdout.on('data', (chunk) => {
      out.write(chunk);
      buf += chunk;
      const m = /listening on (http:\/\/\S+)/.exec(buf);
      if (m) resolve(m[1]);
    });
    child.on('exit', (code) => reject(new Error(`${name} server exited (${code}) before listening; see ${log}`)));
  });
  return { name, child, log, url };
}

async function healthy(url, deadline) {
  for (;;) {
    try {
      const r = await fetch(`${url}/healthz`);
      if (r.ok) return;
    } catch {
      // not yet
    }
    if (Date.now() > deadline) throw new Error(`${url}/healthz not ready in time`);
    await new Promise((r) => setTimeout(r, 100));
  }
}

async function stop(server) {
  if (server.child.exitCode !== null) return;
  const exited = new Promise((r) => server.child.once('exit', r));
  server.child.kill('SIGTERM');
  const timer = setTimeout(() => server.child.kill('SIGKILL'), 10_000);
  await exited;
  clearTimeout(timer);
}

const servers = [
  // A short session TTL, so a test can outlast it (the other outages are well under it).
  start('smollm2', ['--model', 'smollm2-135m', '--session-ttl-secs', '2', '--ui-dir', join(root, 'dist/playground')]),
  start('qwen-fim', ['--model', 'qwen2.5-coder-0.5b', '--auth-token', AUTH_TOKEN]),
];
let code = 1;
try {
  const [url, fimUrl] = await Promise.all(servers.map((s) => s.url));
  const deadline = Date.now() + 60_000;
  await Promise.all([healthy(url, deadline), healthy(fimUrl, deadline)]);
  console.log(`servers: ${url} (smollm2-135m, playground), ${fimUrl} (qwen2.5-coder-0.5b, auth); logs in ${logs}`);
  const filter = process.env.TETHER_TEST_FILTER ?? '';
  const files = readdirSync(join(root, 'test'))
    .filter((f) => f.endsWith('.test.mjs') && f.includes(filter))
    .sort()
    .map((f) => join('test', f));
  const env = { ...process.env, TETHER_URL: url, TETHER_FIM_URL: fimUrl, TETHER_AUTH_TOKEN: AUTH_TOKEN };
  const runner = spawn(process.execPath, ['--test', '--test-concurrency=1', ...files], { cwd: root, env, stdio: 'inherit' });
  code = await new Promise((r) => runner.on('exit', (c, sig) => r(c ?? (sig ? 1 : 0))));
} catch (e) {
  console.error(String(e));
} finally {
  await Promise.all(servers.map(stop));
}
if (code !== 0) {
  for (const s of servers) {
    const text = existsSync(s.log) ? readFileSync(s.log, 'utf8') : '';
    console.error(`--- ${s.name} server log (last lines) ---\n${text.split('\n').slice(-15).join('\n')}`);
  }
}
process.exit(code);
