import type { ErrorCode } from './protocol.gen.js';
import { ERROR_CODES } from './protocol.gen.js';

/**
 * Failures the client itself detects (no `error` frame behind them):
 * - `connection_failed`: the socket could not be opened, or reconnecting gave up;
 * - `connection_lost`: the socket dropped and automatic reconnect is off;
 * - `session_closed`: the session was closed (by `close()`, or taken over by
 *   another connection) while the request was pending;
 * - `protocol_error`: the server sent something the protocol does not allow
 *   (a gap in `seq`, an unknown protocol version, a frame that is not JSON).
 */
export type ClientErrorCode = 'connection_failed' | 'connection_lost' | 'session_closed' | 'protocol_error';

/** Every code a {@link TetherError} can carry. */
export type TetherErrorCode = ErrorCode | ClientErrorCode;

const SERVER_CODES: ReadonlySet<string> = new Set(ERROR_CODES);

/** Codes after which the server closes the connection. */
const FATAL_CODES: ReadonlySet<ErrorCode> = new Set<ErrorCode>([
  'frame_too_large',
  'unauthorized',
  'origin_not_allowed',
  'server_busy',
  'shutting_down',
  'idle_timeout',
]);

/**
 * An error from the server (an `error` frame, `code` is one of the protocol's
 * {@link ErrorCode}s) or from the client ({@link ClientErrorCode}). Branch on
 * `code`; `message` is for people.
 */
export class TetherError extends Error {
  override readonly name = 'TetherError';
  /** The protocol's error code, or the client's own. */
  readonly code: TetherErrorCode;
  /** The request the error belongs to, when there is one. */
  readonly requestId: string | undefined;

  constructor(code: TetherErrorCode, message: string, options: { requestId?: string; cause?: unknown } = {}) {
    super(message, options.cause === undefined ? undefined : { cause: options.cause });
    this.code = code;
    this.requestId = options.requestId;
  }

  /** True when `code` came from the server (an `error` frame). */
  get fromServer(): boolean {
    return SERVER_CODES.has(this.code);
  }

  /** True for server codes after which the server closes the connection. */
  get fatal(): boolean {
    return FATAL_CODES.has(this.code as ErrorCode);
  }
}

/** Narrows an unknown error to a {@link TetherError}, optionally of one code. */
export function isTetherError(e: unknown, code?: TetherErrorCode): e is TetherError {
  return e instanceof TetherError && (code === undefined || e.code === code);
}

export function isFatalCode(code: ErrorCode): boolean {
  return FATAL_CODES.has(code);
}
