// Shared by the tests: the servers scripts/run-tests.mjs started, and a
// connect() that checks every frame, both ways, against the protocol schema.
import { readFileSync } from 'node:fs';
import Ajv2020 from 'ajv/dist/2020.js';
import { connect } from '@tether/client';

export const URL_ = required('TETHER_URL');
export const FIM_URL = required('TETHER_FIM_URL');
export const AUTH_TOKEN = required('TETHER_AUTH_TOKEN');
export const WS_URL = `${URL_.replace(/^http/, 'ws')}/v1/ws`;

function required(name) {
  const v = process.env[name];
  if (!v) throw new Error(`${name} is not set: run the tests with \`npm test\` (scripts/run-tests.mjs starts the servers)`);
  return v;
}

const schema = JSON.parse(readFileSync(new URL('../../protocol/schema/protocol.schema.json', import.meta.url), 'utf8'));
const ajv = new Ajv2020({ allErrors: true, strict: false, validateFormats: false });
ajv.addSchema(schema, 'protocol');
/** direction -> frame type -> validator of that message (the union's member with that `type`). */
const validators = { in: byType('ServerMessage'), out: byType('ClientMessage') };

function byType(union) {
  return Object.fromEntries(
    schema.$defs[union].oneOf.map((member, i) => [
      member.properties.type.const,
      ajv.compile({ $ref: `protocol#/$defs/${union}/oneOf/${i}` }),
    ]),
  );
}

function problems(errors) {
  return errors.map((e) => `${e.instancePath || '/'} ${e.message}${e.params?.additionalProperty ? `: ${e.params.additionalProperty}` : ''}`);
}

/** Frames that did not match the schema, across every session opened by `open`. */
export const violations = [];

/** `connect` with schema checks of every frame (see `violations`). */
export function open(options = {}) {
  return connect({
    url: WS_URL,
    ...options,
    onFrame(direction, frame) {
      const validate = validators[direction][frame.type];
      if (!validate) violations.push({ direction, type: frame.type, problems: ['unknown message type'] });
      else if (!validate(frame)) violations.push({ direction, type: frame.type, problems: problems(validate.errors) });
      options.onFrame?.(direction, frame);
    },
  });
}

/** The result of `input` run alone in a fresh session (greedy unless it says otherwise). */
export async function reference(input, options = {}) {
  const session = await open(options);
  try {
    return await session.generate(input).result;
  } finally {
    await session.close();
  }
}

export const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
