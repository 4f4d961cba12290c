// The playground: a chat with streaming, a fill-in-the-middle box, cancel and
// per-request stats, on top of the client library (served as ./lib/ and
// mapped to `@tether/client` by the page's import map; the Drop socket button
// uses `@tether/client/testing`).
import { connect, TetherError } from '@tether/client';
import { dropConnection } from '@tether/client/testing';
import type { ChatMessage, ConnectionState, GenerationResult, GenerationStream, Session } from '@tether/client';

const el = <T extends HTMLElement = HTMLElement>(id: string): T => {
  const e = document.getElementById(id);
  if (!e) throw new Error(`#${id} is missing`);
  return e as T;
};

const ui = {
  state: el('state'),
  model: el('model'),
  error: el('error'),
  connectForm: el<HTMLFormElement>('connect-form'),
  token: el<HTMLInputElement>('token'),
  drop: el<HTMLButtonElement>('drop'),
  log: el('log'),
  chatForm: el<HTMLFormElement>('chat-form'),
  prompt: el<HTMLTextAreaElement>('prompt'),
  maxTokens: el<HTMLInputElement>('max-tokens'),
  temperature: el<HTMLInputElement>('temperature'),
  newChat: el<HTMLButtonElement>('new-chat'),
  stop: el<HTMLButtonElement>('stop'),
  send: el<HTMLButtonElement>('send'),
  fimHint: el('fim-hint'),
  fimPrefix: el<HTMLTextAreaElement>('fim-prefix'),
  fimSuffix: el<HTMLTextAreaElement>('fim-suffix'),
  fimRun: el<HTMLButtonElement>('fim-run'),
  fimStop: el<HTMLButtonElement>('fim-stop'),
  fimBefore: el('fim-before'),
  fimMiddle: el('fim-middle'),
  fimAfter: el('fim-after'),
  fimError: el('fim-error'),
};

let session: Session | undefined;
let history: ChatMessage[] = [];
let chatRun: AbortController | undefined;
let fimRun: AbortController | undefined;

function describe(e: unknown): string {
  if (e instanceof TetherError) return `${e.code}: ${e.message}`;
  if (e instanceof Error) return e.name === 'AbortError' ? 'cancelled before it started' : e.message;
  return String(e);
}

function showError(e: unknown): void {
  ui.error.hidden = e === undefined;
  ui.error.textContent = e === undefined ? '' : describe(e);
}

function setState(state: ConnectionState): void {
  ui.state.dataset.state = state;
  ui.state.textContent = state;
  refreshButtons();
}

function refreshButtons(): void {
  const usable = session !== undefined && session.state !== 'closed';
  ui.send.disabled = !usable || chatRun !== undefined;
  ui.stop.disabled = chatRun === undefined;
  ui.fimRun.disabled = !usable || fimRun !== undefined;
  ui.fimStop.disabled = fimRun === undefined;
  ui.drop.disabled = session?.state !== 'open';
}

async function open(): Promise<void> {
  const old = session;
  session = undefined;
  await old?.close();
  showError(undefined);
  setState('connecting');
  try {
    const s = await connect({ url: new URL('/v1/ws', location.href).href, token: ui.token.value.trim() || undefined });
    session = s;
    s.on('state', (state) => {
      if (session === s) setState(state);
    });
    s.on('error', (e) => showError(e));
    ui.model.textContent = `${s.model.name} · ${s.model.architecture} · context ${s.model.context_length}`;
    ui.fimHint.hidden = s.model.fim;
    setState(s.state);
  } catch (e) {
    setState('closed');
    showError(e);
    if (e instanceof TetherError && e.code === 'connection_failed' && !ui.token.value.trim()) {
      // Browsers do not say why a handshake was refused; a missing token is the usual reason.
      ui.error.textContent += ' — if the server requires a token, enter it above and connect.';
    }
  }
}

function number(input: HTMLInputElement, fallback: number): number {
  const v = Number(input.value);
  return input.value.trim() !== '' && Number.isFinite(v) ? v : fallback;
}

function params(): { max_tokens: number; temperature: number } {
  return { max_tokens: Math.round(number(ui.maxTokens, 256)), temperature: number(ui.temperature, 0) };
}

function stat(id: string, value: string | number): void {
  el(`stat-${id}`).textContent = String(value);
}

function showStats(r: GenerationResult): void {
  const decodeMs = r.timing.total_ms - r.timing.ttft_ms;
  const tps = r.usage.completion_tokens > 1 && decodeMs > 0 ? ((r.usage.completion_tokens - 1) * 1000) / decodeMs : undefined;
  stat('status', r.finishReason);
  stat('ttft', `${r.timing.ttft_ms} ms`);
  stat('tps', tps === undefined ? '–' : tps.toFixed(1));
  stat('prompt', r.usage.prompt_tokens);
  stat('cached', r.usage.cached_tokens);
  stat('completion', r.usage.completion_tokens);
  stat('total', `${r.timing.total_ms} ms`);
  stat('resumes', r.resumes);
}

/** Live numbers while a stream runs (the server's own arrive with `done`). */
function showProgress(stream: GenerationStream, startedAt: number, firstAt: number | undefined): void {
  const n = stream.tokenIds.length;
  stat('status', 'streaming');
  stat('completion', n);
  if (firstAt !== undefined) {
    stat('ttft', `${Math.round(firstAt - startedAt)} ms (client)`);
    const s = (performance.now() - firstAt) / 1000;
    if (n > 1 && s > 0) stat('tps', ((n - 1) / s).toFixed(1));
  }
}

/** A message in the log: `.msg > .text` (+ `.note` for how it ended). */
function bubble(role: 'user' | 'assistant', text: string): { div: HTMLElement; text: Text } {
  const div = document.createElement('div');
  div.className = `msg ${role}`;
  const span = document.createElement('span');
  span.className = 'text';
  const node = document.createTextNode(text);
  span.append(node);
  div.append(span);
  ui.log.append(div);
  ui.log.scrollTop = ui.log.scrollHeight;
  return { div, text: node };
}

function note(div: HTMLElement, text: string): void {
  const span = document.createElement('span');
  span.className = 'note';
  span.textContent = text;
  div.append(span);
}

function clearStats(): void {
  for (const id of ['status', 'ttft', 'tps', 'prompt', 'cached', 'completion', 'total', 'resumes']) stat(id, '–');
}

async function runStream(stream: GenerationStream, onText: (text: string) => void): Promise<GenerationResult> {
  clearStats();
  const startedAt = performance.now();
  let firstAt: number | undefined;
  for await (const delta of stream) {
    if (firstAt === undefined && delta.token_ids.length > 0) firstAt = performance.now();
    if (delta.text) onText(delta.text);
    showProgress(stream, startedAt, firstAt);
  }
  const result = await stream.result;
  showStats(result);
  return result;
}

async function sendChat(): Promise<void> {
  const text = ui.prompt.value.trim();
  if (!session || chatRun || !text) return;
  ui.prompt.value = '';
  history.push({ role: 'user', content: text });
  bubble('user', text);
  const { div: out, text: outText } = bubble('assistant', '');
  out.classList.add('streaming');
  chatRun = new AbortController();
  refreshButtons();
  try {
    const stream = session.generate({ messages: [...history], ...params() }, { signal: chatRun.signal });
    const result = await runStream(stream, (t) => {
      outText.data += t;
      ui.log.scrollTop = ui.log.scrollHeight;
    });
    history.push({ role: 'assistant', content: result.text });
    out.dataset.finish = result.finishReason;
    if (result.finishReason !== 'stop') note(out, result.finishReason === 'length' ? 'max tokens reached' : result.finishReason);
  } catch (e) {
    history.pop();
    out.classList.add('failed');
    out.dataset.finish = 'error';
    note(out, describe(e));
    stat('status', e instanceof TetherError ? e.code : 'error');
  } finally {
    out.classList.remove('streaming');
    chatRun = undefined;
    refreshButtons();
    ui.prompt.focus();
  }
}

async function runFim(): Promise<void> {
  if (!session || fimRun) return;
  const prefix = ui.fimPrefix.value;
  const suffix = ui.fimSuffix.value;
  ui.fimBefore.textContent = prefix;
  ui.fimMiddle.textContent = '';
  ui.fimAfter.textContent = suffix;
  delete ui.fimMiddle.dataset.finish;
  ui.fimError.hidden = true;
  fimRun = new AbortController();
  refreshButtons();
  try {
    const { max_tokens, temperature } = params();
    const stream = session.fim({ prefix, suffix, max_tokens: Math.min(max_tokens, 128), temperature }, { signal: fimRun.signal });
    const result = await runStream(stream, (t) => (ui.fimMiddle.textContent += t));
    ui.fimMiddle.dataset.finish = result.finishReason;
  } catch (e) {
    ui.fimMiddle.dataset.finish = 'error';
    ui.fimError.hidden = false;
    ui.fimError.textContent = describe(e);
    stat('status', e instanceof TetherError ? e.code : 'error');
  } finally {
    fimRun = undefined;
    refreshButtons();
  }
}

ui.connectForm.addEventListener('submit', (e) => {
  e.preventDefault();
  void open();
});
ui.chatForm.addEventListener('submit', (e) => {
  e.preventDefault();
  void sendChat();
});
ui.prompt.addEventListener('keydown', (e) => {
  if (e.key === 'Enter' && !e.shiftKey && !e.isComposing) {
    e.preventDefault();
    void sendChat();
  }
});
ui.stop.addEventListener('click', () => chatRun?.abort());
ui.newChat.addEventListener('click', () => {
  chatRun?.abort();
  history = [];
  ui.log.replaceChildren();
});
ui.fimRun.addEventListener('click', () => void runFim());
ui.fimStop.addEventListener('click', () => fimRun?.abort());
/** What the Drop socket button does: the socket goes as in a network failure, and the session resumes. */
function drop(): void {
  if (session) dropConnection(session);
}
ui.drop.addEventListener('click', drop);

// For automated tests and the console: the live session, and dropping its socket.
Object.defineProperty(window, 'tetherPlayground', { value: { get session() { return session; }, dropConnection: drop } });

void open();
