import type {
  ChatMessage,
  ClientMessage,
  Delta,
  Done,
  ErrorFrame,
  FimInput,
  GenerateRequest,
  Limits,
  ModelInfo,
  ServerMessage,
  SessionOpen,
  SessionReady,
} from './protocol.gen.js';
import { PROTOCOL_VERSION } from './protocol.gen.js';
import { TetherError, isFatalCode } from './errors.js';
import { GenerationStream, abortError, type StreamOwner } from './stream.js';
import {
  OPEN,
  defaultWebSocket,
  describeSocketError,
  handshakeCode,
  socketTarget,
  type WebSocketConstructor,
  type WebSocketLike,
} from './transport.js';

/** How a session reconnects after its socket drops. */
export interface ReconnectOptions {
  /** Attempts before giving up (then pending requests fail with `connection_failed`). Default 10. */
  maxAttempts?: number;
  /** Delay before the first attempt, doubled for each next one (with ±25% jitter). Default 100 ms. */
  initialDelayMs?: number;
  /** Longest delay between attempts. Default 5000 ms. */
  maxDelayMs?: number;
}

export interface ConnectOptions {
  /** `ws(s)://host:port/v1/ws`; `http(s)://` works too, a URL without a path gets `/v1/ws`, and in a browser a relative URL resolves against the page. */
  url: string;
  /** Bearer token, when the server requires one (sent as the `tether.bearer.<token>` subprotocol, or as `?token=` when it has characters a subprotocol cannot carry). */
  token?: string;
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

interface Pending {
  stream: GenerationStream;
  frame: GenerateRequest;
  /** Sent on the current session: the server may know it. */
  sent: boolean;
  /** Highest `seq` received. */
  lastSeq: number;
  cancelRequested: boolean;
  signal: AbortSignal | undefined;
  onAbort: (() => void) | undefined;
}

interface Handshake {
  resolve: () => void;
  fail: (error: unknown) => void;
}

type Listener<T> = (value: T) => void;

const textEncoder = new TextEncoder();
const RESUME_FAILURES = new Set(['session_not_found', 'invalid_resume_token', 'session_expired']);
const NOT_RETRIABLE = new Set(['unauthorized', 'origin_not_allowed', 'protocol_error', 'session_closed']);

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
  #reconnect: Required<ReconnectOptions> | false;
  #ws: WebSocketLike | null = null;
  #state: ConnectionState = 'connecting';
  #ready: SessionReady | undefined;
  /** The session to resume (cleared when the server no longer has it). */
  #resumable: { session_id: string; resume_token: string } | undefined;
  #handshake: Handshake | undefined;
  #requests = new Map<string, Pending>();
  #pings = new Map<number, { resolve: (ms: number) => void; reject: (e: unknown) => void; sentAt: number }>();
  #nextPing = 1;
  #idPrefix = Math.random().toString(36).slice(2, 6);
  #nextRequest = 1;
  #closing = false;
  #closeWaiter: (() => void) | undefined;
  #sleeping: { timer: ReturnType<typeof setTimeout>; resolve: () => void } | undefined;
  #fatal: TetherError | undefined;
  #reconnects = 0;
  #stateListeners = new Set<Listener<ConnectionState>>();
  #errorListeners = new Set<Listener<TetherError>>();

  private constructor(options: ConnectOptions) {
    this.#options = options;
    this.#target = socketTarget(options.url, options.token);
    this.#reconnect =
      options.reconnect === false
        ? false
        : { maxAttempts: 10, initialDelayMs: 100, maxDelayMs: 5000, ...(options.reconnect ?? {}) };
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
    const id = request_id ?? this.#newRequestId();
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
    const pending: Pending = { stream, frame, sent: false, lastSeq: 0, cancelRequested: false, signal, onAbort: undefined };
    if (signal) {
      pending.onAbort = () => stream.cancel();
      signal.addEventListener('abort', pending.onAbort, { once: true });
    }
    this.#requests.set(id, pending);
    if (this.#state === 'open') this.#sendGenerate(pending);
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
    this.#wakeSleeper();
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

  /**
   * For tests and demos: drops the socket at once, as a network failure would
   * (no closing handshake where the platform allows), and lets the session
   * reconnect and resume as it would after a real drop.
   */
  dropConnectionForTesting(): void {
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

  /** @internal Called by a stream's `cancel()`. */
  cancel(stream: GenerationStream): void {
    const pending = this.#requests.get(stream.requestId);
    if (!pending || pending.stream !== stream) return;
    if (!pending.sent) {
      this.#forget(pending);
      stream.fail(abortError(pending.signal));
      return;
    }
    if (pending.cancelRequested) return;
    pending.cancelRequested = true;
    if (this.#state === 'open') this.#send({ type: 'cancel', request_id: pending.frame.request_id });
  }

  // ---- connection ----

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
    const open: SessionOpen = { type: 'session.open' };
    if (this.#resumable) {
      const lastSeq: Record<string, number> = {};
      for (const p of this.#requests.values()) if (p.sent) lastSeq[p.frame.request_id] = p.lastSeq;
      Object.assign(open, this.#resumable, { last_seq: lastSeq });
    }
    this.#send(open);
  }

  /** The socket of an open session went away. */
  #lost(code: number, reason: string, fatal?: TetherError): void {
    if (this.#over()) return;
    for (const [id, ping] of this.#pings) {
      ping.reject(new TetherError('connection_lost', 'the connection dropped before the pong'));
      this.#pings.delete(id);
    }
    if (code === 1000) {
      // The server closes normally only after our session.close or when
      // another connection resumed this session: it is no longer ours.
      this.#shutdown(new TetherError('session_closed', `the server closed the session${reason ? `: ${reason}` : ''}`));
    } else if (fatal && NOT_RETRIABLE.has(fatal.code)) {
      this.#shutdown(fatal);
    } else if (this.#reconnect === false) {
      const why = fatal ? fatal.message : `close code ${code}${reason ? `: ${reason}` : ''}`;
      this.#shutdown(new TetherError('connection_lost', `the connection dropped (${why})`, { cause: fatal }));
    } else if (fatal?.code === 'idle_timeout' && this.#requests.size === 0) {
      this.#setState('idle');
    } else {
      this.#setState('reconnecting');
      void this.#reconnectLoop(false);
    }
  }

  /** Reconnects from `idle` when there is something to do. */
  #wake(): void {
    if (this.#state !== 'idle') return;
    this.#setState('reconnecting');
    void this.#reconnectLoop(true);
  }

  async #reconnectLoop(immediate: boolean): Promise<void> {
    const policy = this.#reconnect || { maxAttempts: 1, initialDelayMs: 0, maxDelayMs: 0 };
    let last: unknown;
    for (let attempt = 0; attempt < policy.maxAttempts; attempt++) {
      const base = Math.min(policy.maxDelayMs, policy.initialDelayMs * 2 ** attempt);
      await this.#sleep(immediate && attempt === 0 ? 0 : base * (0.75 + Math.random() / 2));
      if (this.#over()) return;
      try {
        await this.#attach();
        return;
      } catch (e) {
        last = e;
        if (this.#over()) return;
        if (e instanceof TetherError && NOT_RETRIABLE.has(e.code)) {
          this.#shutdown(e);
          return;
        }
      }
    }
    const why = last instanceof Error ? last.message : String(last);
    this.#shutdown(
      new TetherError('connection_failed', `gave up reconnecting after ${policy.maxAttempts} attempts: ${why}`, { cause: last }),
    );
  }

  #sleep(ms: number): Promise<void> {
    if (ms <= 0) return Promise.resolve();
    return new Promise((resolve) => {
      const timer = setTimeout(() => {
        this.#sleeping = undefined;
        resolve();
      }, ms);
      this.#sleeping = { timer, resolve };
    });
  }

  /** Closed, or closing. */
  #over(): boolean {
    return this.#closing || this.#state === 'closed';
  }

  #wakeSleeper(): void {
    const s = this.#sleeping;
    this.#sleeping = undefined;
    if (s) {
      clearTimeout(s.timer);
      s.resolve();
    }
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
    this.#wakeSleeper();
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
    for (const p of [...this.#requests.values()]) {
      this.#forget(p);
      p.stream.fail(new TetherError(error.code, error.message, { requestId: p.frame.request_id, cause: error }));
    }
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
        return this.#onDelta(frame);
      case 'done':
        return this.#onDone(frame);
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
      for (const p of this.#requests.values()) if (p.sent) p.stream.resumes++;
    }
    this.#ready = ready;
    this.#resumable = { session_id: ready.session_id, resume_token: ready.resume_token };
    this.#setState('open');
    handshake.resolve();
    for (const p of [...this.#requests.values()]) {
      if (!p.sent) this.#sendGenerate(p);
      else if (p.cancelRequested) this.#send({ type: 'cancel', request_id: p.frame.request_id });
    }
  }

  #sendGenerate(p: Pending): void {
    if (this.#send(p.frame)) p.sent = true;
  }

  /** Checks `seq` order: true for the next frame, false for a replayed duplicate. */
  #inOrder(p: Pending, seq: number): boolean {
    if (seq <= p.lastSeq) return false;
    if (seq === p.lastSeq + 1) {
      p.lastSeq = seq;
      return true;
    }
    this.#send({ type: 'cancel', request_id: p.frame.request_id });
    this.#forget(p);
    const message = `request ${p.frame.request_id}: expected seq ${p.lastSeq + 1}, got ${seq}`;
    p.stream.fail(new TetherError('protocol_error', message, { requestId: p.frame.request_id }));
    return false;
  }

  #onDelta(delta: Delta): void {
    const p = this.#requests.get(delta.request_id);
    if (p && this.#inOrder(p, delta.seq)) p.stream.pushDelta(delta);
  }

  #onDone(done: Done): void {
    const p = this.#requests.get(done.request_id);
    if (!p || !this.#inOrder(p, done.seq)) return;
    this.#forget(p);
    p.stream.finish(done);
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
    const p = this.#requests.get(frame.request_id);
    if (!p || frame.code === 'unknown_request') return;
    if (frame.code === 'replay_unavailable' && p.lastSeq === 0) {
      // Nothing of it reached us: start it again under a fresh id.
      this.#requests.delete(p.frame.request_id);
      p.frame = { ...p.frame, request_id: this.#newRequestId() };
      p.stream.setRequestId(p.frame.request_id);
      p.sent = false;
      this.#requests.set(p.frame.request_id, p);
      if (p.cancelRequested) {
        this.#forget(p);
        p.stream.fail(abortError(p.signal));
      } else {
        this.#sendGenerate(p);
      }
      return;
    }
    this.#forget(p);
    p.stream.fail(error);
  }

  /** The server no longer has the session: requests with output so far fail; the others start again in a new session. */
  #resumeFailed(error: TetherError): void {
    this.#resumable = undefined;
    this.#emitError(error);
    for (const p of [...this.#requests.values()]) {
      if (!p.sent) continue;
      if (p.lastSeq === 0) {
        // Nothing of it reached us: it starts again in the new session.
        p.sent = false;
        if (p.cancelRequested) {
          this.#forget(p);
          p.stream.fail(abortError(p.signal));
        }
        continue;
      }
      this.#forget(p);
      const message = `the session could not be resumed (${error.message}); the request's output ends at seq ${p.lastSeq}`;
      p.stream.fail(new TetherError(error.code, message, { requestId: p.frame.request_id, cause: error }));
    }
    this.#send({ type: 'session.open' });
  }

  #forget(p: Pending): void {
    if (this.#requests.get(p.frame.request_id) === p) this.#requests.delete(p.frame.request_id);
    if (p.signal && p.onAbort) p.signal.removeEventListener('abort', p.onAbort);
  }

  #newRequestId(): string {
    return `${this.#idPrefix}.${this.#nextRequest++}`;
  }
}
