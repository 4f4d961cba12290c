// Helpers for tests and demos, kept off the Session API: index.ts does not
// export this module; it is the package's `@tether/client/testing` entry.
import { dropSessionSocket, type Session } from './session.js';

/**
 * Drops the session's socket at once, as a network failure would (no closing
 * handshake where the platform allows), and lets the session reconnect and
 * resume as it would after a real drop. Does nothing unless the session is
 * `open`; the session is `reconnecting` when this returns.
 */
export function dropConnection(session: Session): void {
  dropSessionSocket(session);
}
