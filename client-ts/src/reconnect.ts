// Reconnect and resume: what a lost socket leads to (a new attempt, `idle`, or
// the end of the session), the backoff between attempts, and the
// `session.open` that resumes a session on a new socket.
import type { SessionOpen } from './protocol.gen.js';
import { TetherError } from './errors.js';

/** How a session reconnects after its socket drops. */
export interface ReconnectOptions {
  /** Attempts before giving up (then pending requests fail with `connection_failed`). Default 10. */
  maxAttempts?: number;
  /** Delay before the first attempt, doubled for each next one (with ±25% jitter). Default 100 ms. */
  initialDelayMs?: number;
  /** Longest delay between attempts. Default 5000 ms. */
  maxDelayMs?: number;
}

export type ReconnectPolicy = Required<ReconnectOptions>;

/** What a session resumes with: from its latest `session.ready`. */
export interface Resumable {
  session_id: string;
  resume_token: string;
}

/** `error` codes answering a resume: the server no longer has the session. */
export const RESUME_FAILURES = new Set(['session_not_found', 'invalid_resume_token', 'session_expired']);
/** Codes another attempt would get again. */
const NOT_RETRIABLE = new Set(['unauthorized', 'origin_not_allowed', 'protocol_error', 'session_closed']);

/** `ConnectOptions.reconnect` with its defaults filled in; `false` when reconnecting is off. */
export function reconnectPolicy(options: ReconnectOptions | false | undefined): ReconnectPolicy | false {
  return options === false ? false : { maxAttempts: 10, initialDelayMs: 100, maxDelayMs: 5000, ...(options ?? {}) };
}

/**
 * The `session.open` of a new socket: a resume, with the highest `seq`
 * received for every request the server has seen, when there is a session to
 * resume; else a fresh session.
 */
export function openFrame(resumable: Resumable | undefined, lastSeq: Record<string, number>): SessionOpen {
  const open: SessionOpen = { type: 'session.open' };
  if (resumable) Object.assign(open, resumable, { last_seq: lastSeq });
  return open;
}

/**
 * What follows the loss of an open session's socket (close `code` and
 * `reason`; `fatal`: the fatal error the server sent before closing, if any):
 * reconnect, wait `idle` for the next request, or end the session with the
 * error returned.
 */
export function afterLoss(
  code: number,
  reason: string,
  fatal: TetherError | undefined,
  policy: ReconnectPolicy | false,
  inFlight: number,
): 'reconnect' | 'idle' | TetherError {
  if (code === 1000) {
    // The server closes normally only after our session.close or when
    // another connection resumed this session: it is no longer ours.
    return new TetherError('session_closed', `the server closed the session${reason ? `: ${reason}` : ''}`);
  }
  if (fatal && NOT_RETRIABLE.has(fatal.code)) return fatal;
  if (policy === false) {
    const why = fatal ? fatal.message : `close code ${code}${reason ? `: ${reason}` : ''}`;
    return new TetherError('connection_lost', `the connection dropped (${why})`, { cause: fatal });
  }
  if (fatal?.code === 'idle_timeout' && inFlight === 0) return 'idle';
  return 'reconnect';
}

/** The session's side of a reconnect. */
export interface ReconnectTarget {
  /** Opens a socket and completes `session.open`; rejects when that failed. */
  attach(): Promise<void>;
  /** True once the session is closed or closing: stop trying. */
  over(): boolean;
  /** Ends the session for good with `error`. */
  shutdown(error: TetherError): void;
}

/** Runs reconnect attempts with exponential backoff and jitter. */
export class Reconnector {
  readonly policy: ReconnectPolicy | false;
  #target: ReconnectTarget;
  #sleeping: { timer: ReturnType<typeof setTimeout>; resolve: () => void } | undefined;

  constructor(policy: ReconnectPolicy | false, target: ReconnectTarget) {
    this.policy = policy;
    this.#target = target;
  }

  /**
   * Attempts until one attaches, the session ends, an attempt fails in a way
   * another would too, or the attempts are spent (then the session ends with
   * `connection_failed`). `immediate`: the first attempt does not wait.
   */
  async run(immediate: boolean): Promise<void> {
    const policy = this.policy || { maxAttempts: 1, initialDelayMs: 0, maxDelayMs: 0 };
    const target = this.#target;
    let last: unknown;
    for (let attempt = 0; attempt < policy.maxAttempts; attempt++) {
      const base = Math.min(policy.maxDelayMs, policy.initialDelayMs * 2 ** attempt);
      await this.#sleep(immediate && attempt === 0 ? 0 : base * (0.75 + Math.random() / 2));
      if (target.over()) return;
      try {
        await target.attach();
        return;
      } catch (e) {
        last = e;
        if (target.over()) return;
        if (e instanceof TetherError && NOT_RETRIABLE.has(e.code)) {
          target.shutdown(e);
          return;
        }
      }
    }
    const why = last instanceof Error ? last.message : String(last);
    target.shutdown(
      new TetherError('connection_failed', `gave up reconnecting after ${policy.maxAttempts} attempts: ${why}`, { cause: last }),
    );
  }

  /** Ends the wait before the next attempt now (the session is ending: the loop then sees `over()`). */
  interrupt(): void {
    const s = this.#sleeping;
    this.#sleeping = undefined;
    if (s) {
      clearTimeout(s.timer);
      s.resolve();
    }
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
}
