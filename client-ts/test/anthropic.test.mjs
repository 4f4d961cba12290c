// Tether's Anthropic Messages API edge through the official `@anthropic-ai/sdk`
// npm package (pinned in package.json), against the real servers
// scripts/run-tests.mjs started: a message whole and streamed (the same greedy
// text), a named tool's call streamed as input_json_delta on the FIM model
// (which wants its key), and the SDK's error classes.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import Anthropic from '@anthropic-ai/sdk';
import { AUTH_TOKEN, FIM_URL, URL_ } from './helpers.mjs';

const MODEL = 'smollm2-135m';
const QUESTION = [{ role: 'user', content: 'Name three colours of the rainbow.' }];
const client = (url = URL_, apiKey = 'sk-npm-anthropic') => new Anthropic({ baseURL: url, apiKey, maxRetries: 0, timeout: 120_000 });
const textOf = (m) => m.content.filter((b) => b.type === 'text').map((b) => b.text).join('');

test('a message whole and streamed gives the same greedy text', async () => {
  const c = client();
  // Older clients still send temperature; the current SDK passes it through as a body field.
  const whole = await c.messages.create({ model: MODEL, max_tokens: 16, messages: QUESTION, temperature: 0 });
  assert.equal(whole.stop_reason, 'max_tokens');
  assert.ok(textOf(whole).length > 0);
  const stream = c.messages.stream({ model: MODEL, max_tokens: 16, messages: QUESTION, temperature: 0 });
  const streamed = await stream.finalMessage();
  assert.equal(textOf(streamed), textOf(whole));
  assert.equal(streamed.usage.output_tokens, 16);
  assert.ok(streamed.usage.cache_read_input_tokens > 0, JSON.stringify(streamed.usage));
  const counted = await c.messages.countTokens({ model: MODEL, messages: QUESTION });
  assert.equal(counted.input_tokens, whole.usage.input_tokens + whole.usage.cache_read_input_tokens);
});

test('a named tool is called with input that fits its schema, streamed', async () => {
  const c = client(FIM_URL, AUTH_TOKEN);
  const tools = [{ name: 'get_time', description: 'The local time in a time zone', input_schema: { type: 'object', properties: { zone: { type: 'string' } }, required: ['zone'] } }];
  const stream = c.messages.stream({
    model: 'qwen2.5-coder-0.5b', max_tokens: 60, temperature: 0, tools, tool_choice: { type: 'tool', name: 'get_time' },
    messages: [{ role: 'user', content: 'What time is it in Tokyo?' }],
  });
  const kinds = [];
  stream.on('streamEvent', (e) => kinds.push(e.type === 'content_block_delta' ? e.delta.type : e.type));
  const m = await stream.finalMessage();
  assert.equal(m.stop_reason, 'tool_use');
  const [call] = m.content.filter((b) => b.type === 'tool_use');
  assert.equal(call.name, 'get_time');
  assert.equal(typeof call.input.zone, 'string');
  assert.ok(kinds.includes('input_json_delta'), kinds.join(' '));
});

test('errors arrive as the SDK error classes', async () => {
  const c = client();
  await assert.rejects(c.messages.create({ model: 'another-model', max_tokens: 4, messages: QUESTION }), (e) => e instanceof Anthropic.NotFoundError && e.error.error.type === 'not_found_error');
  await assert.rejects(c.messages.create({ model: MODEL, max_tokens: 0, messages: QUESTION }), (e) => e instanceof Anthropic.BadRequestError && /max_tokens/.test(e.message));
  await assert.rejects(client(FIM_URL, 'sk-wrong').messages.create({ model: MODEL, max_tokens: 4, messages: QUESTION }), (e) => e instanceof Anthropic.AuthenticationError);
});
