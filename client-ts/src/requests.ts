// The requests of a session that have not finished: each one's stream, the
// `generate` frame that starts it (kept to send it again when the server never
// got it), and the highest `seq` received, which puts its frames in order,
// drops what a resume replays twice, and tells the resume where to start.
import type { ClientMessage, Delta, Done, GenerateRequest } from './protocol.gen.js';
import { TetherError } from './errors.js';
import { abortError, type GenerationStream } from './stream.js';

export interface PendingRequest {
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

/** Sends a frame on the session's socket; false when no socket is open. */
export type SendFrame = (frame: ClientMessage) => boolean;

/** The in-flight requests of one session, by `request_id`. */
export class RequestTable {
  #requests = new Map<string, PendingRequest>();
  #send: SendFrame;
  #idPrefix = Math.random().toString(36).slice(2, 6);
  #nextRequest = 1;

  constructor(send: SendFrame) {
    this.#send = send;
  }

  get size(): number {
    return this.#requests.size;
  }

  has(requestId: string): boolean {
    return this.#requests.has(requestId);
  }

  /** A request id not used before in this session. */
  newId(): string {
    return `${this.#idPrefix}.${this.#nextRequest++}`;
  }

  /** Registers a request, not sent yet; aborting `signal` cancels its stream. */
  add(stream: GenerationStream, frame: GenerateRequest, signal: AbortSignal | undefined): PendingRequest {
    const pending: PendingRequest = { stream, frame, sent: false, lastSeq: 0, cancelRequested: false, signal, onAbort: undefined };
    if (signal) {
      pending.onAbort = () => stream.cancel();
      signal.addEventListener('abort', pending.onAbort, { once: true });
    }
    this.#requests.set(frame.request_id, pending);
    return pending;
  }

  /** Sends the request's `generate`: it is sent once a socket took it. */
  send(p: PendingRequest): void {
    if (this.#send(p.frame)) p.sent = true;
  }

  /**
   * A stream's `cancel()`: a request the server never saw fails with an
   * `AbortError` at once; the server is asked to cancel the others (now if
   * the socket is `open`, else once it is back: see {@link flush}).
   */
  cancel(stream: GenerationStream, open: boolean): void {
    const pending = this.#requests.get(stream.requestId);
    if (!pending || pending.stream !== stream) return;
    if (!pending.sent) {
      this.#forget(pending);
      stream.fail(abortError(pending.signal));
      return;
    }
    if (pending.cancelRequested) return;
    pending.cancelRequested = true;
    if (open) this.#send({ type: 'cancel', request_id: pending.frame.request_id });
  }

  // ---- resume ----

  /** The highest `seq` received for every request the server has seen: a resume's `last_seq`. */
  lastSeqs(): Record<string, number> {
    const lastSeq: Record<string, number> = {};
    for (const p of this.#requests.values()) if (p.sent) lastSeq[p.frame.request_id] = p.lastSeq;
    return lastSeq;
  }

  /** The session was resumed: the requests the server had go on, on a new socket. */
  resumed(): void {
    for (const p of this.#requests.values()) if (p.sent) p.stream.resumes++;
  }

  /** The socket is ready: sends the requests that waited for it and the cancels asked for while it was down. */
  flush(): void {
    for (const p of [...this.#requests.values()]) {
      if (!p.sent) this.send(p);
      else if (p.cancelRequested) this.#send({ type: 'cancel', request_id: p.frame.request_id });
    }
  }

  /** The server no longer has the session: requests with output so far fail; the others start again in a new session. */
  resumeFailed(error: TetherError): void {
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
  }

  // ---- frames ----

  onDelta(delta: Delta): void {
    const p = this.#requests.get(delta.request_id);
    if (p && this.#inOrder(p, delta.seq)) p.stream.pushDelta(delta);
  }

  onDone(done: Done): void {
    const p = this.#requests.get(done.request_id);
    if (!p || !this.#inOrder(p, done.seq)) return;
    this.#forget(p);
    p.stream.finish(done);
  }

  /** An `error` frame about request `requestId`. */
  onError(requestId: string, error: TetherError): void {
    const p = this.#requests.get(requestId);
    if (!p || error.code === 'unknown_request') return;
    if (error.code === 'replay_unavailable' && p.lastSeq === 0) {
      // Nothing of it reached us: start it again under a fresh id.
      this.#requests.delete(p.frame.request_id);
      p.frame = { ...p.frame, request_id: this.newId() };
      p.stream.setRequestId(p.frame.request_id);
      p.sent = false;
      this.#requests.set(p.frame.request_id, p);
      if (p.cancelRequested) {
        this.#forget(p);
        p.stream.fail(abortError(p.signal));
      } else {
        this.send(p);
      }
      return;
    }
    this.#forget(p);
    p.stream.fail(error);
  }

  /** Every request fails with (a copy of) `error`. */
  failAll(error: TetherError): void {
    for (const p of [...this.#requests.values()]) {
      this.#forget(p);
      p.stream.fail(new TetherError(error.code, error.message, { requestId: p.frame.request_id, cause: error }));
    }
  }

  /** Checks `seq` order: true for the next frame, false for a replayed duplicate. */
  #inOrder(p: PendingRequest, seq: number): boolean {
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

  #forget(p: PendingRequest): void {
    if (this.#requests.get(p.frame.request_id) === p) this.#requests.delete(p.frame.request_id);
    if (p.signal && p.onAbort) p.signal.removeEventListener('abort', p.onAbort);
  }
}
