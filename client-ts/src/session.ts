// The public Session: it owns the socket and the handshake, routes frames,
// and wires the request table (requests.ts) and reconnect (reconnect.ts).
import type {
  ChatMessage,
  ClientMessage,
  ErrorFrame,
  FimInput,
  GenerateRequest,
  Limits,
  ModelInfo,
  ServerMessage,
  SessionReady,
} from './protocol.gen.js';
import { PROTOCOL_VERSION } from './protocol.gen.js';
import { TetherError, isFatalCode } from './errors.js';
import { GenerationStream, abortError, type StreamOwner } from './stream.js';
import {
  RESUME_FAILURES,
  Reconnector,
  afterLoss,
  openFrame,
  reconnectPolicy,
  type ReconnectOptions,
  type Resumable,
} from './reconnect.js';
import { RequestTable } from './requests.js';
import {
  OPEN,
  defaultWebSocket,
  describeSocketError,
  handshakeCode,
  socketTarget,
  type WebSocketConstructor,
  type WebSocketLike,
} from './transport.js';

export interface ConnectOptions {
  /** `ws(s)://host:port/v1/ws`; `http(s)://` works too, a URL without a path gets `/v1/ws`, and in a browser a relative URL resolves against the page. */
  url: string;
  /** Bearer token, when the server requires one (sent as the `tether.bearer.<token>` subprotocol, or as `?token=` when it has characters a subprotocol cannot carry). */
  token?: string;
  /**
   * The key a proxy places this session's sockets by, sent as `?affinity=` on
   * every connect and reconnect (the first included, before the session has
   * an id), so a session behind several replicas always reaches the one
   * holding its state. Default: a random key per session.
   */
  affinity?: string;
  /** Automatic reconnect and resume; `false` turns it off. */
  reconnect?: ReconnectOptions | false;
  /** How long to wait for `session.ready` after the socket opens. Default 10000 ms. */
  handshakeTimeoutMs?: number;
  /** A WebSocket constructor to use instead of the platform's (or `ws` on Node 20). */
  WebSocket?: WebSocketConstructor;
  /** Called with every frame sent (`out`) and received (`in`), for logging and tests. */
  onFrame?: (direction: 'in' | 'out', frame: ClientMessage | ServerMessage) => void;
}

/**
 * - `connecting`: the first connection is being made;
 * - `open`: a socket is up and the session is ready;
 * - `reconnecting`: the socket dropped; resuming on a new one;
 * - `idle`: the server closed an idle socket; the next request reconnects;
 * - `closed`: closed for good (`close()`, or reconnecting gave up).
 */
export type ConnectionState = 'connecting' | 'open' | 'reconnecting' | 'idle' | 'closed';

/** Sampling and limits of a request: every `generate` field but the input and the type. */
export type GenerateParams = Omit<GenerateRequest, 'type' | 'request_id' | 'prompt' | 'messages' | 'fim'> & {
  /** Your own id (`[A-Za-z0-9._:-]{1,64}`, unique within the session); default: generated. */
  request_id?: string;
};

/** A request: sampling parameters and exactly one of `prompt`, `messages` or `fim`. */
export type GenerateInput = GenerateParams &
  (
    | { prompt: string; messages?: never; fim?: never }
    | { messages: ChatMessage[]; prompt?: never; fim?: never }
    | { fim: FimInput; prompt?: never; messages?: never }
  );

/** A fill-in-the-middle request: `prefix`, `suffix`, optional `extra` context, and sampling parameters. */
export type FimRequest = FimInput & GenerateParams;

export interface RequestOptions {
  /** Aborting cancels the request (see {@link GenerationStream.cancel}). */
  signal?: AbortSignal;
}

interface Handshake {
  resolve: () => void;
  fail: (error: unknown) => void;
}

type Listener<T> = (value: T) => void;

const textEncoder = new TextEncoder();

/** Set in Session's static block, the one place outside an instance that reaches its private state. */
let dropSocket: (session: Session) => void;

/**
 * @internal For testing.ts only (index.ts does not export it): drops the
 * session's socket as a network failure would.
 */
export function dropSessionSocket(session: Session): void {
  dropSocket(session);
}

/**
 * Opens a session on a Tether server: resolves once the server answered
 * `session.ready`, rejects with a {@link TetherError} (`connection_failed`,
 * `unauthorized`, `origin_not_allowed`, `server_busy`, ...) otherwise.
 */
export function connect(options: ConnectOptions): Promise<Session> {
  return Session.open(options);
}

/**
 * A protocol session: requests, their streams, and the socket under them.
 * When the socket drops it reconnects and resumes with each unfinished
 * request's last `seq`; frames the server replays are de-duplicated by `seq`,
 * so every stream goes on with no token lost or repeated.
 */
export class Session implements StreamOwner {
  #options: ConnectOptions;
  #target: { url: string; protocols: string[] };
  #reconnector: Reconnector;
  #ws: WebSocketLike | null = null;
  #state: ConnectionState = 'connecting';
  #ready: SessionReady | undefined;
  /** The session to resume (cleared when the server no longer has it). */
  #resumable: Resumable | undefined;
  #handshake: Handshake | undefined;
  #requests = new RequestTable((frame) => this.#send(frame));
  #pings = new Map<number, { resolve: (ms: number) => void; reject: (e: unknown) => void; sentAt: number }>();
  #nextPing = 1;
  #closing = false;
  #closeWaiter: (() => void) | undefined;
  #fatal: TetherError | undefined;
  #reconnects = 0;
  #stateListeners = new Set<Listener<ConnectionState>>();
  #errorListeners = new Set<Listener<TetherError>>();

  private constructor(options: ConnectOptions) {
    this.#options = options;
    this.#target = socketTarget(options.url, options.token, options.affinity ?? globalThis.crypto.randomUUID());
    this.#reconnector = new Reconnector(reconnectPolicy(options.reconnect), {
      attach: () => this.#attach(),
      over: () => this.#over(),
      shutdown: (error) => this.#shutdown(error),
    });
  }

  static {
    dropSocket = (session) => session.#drop();
  }

  /** The same as {@link connect}. */
  static async open(options: ConnectOptions): Promise<Session> {
    const session = new Session(options);
    try {
      await session.#attach();
    } catch (e) {
      session.#shutdown(e instanceof TetherError ? e : new TetherError('connection_failed', String(e), { cause: e }));
      throw e;
    }
    return session;
  }

  /** The current session id (a new one if the old session could not be resumed). */
  get id(): string | undefined {
    return this.#resumable?.session_id ?? this.#ready?.session_id;
  }

  /** The model the server runs, from the latest `session.ready`. */
  get model(): ModelInfo {
    return this.#ready!.model;
  }

  /** The server's limits, from the latest `session.ready`. */
  get limits(): Limits {
    return this.#ready!.limits;
  }

  get state(): ConnectionState {
    return this.#state;
  }

  /** How many times the session was resumed on a new socket. */
  get reconnects(): number {
    return this.#reconnects;
  }

  /**
   * Listens for connection state changes (`state`) or for errors that belong
   * to no request (`error`: a resume that failed, a frame the server refused).
   * Returns a function that removes the listener.
   */
  on(event: 'state', listener: Listener<ConnectionState>): () => void;
  on(event: 'error', listener: Listener<TetherError>): () => void;
  on(event: 'state' | 'error', listener: Listener<never>): () => void {
    const set = (event === 'state' ? this.#stateListeners : this.#errorListeners) as Set<Listener<never>>;
    set.add(listener);
    return () => set.delete(listener);
  }

  /** Starts a request; see {@link GenerationStream} for reading it. */
  generate(input: GenerateInput, options: RequestOptions = {}): GenerationStream {
    const { request_id, ...params } = input;
    const id = request_id ?? this.#requests.newId();
    const frame = { type: 'generate', request_id: id, ...params } as GenerateRequest;
    const stream = new GenerationStream(id, this);
    const { signal } = options;
    if (this.#state === 'closed') {
      stream.fail(new TetherError('session_closed', 'the session is closed', { requestId: id }));
      return stream;
    }
    if (this.#requests.has(id)) {
      stream.fail(new TetherError('duplicate_request', `request ${id} is still in flight`, { requestId: id }));
      return stream;
    }
    const limit = this.#ready?.limits.max_frame_bytes;
    const size = textEncoder.encode(JSON.stringify(frame)).length;
    if (limit !== undefined && size > limit) {
      const message = `the request is ${size} bytes; the server accepts frames up to ${limit}`;
      stream.fail(new TetherError('frame_too_large', message, { requestId: id }));
      return stream;
    }
    if (signal?.aborted) {
      stream.fail(abortError(signal));
      return stream;
    }
    const pending = this.#requests.add(stream, frame, signal);
    if (this.#state === 'open') this.#requests.send(pending);
    else if (this.#state === 'idle') this.#wake();
    return stream;
  }

  /** Fill-in-the-middle: generates the text between `prefix` and `suffix` (needs `model.fim`, else `fim_unsupported`). */
  fim(input: FimRequest, options: RequestOptions = {}): GenerationStream {
    const { prefix, suffix, extra, ...params } = input;
    const fim: FimInput = extra === undefined ? { prefix, suffix } : { prefix, suffix, extra };
    return this.generate({ ...params, fim }, options);
  }

  /** Round trip to the server in milliseconds. */
  async ping(): Promise<number> {
    await this.#whenOpen();
    const id = this.#nextPing++;
    return new Promise<number>((resolve, reject) => {
      this.#pings.set(id, { resolve, reject, sentAt: Date.now() });
      this.#send({ type: 'ping', id });
    });
  }

  /**
   * Ends the session for good: the server cancels what is in flight and
   * forgets the session; pending streams fail with `session_closed`.
   */
  async close(): Promise<void> {
    if (this.#state === 'closed' || this.#closing) return;
    this.#closing = true;
    this.#reconnector.interrupt();
    const closed = new TetherError('session_closed', 'the session was closed');
    this.#failAll(closed);
    const ws = this.#ws;
    if (ws && this.#state === 'open' && ws.readyState === OPEN) {
      const socketClosed = new Promise<void>((resolve) => (this.#closeWaiter = resolve));
      this.#send({ type: 'session.close' });
      const timer = setTimeout(() => this.#closeWaiter?.(), 2000);
      await socketClosed;
      clearTimeout(timer);
    }
    this.#shutdown(closed);
  }

  /** @internal Called by a stream's `cancel()`. */
  cancel(stream: GenerationStream): void {
    this.#requests.cancel(stream, this.#state === 'open');
  }

  // ---- connection ----

  /**
   * For tests and demos (testing.ts): drops the socket at once, as a network
   * failure would (no closing handshake where the platform allows), and lets
   * the session reconnect and resume as it would after a real drop.
   */
  #drop(): void {
    const ws = this.#ws;
    if (!ws || this.#state !== 'open') return;
    this.#detach(ws);
    try {
      if (ws.terminate) ws.terminate();
      else ws.close(4000, 'dropped for testing');
    } catch {
      // already closed
    }
    this.#lost(1006, 'dropped for testing');
  }

  /** Opens a socket and completes `session.open` (a resume when there is a session). */
  async #attach(): Promise<void> {
    const WS = this.#options.WebSocket ?? (await defaultWebSocket());
    if (this.#closing) throw new TetherError('session_closed', 'the session was closed');
    await new Promise<void>((resolve, reject) => {
      let ws: WebSocketLike;
      try {
        ws = new WS(this.#target.url, this.#target.protocols);
      } catch (cause) {
        reject(new TetherError('connection_failed', `cannot open ${this.#target.url}: ${String(cause)}`, { cause }));
        return;
      }
      this.#ws = ws;
      this.#fatal = undefined;
      let errorText = '';
      const timeout = this.#options.handshakeTimeoutMs ?? 10_000;
      const timer = setTimeout(() => {
        handshake.fail(new TetherError('connection_failed', `no session.ready within ${timeout} ms`));
      }, timeout);
      const handshake: Handshake = {
        resolve: () => {
          clearTimeout(timer);
          this.#handshake = undefined;
          resolve();
        },
        fail: (error) => {
          clearTimeout(timer);
          if (this.#handshake === handshake) this.#handshake = undefined;
          if (this.#ws === ws) {
            this.#detach(ws);
            try {
              ws.close();
            } catch {
              // not open yet
            }
          }
          reject(error);
        },
      };
      this.#handshake = handshake;
      ws.onopen = () => this.#sendOpen();
      ws.onmessage = (event) => this.#onMessage(ws, event.data);
      ws.onerror = (event) => {
        errorText = describeSocketError(event);
      };
      ws.onclose = (event) => {
        if (ws !== this.#ws) return;
        this.#detach(ws);
        const fatal = this.#fatal;
        if (this.#closing) {
          this.#closeWaiter?.();
          if (this.#handshake === handshake) handshake.fail(new TetherError('session_closed', 'the session was closed'));
          return;
        }
        if (this.#handshake === handshake) {
          const why = `${errorText || 'the connection closed'} (close code ${event.code}${event.reason ? `: ${event.reason}` : ''})`;
          handshake.fail(fatal ?? new TetherError(handshakeCode(errorText) ?? 'connection_failed', `${this.#target.url}: ${why}`));
          return;
        }
        this.#lost(event.code, event.reason, fatal);
      };
    });
  }

  #sendOpen(): void {
    this.#send(openFrame(this.#resumable, this.#requests.lastSeqs()));
  }

  /** The socket of an open session went away. */
  #lost(code: number, reason: string, fatal?: TetherError): void {
    if (this.#over()) return;
    for (const [id, ping] of this.#pings) {
      ping.reject(new TetherError('connection_lost', 'the connection dropped before the pong'));
      this.#pings.delete(id);
    }
    const next = afterLoss(code, reason, fatal, this.#reconnector.policy, this.#requests.size);
    if (next === 'idle') {
      this.#setState('idle');
    } else if (next === 'reconnect') {
      this.#setState('reconnecting');
      void this.#reconnector.run(false);
    } else {
      this.#shutdown(next);
    }
  }

  /** Reconnects from `idle` when there is something to do. */
  #wake(): void {
    if (this.#state !== 'idle') return;
    this.#setState('reconnecting');
    void this.#reconnector.run(true);
  }

  /** Closed, or closing. */
  #over(): boolean {
    return this.#closing || this.#state === 'closed';
  }

  #whenOpen(): Promise<void> {
    if (this.#state === 'open') return Promise.resolve();
    if (this.#state === 'closed') return Promise.reject(new TetherError('session_closed', 'the session is closed'));
    this.#wake();
    return new Promise((resolve, reject) => {
      const off = this.on('state', (s) => {
        if (s === 'open') resolve();
        else if (s === 'closed') reject(new TetherError('session_closed', 'the session is closed'));
        else return;
        off();
      });
    });
  }

  #detach(ws: WebSocketLike): void {
    // No-ops rather than null: `ws` throws on an `error` event nobody listens to.
    ws.onopen = ws.onmessage = ws.onerror = ws.onclose = () => {};
    if (this.#ws === ws) this.#ws = null;
  }

  /** Closed for good: every pending request fails with `error`. */
  #shutdown(error: TetherError): void {
    this.#reconnector.interrupt();
    this.#handshake?.fail(error);
    const ws = this.#ws;
    if (ws) {
      this.#detach(ws);
      try {
        ws.close(1000);
      } catch {
        // already closed
      }
    }
    this.#failAll(error);
    this.#setState('closed');
  }

  /** Every pending request and ping fails with (a copy of) `error`. */
  #failAll(error: TetherError): void {
    this.#requests.failAll(error);
    for (const ping of this.#pings.values()) ping.reject(error);
    this.#pings.clear();
  }

  #setState(state: ConnectionState): void {
    if (this.#state === state) return;
    this.#state = state;
    for (const l of [...this.#stateListeners]) l(state);
  }

  #emitError(error: TetherError): void {
    for (const l of [...this.#errorListeners]) l(error);
  }

  #send(frame: ClientMessage): boolean {
    const ws = this.#ws;
    if (!ws || ws.readyState !== OPEN) return false;
    ws.send(JSON.stringify(frame));
    this.#tap('out', frame);
    return true;
  }

  #tap(direction: 'in' | 'out', frame: ClientMessage | ServerMessage): void {
    if (!this.#options.onFrame) return;
    try {
      this.#options.onFrame(direction, frame);
    } catch (e) {
      this.#emitError(new TetherError('protocol_error', `onFrame threw: ${String(e)}`, { cause: e }));
    }
  }

  // ---- frames ----

  #onMessage(ws: WebSocketLike, data: unknown): void {
    if (ws !== this.#ws) return;
    let frame: ServerMessage;
    try {
      if (typeof data !== 'string') throw new Error('a binary frame');
      frame = JSON.parse(data) as ServerMessage;
    } catch (e) {
      this.#emitError(new TetherError('protocol_error', `the server sent a frame that is not JSON text: ${String(e)}`));
      return;
    }
    this.#tap('in', frame);
    switch (frame.type) {
      case 'session.ready':
        return this.#onReady(frame);
      case 'delta':
        return this.#requests.onDelta(frame);
      case 'done':
        return this.#requests.onDone(frame);
      case 'error':
        return this.#onError(frame);
      case 'pong': {
        const ping = typeof frame.id === 'number' ? this.#pings.get(frame.id) : undefined;
        if (ping && typeof frame.id === 'number') {
          this.#pings.delete(frame.id);
          ping.resolve(Date.now() - ping.sentAt);
        }
        return;
      }
      default:
        // A newer server's frame type: nothing to do with it.
        return;
    }
  }

  #onReady(ready: SessionReady): void {
    const handshake = this.#handshake;
    if (!handshake) return;
    if (ready.protocol_version !== PROTOCOL_VERSION) {
      const message = `the server speaks protocol ${ready.protocol_version}; this client speaks ${PROTOCOL_VERSION}`;
      handshake.fail(new TetherError('protocol_error', message));
      return;
    }
    if (ready.resumed) {
      this.#reconnects++;
      this.#requests.resumed();
    }
    this.#ready = ready;
    this.#resumable = { session_id: ready.session_id, resume_token: ready.resume_token };
    this.#setState('open');
    handshake.resolve();
    this.#requests.flush();
  }

  #onError(frame: ErrorFrame): void {
    const error = new TetherError(frame.code, frame.message, { requestId: frame.request_id });
    const handshake = this.#handshake;
    if (handshake && !frame.request_id) {
      if (RESUME_FAILURES.has(frame.code)) return this.#resumeFailed(error);
      if (isFatalCode(frame.code)) this.#fatal = error;
      else handshake.fail(error);
      return;
    }
    if (frame.request_id === undefined) {
      if (isFatalCode(frame.code)) this.#fatal = error;
      else this.#emitError(error);
      return;
    }
    this.#requests.onError(frame.request_id, error);
  }

  /** The server no longer has the session: requests with output so far fail; the others start again in a new session. */
  #resumeFailed(error: TetherError): void {
    this.#resumable = undefined;
    this.#emitError(error);
    this.#requests.resumeFailed(error);
    this.#send({ type: 'session.open' });
  }
}
