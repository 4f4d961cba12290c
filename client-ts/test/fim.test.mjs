// Fill-in-the-middle against a model that has FIM tokens (Qwen2.5-Coder-0.5B,
// served with an auth token).
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { AUTH_TOKEN, FIM_URL, open, violations } from './helpers.mjs';

test('fim() streams the middle between prefix and suffix', async () => {
  const session = await open({ url: FIM_URL, token: AUTH_TOKEN });
  try {
    assert.equal(session.model.fim, true);
    const stream = session.fim({
      prefix: 'def add(a, b):\n    return ',
      suffix: '\n\n\nprint(add(2, 3))\n',
      extra: [{ path: 'README.md', content: 'A tiny calculator.' }],
      max_tokens: 12,
    });
    const deltas = [];
    for await (const d of stream) deltas.push(d);
    const result = await stream.result;
    assert.ok(deltas.length > 0);
    assert.equal(deltas.map((d) => d.text).join(''), result.text);
    assert.match(result.text, /a\s*\+\s*b/);
  } finally {
    await session.close();
  }
});

test('every frame matched the protocol schema', () => {
  assert.deepEqual(violations.slice(0, 3), []);
});
