// The client's message types are generated from the protocol crate's JSON
// Schema; this fails when the committed file and the schema drift apart.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { generate, OUTPUT_PATH, SCHEMA_PATH } from '../scripts/gen-types.mjs';
import { ERROR_CODES, FINISH_REASONS, PROTOCOL_VERSION } from '@tether/client';

test('src/protocol.gen.ts is what the schema generates (else run `npm run gen-types`)', async () => {
  const expected = await generate();
  const committed = readFileSync(OUTPUT_PATH, 'utf8');
  assert.ok(committed === expected, 'src/protocol.gen.ts is out of date with protocol/schema/protocol.schema.json: run `npm run gen-types`');
});

test('the runtime constants match the schema', () => {
  const schema = JSON.parse(readFileSync(SCHEMA_PATH, 'utf8'));
  const consts = (def) => def.oneOf.map((m) => m.const);
  assert.deepEqual([...ERROR_CODES], consts(schema.$defs.ErrorCode));
  assert.deepEqual([...FINISH_REASONS], consts(schema.$defs.FinishReason));
  assert.equal(PROTOCOL_VERSION, schema['x-protocol-version']);
});

test('a changed schema changes the generated types', async () => {
  const schema = JSON.parse(readFileSync(SCHEMA_PATH, 'utf8'));
  schema.$defs.Usage.properties.extra_tokens = { type: 'integer', minimum: 0 };
  const changed = await generate(JSON.stringify(schema));
  assert.match(changed, /extra_tokens\?: number/);
  assert.notEqual(changed, await generate());
});
