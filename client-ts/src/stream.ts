import type { Delta, Done, FinishReason, Timing, TokenLogprob, ToolCall, Usage } from './protocol.gen.js';

/** What a finished request gives: the whole completion and the server's accounting. */
export interface GenerationResult {
  requestId: string;
  /** The concatenated `text` of every delta, in `seq` order. */
  text: string;
  /** Every generated token id, in order. */
  tokenIds: number[];
  /** Per-token log-probabilities, when the request asked for `logprobs`. */
  logprobs?: TokenLogprob[];
  finishReason: FinishReason;
  /** The tools the model called (`finishReason` is then `tool_calls`); empty otherwise. */
  toolCalls: ToolCall[];
  usage: Usage;
  timing: Timing;
  /** The server's `done` frame as received (fields newer than this client included). */
  done: Done;
  /** How many times the stream was resumed on a new socket. */
  resumes: number;
}

/** The session's side of a stream: how it asks for a cancel. */
export interface StreamOwner {
  cancel(stream: GenerationStream): void;
}

type Waiter = { resolve: (r: IteratorResult<Delta>) => void; reject: (e: unknown) => void };

/**
 * One request's output: iterate it (`for await (const delta of stream)`) for
 * the deltas as they arrive, and/or await `stream.result` for the whole.
 * Deltas are buffered from the start, so iterating late loses nothing.
 * Leaving the loop early (`break`, `return`, a throw) cancels the request.
 */
export class GenerationStream implements AsyncIterable<Delta> {
  /** Resolves with the finished request; rejects with a {@link TetherError} (or the abort reason). */
  readonly result: Promise<GenerationResult>;

  #requestId: string;
  #owner: StreamOwner;
  #buffer: Delta[] = [];
  #waiter: Waiter | undefined;
  #iterating = false;
  #ended: { error?: unknown } | undefined;
  #text = '';
  #tokenIds: number[] = [];
  #logprobs: TokenLogprob[] | undefined;
  #resolve!: (r: GenerationResult) => void;
  #reject!: (e: unknown) => void;
  /** @internal */ resumes = 0;

  /** @internal */
  constructor(requestId: string, owner: StreamOwner) {
    this.#requestId = requestId;
    this.#owner = owner;
    this.result = new Promise<GenerationResult>((resolve, reject) => {
      this.#resolve = resolve;
      this.#reject = reject;
    });
    // Failures are reported through `result` and the iterator; a caller that
    // looks at only one of them must not get an unhandled rejection.
    this.result.catch(() => {});
  }

  /** The `request_id` on the wire (a request resubmitted after a lost socket gets a new one). */
  get requestId(): string {
    return this.#requestId;
  }

  /** The text received so far. */
  get text(): string {
    return this.#text;
  }

  /** The token ids received so far. */
  get tokenIds(): readonly number[] {
    return this.#tokenIds;
  }

  /** True once `result` is settled. */
  get finished(): boolean {
    return this.#ended !== undefined;
  }

  /**
   * Asks the server to stop: the request ends with `finish_reason: "cancelled"`
   * (deltas already received stay valid). Before the request reached the
   * server, `result` rejects with an `AbortError` instead. Idempotent.
   */
  cancel(): void {
    if (!this.#ended) this.#owner.cancel(this);
  }

  [Symbol.asyncIterator](): AsyncIterator<Delta> {
    if (this.#iterating) throw new TypeError('a GenerationStream can be iterated only once');
    this.#iterating = true;
    return {
      next: () => {
        const delta = this.#buffer.shift();
        if (delta) return Promise.resolve({ value: delta, done: false });
        if (this.#ended) {
          return this.#ended.error === undefined
            ? Promise.resolve({ value: undefined, done: true })
            : Promise.reject(this.#ended.error);
        }
        return new Promise((resolve, reject) => {
          this.#waiter = { resolve, reject };
        });
      },
      return: () => {
        this.#buffer = [];
        this.cancel();
        return Promise.resolve({ value: undefined, done: true });
      },
    };
  }

  /** @internal */ setRequestId(id: string): void {
    this.#requestId = id;
  }

  /** @internal */ pushDelta(delta: Delta): void {
    this.#text += delta.text;
    this.#tokenIds.push(...delta.token_ids);
    if (delta.logprobs) (this.#logprobs ??= []).push(...delta.logprobs);
    const waiter = this.#waiter;
    if (waiter) {
      this.#waiter = undefined;
      waiter.resolve({ value: delta, done: false });
    } else {
      this.#buffer.push(delta);
    }
  }

  /** @internal */ finish(done: Done): void {
    if (this.#ended) return;
    this.#ended = {};
    this.#resolve({
      requestId: this.#requestId,
      text: this.#text,
      tokenIds: this.#tokenIds,
      ...(this.#logprobs ? { logprobs: this.#logprobs } : {}),
      finishReason: done.finish_reason,
      toolCalls: done.tool_calls ?? [],
      usage: done.usage,
      timing: done.timing,
      done,
      resumes: this.resumes,
    });
    this.#waiter?.resolve({ value: undefined, done: true });
    this.#waiter = undefined;
  }

  /** @internal */ fail(error: unknown): void {
    if (this.#ended) return;
    this.#ended = { error };
    this.#reject(error);
    this.#waiter?.reject(error);
    this.#waiter = undefined;
  }
}

export function abortError(signal: AbortSignal | undefined): unknown {
  if (signal?.reason !== undefined) return signal.reason;
  return typeof DOMException === 'function'
    ? new DOMException('the request was aborted', 'AbortError')
    : Object.assign(new Error('the request was aborted'), { name: 'AbortError' });
}
