// The WebSocket underneath a session: the platform's own (browsers, Node 22+)
// or, where there is none (Node 20), the `ws` package, loaded on first use.
import { TetherError } from './errors.js';

/** The subset of the WHATWG WebSocket the client uses. */
export interface WebSocketLike {
  readonly readyState: number;
  readonly protocol: string;
  send(data: string): void;
  close(code?: number, reason?: string): void;
  /** `ws` only: drops the TCP connection without a closing handshake. */
  terminate?(): void;
  onopen: ((event: unknown) => void) | null;
  onmessage: ((event: { data: unknown }) => void) | null;
  onclose: ((event: { code: number; reason: string }) => void) | null;
  onerror: ((event: unknown) => void) | null;
}

/** A WebSocket constructor: `globalThis.WebSocket`, `ws`'s, or any compatible one. */
export type WebSocketConstructor = new (url: string, protocols?: string | string[]) => WebSocketLike;

export const OPEN = 1;

/** The subprotocol naming protocol v1 (the server echoes it). */
export const SUBPROTOCOL = 'tether.v1';
/** Browsers cannot set `Authorization` on a WebSocket: the token rides in a subprotocol entry. */
export const BEARER_PREFIX = 'tether.bearer.';

let wsModule: Promise<WebSocketConstructor> | undefined;

/** The platform's WebSocket, else `ws`'s (imported dynamically so browsers never load it). */
export function defaultWebSocket(): Promise<WebSocketConstructor> {
  const native = (globalThis as { WebSocket?: unknown }).WebSocket;
  if (typeof native === 'function') return Promise.resolve(native as WebSocketConstructor);
  wsModule ??= import('ws').then(
    (m) => (m.WebSocket ?? m.default) as unknown as WebSocketConstructor,
    (cause) => {
      wsModule = undefined;
      throw new TetherError('connection_failed', 'this runtime has no WebSocket: install the `ws` package (Node 20)', { cause });
    },
  );
  return wsModule;
}

// RFC 7230 `token` characters: what a subprotocol entry may hold.
const TOKEN_CHARS = /^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$/;

/**
 * The socket URL and subprotocols for `url`, an optional bearer token and an
 * optional affinity key (`?affinity=`, for a proxy in front of replicas).
 * `http(s)://` becomes `ws(s)://`; a URL with no path gets `/v1/ws`; a
 * relative URL resolves against the page (browsers).
 */
export function socketTarget(url: string, token?: string, affinity?: string): { url: string; protocols: string[] } {
  const base = (globalThis as { location?: { href?: string } }).location?.href;
  const u = new URL(url, base);
  if (u.protocol === 'http:') u.protocol = 'ws:';
  else if (u.protocol === 'https:') u.protocol = 'wss:';
  if (u.protocol !== 'ws:' && u.protocol !== 'wss:') {
    throw new TetherError('connection_failed', `unsupported URL scheme ${u.protocol} (use ws:, wss:, http: or https:)`);
  }
  if (u.pathname === '/' || u.pathname === '') u.pathname = '/v1/ws';
  if (affinity) u.searchParams.set('affinity', affinity);
  const protocols = [SUBPROTOCOL];
  if (token) {
    if (TOKEN_CHARS.test(token)) protocols.push(BEARER_PREFIX + token);
    else u.searchParams.set('token', token);
  }
  return { url: u.toString(), protocols };
}

/** Best-effort reason from a socket's `error` event (`ws` says the HTTP status). */
export function describeSocketError(event: unknown): string {
  const e = event as { message?: unknown; error?: { message?: unknown } } | null;
  const m = e?.message ?? e?.error?.message;
  return typeof m === 'string' && m ? m : 'WebSocket error';
}

/** The `error` code implied by a refused handshake (`ws` reports `Unexpected server response: 401`). */
export function handshakeCode(message: string): 'unauthorized' | 'origin_not_allowed' | 'server_busy' | undefined {
  const status = /\b(401|403|503)\b/.exec(message)?.[1];
  return status === '401' ? 'unauthorized' : status === '403' ? 'origin_not_allowed' : status === '503' ? 'server_busy' : undefined;
}
