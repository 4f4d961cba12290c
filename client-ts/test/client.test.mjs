// The client against a real server (SmolLM2-135M, greedy): streaming, cancel,
// typed errors, and resume after a dropped socket.
import { after, before, test } from 'node:test';
import assert from 'node:assert/strict';
import { WebSocket as NodeWebSocket } from 'ws';
import { connect, GenerationStream, isTetherError, Session, TetherError } from '@tether/client';
import { dropConnection } from '@tether/client/testing';
import { AUTH_TOKEN, FIM_URL, WS_URL, open, reference, sleep, violations } from './helpers.mjs';

const HAIKU = { messages: [{ role: 'user', content: 'Write a haiku about the sea.' }], max_tokens: 40 };
// A raw continuation that counts on: never stops before max_tokens.
const COUNT = { prompt: '1, 2, 3, 4, 5,', max_tokens: 48 };

let session;
before(async () => {
  session = await open();
});
after(async () => {
  await session?.close();
});

/** Every delta of `stream`, in order, and its result. */
async function drain(stream, onDelta = () => {}) {
  const deltas = [];
  for await (const d of stream) {
    deltas.push(d);
    onDelta(d, deltas.length);
  }
  return { deltas, result: await stream.result };
}

function assertContiguous(deltas, result) {
  assert.deepEqual(
    deltas.map((d) => d.seq),
    deltas.map((_, i) => i + 1),
    'seq runs 1, 2, 3, ... with no gap or repeat',
  );
  assert.equal(deltas.map((d) => d.text).join(''), result.text);
  assert.deepEqual(deltas.flatMap((d) => d.token_ids), result.tokenIds);
  assert.equal(result.done.seq, deltas.length + 1);
  assert.equal(result.usage.completion_tokens, result.tokenIds.length);
}

test('connect opens a session and reports the model and limits', () => {
  assert.equal(session.state, 'open');
  assert.match(session.id, /^s_/);
  assert.equal(session.model.name, 'smollm2-135m');
  assert.equal(session.model.fim, false);
  assert.ok(session.limits.max_in_flight >= 1);
});

test('a request with tools returns the calls, held to their schemas', async () => {
  const weather = {
    name: 'get_weather',
    description: 'The current weather in a city',
    parameters: { type: 'object', properties: { city: { type: 'string', maxLength: 32 } }, required: ['city'], additionalProperties: false },
  };
  const stream = session.generate({
    messages: [{ role: 'user', content: 'What is the weather in Paris?' }],
    tools: [weather],
    tool_choice: { type: 'function', name: 'get_weather' },
    max_tokens: 64,
  });
  const { deltas, result } = await drain(stream);
  assertContiguous(deltas, result);
  assert.equal(result.finishReason, 'tool_calls');
  assert.equal(result.toolCalls.length, 1);
  const [call] = result.toolCalls;
  assert.equal(call.name, 'get_weather');
  assert.deepEqual(Object.keys(JSON.parse(call.arguments)), ['city']);
  // The call's result goes back in the next turn.
  const answer = await session.generate({
    messages: [
      { role: 'user', content: 'What is the weather in Paris?' },
      { role: 'assistant', content: '', tool_calls: result.toolCalls },
      { role: 'tool', tool_call_id: call.id, content: 'Sunny, 24 C' },
    ],
    tools: [weather],
    tool_choice: 'none',
    max_tokens: 16,
  }).result;
  assert.deepEqual(answer.toolCalls, []);
  assert.ok(answer.usage.cached_tokens > 0, 'the next turn continues from the cache');
});

let haiku;
test('generate streams deltas that add up to the result', async () => {
  const stream = session.generate(HAIKU);
  assert.ok(stream instanceof GenerationStream);
  const { deltas, result } = await drain(stream);
  assert.ok(deltas.length > 3, `${deltas.length} deltas`);
  assertContiguous(deltas, result);
  assert.ok(result.text.trim().length > 0);
  assert.ok(['stop', 'length'].includes(result.finishReason));
  assert.equal(result.requestId, stream.requestId);
  assert.equal(result.usage.cached_tokens, 0);
  assert.ok(result.timing.ttft_ms <= result.timing.total_ms);
  assert.equal(result.resumes, 0);
  haiku = result;
});

test('greedy output is the same in another session; a repeat in the same session reads the prefix cache', async () => {
  const again = await reference(HAIKU);
  assert.deepEqual(again.tokenIds, haiku.tokenIds);
  assert.equal(again.text, haiku.text);
  const repeat = await session.generate(HAIKU).result;
  assert.ok(repeat.usage.cached_tokens > 0, `cached_tokens ${repeat.usage.cached_tokens}`);
});

test('deltas are buffered: iterating after the result loses nothing', async () => {
  const stream = session.generate({ prompt: 'The sea is', max_tokens: 6 });
  const result = await stream.result;
  const deltas = [];
  for await (const d of stream) deltas.push(d);
  assertContiguous(deltas, result);
  assert.throws(() => stream[Symbol.asyncIterator](), TypeError, 'a stream is iterated once');
});

test('several requests stream at once', async () => {
  const a = session.generate({ prompt: 'Roses are red,', max_tokens: 12 });
  const b = session.generate({ messages: [{ role: 'user', content: 'Name a color.' }], max_tokens: 12 });
  assert.notEqual(a.requestId, b.requestId);
  const [ra, rb] = await Promise.all([drain(a), drain(b)]);
  assertContiguous(ra.deltas, ra.result);
  assertContiguous(rb.deltas, rb.result);
});

test('aborting cancels mid-stream and the server reports cancelled', { timeout: 60_000 }, async () => {
  const ac = new AbortController();
  const stream = session.generate({ prompt: 'Once upon a time', max_tokens: 400 }, { signal: ac.signal });
  const { deltas, result } = await drain(stream, (_, n) => {
    if (n === 3) ac.abort();
  });
  // Ended by the abort, long before its 400 tokens. How many tokens ran
  // between the abort and the server's cancel depends on the machine's load
  // (two busy cores), so neither a time nor a tight count is asserted; the
  // test's timeout only catches a hang.
  assert.equal(result.finishReason, 'cancelled');
  assert.ok(result.usage.completion_tokens < 200, `${result.usage.completion_tokens} tokens`);
  assertContiguous(deltas, result);
});

test('a signal aborted before the request is sent rejects with its reason', async () => {
  const ac = new AbortController();
  ac.abort();
  const stream = session.generate({ prompt: 'x', max_tokens: 4 }, { signal: ac.signal });
  await assert.rejects(stream.result, { name: 'AbortError' });
  const reason = new Error('changed my mind');
  const ac2 = new AbortController();
  ac2.abort(reason);
  await assert.rejects(session.generate({ prompt: 'x' }, { signal: ac2.signal }).result, reason);
});

test('leaving the loop early cancels the request', async () => {
  const stream = session.generate({ prompt: 'Once upon a time', max_tokens: 400 });
  let n = 0;
  for await (const _ of stream) if (++n === 2) break;
  const result = await stream.result;
  assert.equal(result.finishReason, 'cancelled');
});

test('server errors are TetherErrors carrying the protocol code', async () => {
  const checked = violations.length;
  const bad = session.generate({ prompt: 'x', max_tokens: 4, top_p: 0 });
  const err = await bad.result.catch((e) => e);
  assert.ok(err instanceof TetherError);
  assert.equal(err.code, 'invalid_parameter');
  assert.equal(err.requestId, bad.requestId);
  assert.ok(err.fromServer && !err.fatal);
  assert.match(err.message, /top_p/);
  await assert.rejects(async () => {
    for await (const _ of bad);
  }, err, 'the iterator throws the same error');

  await assert.rejects(session.fim({ prefix: 'def f(', suffix: ')' }).result, (e) => isTetherError(e, 'fim_unsupported'));
  await assert.rejects(session.generate({ prompt: 'x', bogus: 1 }).result, (e) => isTetherError(e, 'invalid_field'));
  await assert.rejects(session.generate({ prompt: 'x', temperature: 3 }).result, (e) => isTetherError(e, 'invalid_parameter'));

  const first = session.generate({ request_id: 'same-id', prompt: 'Once upon a time', max_tokens: 8 });
  const second = session.generate({ request_id: 'same-id', prompt: 'x' });
  await assert.rejects(second.result, (e) => isTetherError(e, 'duplicate_request'));
  assert.equal((await first.result).requestId, 'same-id');

  // The schema check flags exactly the three invalid frames sent on purpose.
  assert.deepEqual(
    violations.splice(checked).map((v) => `${v.direction} ${v.type}: ${v.problems.join('; ')}`),
    [
      'out generate: /top_p must be > 0',
      'out generate: / must NOT have additional properties: bogus',
      'out generate: /temperature must be <= 2',
    ],
  );
  assert.equal(session.state, 'open', 'errors leave the session usable');
  assert.ok((await session.ping()) >= 0);
});

test('a stream survives a dropped socket with no token lost or duplicated', async () => {
  const expected = await reference(HAIKU);
  const s = await open();
  const states = [];
  s.on('state', (st) => states.push(st));
  const { deltas, result } = await drain(s.generate(HAIKU), (_, n) => {
    if (n === 4) {
      dropConnection(s);
      assert.equal(s.state, 'reconnecting');
    }
  });
  assertContiguous(deltas, result);
  assert.deepEqual(result.tokenIds, expected.tokenIds);
  assert.equal(result.text, expected.text);
  assert.equal(result.resumes, 1);
  assert.equal(s.reconnects, 1);
  assert.deepEqual(states, ['reconnecting', 'open']);
  await s.close();
});

test('longer outages, twice in one stream: frames missed meanwhile are replayed', async () => {
  // Long enough that the server, which keeps generating through both
  // outages (about half a second each), cannot finish before the second
  // drop: 160 tokens is over a second more than two outages at 100 tok/s.
  const long = { ...COUNT, max_tokens: 160 };
  const expected = await reference(long);
  const s = await open({ reconnect: { initialDelayMs: 500 } });
  let reopened = false;
  s.on('state', (st) => {
    if (st === 'open') reopened = true;
  });
  let drops = 0;
  const stream = s.generate(long);
  const { deltas, result } = await drain(stream, (_, n) => {
    // The second drop comes with the first frame after the first resume,
    // so it cuts the replay of what was missed, not a finished stream.
    if ((drops === 0 && n === 3) || (drops === 1 && reopened)) {
      drops++;
      dropConnection(s);
    }
  });
  assertContiguous(deltas, result);
  assert.deepEqual(result.tokenIds, expected.tokenIds);
  assert.equal(result.finishReason, 'length');
  assert.equal(drops, 2);
  assert.equal(result.resumes, 2);
  await s.close();
});

test('a request made while the socket is down is sent after the resume', async () => {
  const input = { prompt: 'The capital of France is', max_tokens: 8 };
  const expected = await reference(input);
  const s = await open({ reconnect: { initialDelayMs: 300 } });
  dropConnection(s);
  assert.equal(s.state, 'reconnecting');
  const result = await s.generate(input).result;
  assert.deepEqual(result.tokenIds, expected.tokenIds);
  assert.equal(s.state, 'open');
  await s.close();
});

test('a request lost on its way to the server is sent again under a new id', async () => {
  const quick = { prompt: 'The capital of France is', max_tokens: 8 };
  const expected = await reference(quick);
  // A socket that loses the next generate frame, as a connection dying under it would.
  let lose = false;
  class LossySocket extends NodeWebSocket {
    send(data) {
      if (lose && JSON.parse(data).type === 'generate') lose = false;
      else super.send(data);
    }
  }
  const s = await open({ WebSocket: LossySocket });
  lose = true;
  const stream = s.generate(quick);
  const firstId = stream.requestId;
  dropConnection(s);
  const result = await stream.result;
  assert.deepEqual(result.tokenIds, expected.tokenIds);
  assert.notEqual(result.requestId, firstId, 'resubmitted after replay_unavailable');
  assert.equal(stream.requestId, result.requestId);
  await s.close();
});

test('if the session expired meanwhile: every request goes on in a new session, those with output where they stopped', async () => {
  const quick = { prompt: 'The capital of France is', max_tokens: 8 };
  const chat = { messages: [{ role: 'user', content: 'Count from 1 to 20.' }], max_tokens: 40 };
  const [expectedCount, expectedQuick, expectedChat] = [await reference(COUNT), await reference(quick), await reference(chat)];
  // The server keeps a detached session for 2 s (scripts/run-tests.mjs); stay away longer.
  const s = await open({ reconnect: { initialDelayMs: 3200 } });
  const firstId = s.id;
  const errors = [];
  s.on('error', (e) => errors.push(e.code));
  let second;
  let third;
  const chatting = s.generate(chat);
  const first = drain(s.generate(COUNT), (_, n) => {
    if (n === 2) {
      second = s.generate(quick); // sent, but nothing of it arrives before the drop
      dropConnection(s);
    }
  });
  // A prompt continues from its output so far; a chat conversation runs
  // again whole and the part already delivered is not delivered twice.
  const { result } = await first;
  assert.equal(result.text, expectedCount.text);
  assert.equal(result.usage.completion_tokens, COUNT.max_tokens);
  assert.equal((await second.result).text, expectedQuick.text);
  assert.equal((await chatting.result).text, expectedChat.text);
  assert.ok(chatting.resumes + result.resumes >= 1);
  assert.notEqual(s.id, firstId, 'a new session');
  assert.equal(s.state, 'open');
  assert.equal(errors.length, 1);
  assert.ok(errors[0] === 'session_expired' || errors[0] === 'session_not_found', errors[0]);
  third = await s.generate(quick).result;
  assert.equal(third.text, expectedQuick.text);
  await s.close();
});

test('dropping the socket is a test helper (@tether/client/testing), not Session API', async () => {
  assert.equal(typeof dropConnection, 'function');
  assert.ok(!('dropConnectionForTesting' in Session.prototype));
  const api = await import('@tether/client');
  assert.ok(!('dropConnection' in api) && !('dropSessionSocket' in api));
  const s = await open({ reconnect: false });
  await s.close();
  dropConnection(s); // only an open session has a socket to drop
  assert.equal(s.state, 'closed');
});

test('without reconnect, a dropped socket fails pending streams with connection_lost', async () => {
  const s = await open({ reconnect: false });
  const stream = s.generate(COUNT);
  const iterated = drain(stream, (_, n) => n === 2 && dropConnection(s));
  await assert.rejects(iterated, (e) => isTetherError(e, 'connection_lost'));
  await assert.rejects(stream.result, (e) => isTetherError(e, 'connection_lost'));
  assert.equal(s.state, 'closed');
});

test('close() ends the session; later requests fail with session_closed', async () => {
  const s = await open();
  const running = s.generate({ prompt: 'Once upon a time', max_tokens: 400 });
  await s.close();
  assert.equal(s.state, 'closed');
  await assert.rejects(running.result, (e) => isTetherError(e, 'session_closed'));
  await assert.rejects(s.generate({ prompt: 'x' }).result, (e) => isTetherError(e, 'session_closed'));
  await assert.rejects(s.ping(), (e) => isTetherError(e, 'session_closed'));
  await s.close(); // idempotent
});

test('connection failures are typed', async () => {
  await assert.rejects(connect({ url: 'ws://127.0.0.1:1/v1/ws' }), (e) => isTetherError(e, 'connection_failed'));
  await assert.rejects(connect({ url: 'ftp://example.invalid/' }), (e) => isTetherError(e, 'connection_failed'));
});

test('bearer token: refused without it (unauthorized), accepted with it', async () => {
  await assert.rejects(connect({ url: FIM_URL }), (e) => isTetherError(e, 'unauthorized'));
  await assert.rejects(connect({ url: FIM_URL, token: 'wrong' }), (e) => isTetherError(e, 'unauthorized'));
  const s = await open({ url: FIM_URL, token: AUTH_TOKEN });
  assert.equal(s.model.fim, true);
  await s.close();
  // A token a subprotocol entry cannot carry goes in `?token=` instead (refused here: it is not the server's).
  await assert.rejects(connect({ url: FIM_URL, token: 'has space' }), (e) => isTetherError(e, 'unauthorized'));
});

test('every frame sent and received matched the protocol schema', () => {
  assert.deepEqual(violations.slice(0, 3), []);
});
