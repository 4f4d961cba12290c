/**
 * Client for Tether protocol v1 (browsers and Node 20+).
 *
 * ```ts
 * import { connect } from '@tether/client';
 * const session = await connect({ url: 'ws://127.0.0.1:8080/v1/ws' });
 * const stream = session.generate({ messages: [{ role: 'user', content: 'Hi!' }], max_tokens: 64 });
 * for await (const delta of stream) process.stdout.write(delta.text);
 * const { usage, timing, finishReason } = await stream.result;
 * await session.close();
 * ```
 */
export { connect, Session } from './session.js';
export type {
  ConnectOptions,
  ConnectionState,
  FimRequest,
  GenerateInput,
  GenerateParams,
  RequestOptions,
} from './session.js';
export type { ReconnectOptions } from './reconnect.js';
export { GenerationStream } from './stream.js';
export type { GenerationResult } from './stream.js';
export { TetherError, isTetherError } from './errors.js';
export type { ClientErrorCode, TetherErrorCode } from './errors.js';
export type { WebSocketConstructor, WebSocketLike } from './transport.js';
export { ERROR_CODES, FINISH_REASONS, PROTOCOL_VERSION } from './protocol.gen.js';
export type * from './protocol.gen.js';
