// Tether's OpenAI-compatible HTTP edge through the official `openai` npm
// package (pinned in package.json), against the real servers
// scripts/run-tests.mjs started: chat whole and streamed, the cache across a
// conversation's turns, completions with `suffix` on the FIM model (which
// wants a bearer token), and the SDK's error classes.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import OpenAI from 'openai';
import { AUTH_TOKEN, FIM_URL, URL_ } from './helpers.mjs';

const MODEL = 'smollm2-135m';
const QUESTION = [{ role: 'user', content: 'Name three colours of the rainbow.' }];
const client = (url = URL_, apiKey = 'sk-npm-tests') => new OpenAI({ baseURL: `${url}/v1`, apiKey, maxRetries: 0, timeout: 120_000 });

test('chat completions whole and streamed give the same greedy text', async () => {
  const c = client();
  const whole = await c.chat.completions.create({ model: MODEL, messages: QUESTION, max_tokens: 24, temperature: 0 });
  const text = whole.choices[0].message.content;
  assert.ok(text.length > 0);
  const stream = await c.chat.completions.create({
    model: MODEL, messages: QUESTION, max_tokens: 24, temperature: 0, stream: true, stream_options: { include_usage: true },
  });
  let streamed = '';
  let usage = null;
  for await (const chunk of stream) {
    if (chunk.choices.length > 0) streamed += chunk.choices[0].delta.content ?? '';
    if (chunk.usage) usage = chunk.usage;
  }
  assert.equal(streamed, text);
  assert.equal(usage.completion_tokens, whole.usage.completion_tokens);
});

test("a conversation's second turn reads its first from the cache", async () => {
  const c = client(URL_, 'sk-npm-cache-tenant');
  const first = await c.chat.completions.create({ model: MODEL, messages: QUESTION, max_tokens: 12, temperature: 0 });
  const history = [...QUESTION, { role: 'assistant', content: first.choices[0].message.content }, { role: 'user', content: 'And two more?' }];
  const second = await c.chat.completions.create({ model: MODEL, messages: history, max_tokens: 4, temperature: 0 });
  assert.ok(second.usage.prompt_tokens_details.cached_tokens >= 32, JSON.stringify(second.usage));
});

test('completions fill in the middle on the FIM model, with its bearer token', async () => {
  const c = client(FIM_URL, AUTH_TOKEN);
  const r = await c.completions.create({
    model: 'qwen2.5-coder-0.5b', prompt: 'def is_even(n):\n    return ', suffix: '\n\nprint(is_even(4))\n', max_tokens: 16, temperature: 0, stop: ['\n'],
  });
  assert.match(r.choices[0].text, /n % 2/);
  await assert.rejects(client(FIM_URL, 'sk-wrong').models.list(), (e) => e instanceof OpenAI.AuthenticationError && e.code === 'invalid_api_key');
});

test('errors arrive as the SDK error classes', async () => {
  const c = client();
  await assert.rejects(c.chat.completions.create({ model: 'gpt-nope', messages: QUESTION }), (e) => e instanceof OpenAI.NotFoundError && e.code === 'model_not_found');
  await assert.rejects(c.chat.completions.create({ model: MODEL, messages: QUESTION, temperature: 9 }), (e) => e instanceof OpenAI.BadRequestError && e.status === 400);
  const models = await c.models.list();
  assert.deepEqual(models.data.map((m) => m.id), [MODEL]);
});

// The Responses API's WebSocket mode through the SDK's own socket client.
test('responses over the WebSocket mode: two chained turns on the socket state', async () => {
  const { ResponsesWS } = await import('openai/resources/responses/ws');
  const ws = new ResponsesWS(client(URL_, 'sk-npm-responses'));
  const events = ws.stream();
  const finish = async () => {
    for (;;) {
      const { value, done } = await events.next();
      assert.ok(!done, 'the socket closed before the response ended');
      if (value.type !== 'message') continue;
      const ev = value.message;
      assert.notEqual(ev.type, 'error', JSON.stringify(ev));
      if (ev.type === 'response.completed' || ev.type === 'response.incomplete') return ev.response;
    }
  };
  try {
    ws.send({ type: 'response.create', model: MODEL, input: 'Name three colours of the rainbow.', max_output_tokens: 10, temperature: 0, store: false });
    const first = await finish();
    assert.ok(first.output[0].content[0].text.length > 0);
    ws.send({ type: 'response.create', input: 'And two more?', previous_response_id: first.id, max_output_tokens: 4, temperature: 0, store: false });
    const second = await finish();
    assert.equal(second.previous_response_id, first.id);
    assert.ok(second.usage.input_tokens_details.cached_tokens >= 16, JSON.stringify(second.usage));
  } finally {
    ws.close();
  }
});

test('responses over HTTP, whole', async () => {
  const r = await client().responses.create({ model: MODEL, input: 'Say hello.', max_output_tokens: 6, temperature: 0 });
  assert.ok(r.output_text.length > 0);
  assert.equal(r.usage.output_tokens <= 6, true);
});
