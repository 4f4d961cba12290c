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
  /** Tokens received under the current `request_id`. */
  tokens: number;
  /** Tokens received under earlier ids, before the session was lost and the request continued in a new one. */
  carriedTokens: number;
  /** Characters of output the new session's run repeats, not delivered again (a `messages` request run again whole). */
  skipChars: number;
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
    const pending: PendingRequest = {
      stream,
      frame,
      sent: false,
      lastSeq: 0,
      cancelRequested: false,
      signal,
      onAbort: undefined,
      tokens: 0,
      carriedTokens: 0,
      skipChars: 0,
    };
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

  /**
   * The server no longer has the session (its replica was lost, or the
   * session expired): every request goes on in the new session, which has
   * none of the old one's state but the client has all it needs. A request
   * with no output yet starts again; one with output continues where its
   * output stopped (see {@link #continueElsewhere}).
   */
  resumeFailed(_error: TetherError): void {
    for (const p of [...this.#requests.values()]) {
      if (!p.sent) continue;
      if (p.cancelRequested) {
        this.#forget(p);
        p.stream.fail(abortError(p.signal));
        continue;
      }
      if (p.lastSeq > 0) this.#continueElsewhere(p);
      else p.sent = false;
    }
  }

  /**
   * Re-issues a request that had output, under a new id, so its stream goes
   * on as if nothing happened:
   * - `prompt` and `fim`: the output so far is appended to the prompt (the
   *   prefix) and only the remaining tokens are asked for: an exact
   *   continuation at any temperature;
   * - `messages`: the server renders the chat template, so the conversation
   *   is sent again whole, and the first characters of the new output (as many
   *   as were delivered) are not delivered again. Exact at temperature 0 or
   *   with a `seed`; otherwise the rest continues from a different draw.
   */
  #continueElsewhere(p: PendingRequest): void {
    const delivered = p.stream.text;
    const frame: GenerateRequest = { ...p.frame, request_id: this.newId() };
    p.carriedTokens += p.tokens;
    if (frame.prompt !== undefined || frame.fim !== undefined) {
      if (frame.prompt !== undefined) frame.prompt += delivered;
      else if (frame.fim) frame.fim = { ...frame.fim, prefix: frame.fim.prefix + delivered };
      if (frame.max_tokens !== undefined) {
        const remaining = frame.max_tokens - p.carriedTokens;
        if (remaining <= 0) return this.#finishLost(p);
        frame.max_tokens = remaining;
      }
    } else {
      p.skipChars = delivered.length;
      p.carriedTokens = 0;
    }
    this.#requests.delete(p.frame.request_id);
    p.frame = frame;
    p.stream.setRequestId(frame.request_id);
    p.stream.resumes++;
    p.sent = false;
    p.lastSeq = 0;
    p.tokens = 0;
    this.#requests.set(frame.request_id, p);
  }

  // ---- frames ----

  /** All of a request's tokens had arrived, only its `done` was lost with the session. */
  #finishLost(p: PendingRequest): void {
    this.#forget(p);
    p.stream.finish({
      type: 'done',
      request_id: p.frame.request_id,
      seq: p.lastSeq + 1,
      finish_reason: 'length',
      usage: { prompt_tokens: 0, cached_tokens: 0, completion_tokens: p.carriedTokens },
      timing: { queue_ms: 0, ttft_ms: 0, total_ms: 0 },
    });
  }

  onDelta(delta: Delta): void {
    const p = this.#requests.get(delta.request_id);
    if (!p || !this.#inOrder(p, delta.seq)) return;
    p.tokens += delta.token_ids.length;
    if (p.skipChars > 0) {
      // A request run again whole: its output up to here was delivered before.
      const cut = Math.min(p.skipChars, delta.text.length);
      p.skipChars -= cut;
      if (cut === delta.text.length) return;
      delta = { ...delta, text: delta.text.slice(cut) };
    }
    p.stream.pushDelta(delta);
  }

  onDone(done: Done): void {
    const p = this.#requests.get(done.request_id);
    if (!p || !this.#inOrder(p, done.seq)) return;
    this.#forget(p);
    if (p.carriedTokens > 0) {
      // The output of the session that was lost counts too.
      done = { ...done, usage: { ...done.usage, completion_tokens: done.usage.completion_tokens + p.carriedTokens } };
    }
    p.stream.finish(done);
  }

  /** An `error` frame about request `requestId`. */
  onError(requestId: string, error: TetherError): void {
    const p = this.#requests.get(requestId);
    if (!p || error.code === 'unknown_request') return;
    if (error.code === 'shutting_down' && p.lastSeq === 0 && !p.cancelRequested) {
      // A draining server refused it before it started: it is sent again once
      // the session is back (the next connection reaches another replica).
      p.sent = false;
      return;
    }
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
