// The playground in Debian's Chromium, driven by playwright-core: type a
// prompt and watch it stream, stop a run, and kill the socket mid-stream.
import { after, before, test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { chromium } from 'playwright-core';
import { URL_, reference, sleep } from './helpers.mjs';

const CHROMIUM = process.env.TETHER_CHROMIUM ?? '/usr/bin/chromium';
// Quiet, offline-friendly Chromium: no background fetches to a closed network.
const ARGS = [
  '--no-sandbox',
  '--disable-gpu',
  '--disable-quic',
  '--no-first-run',
  '--disable-background-networking',
  '--disable-component-update',
  '--disable-sync',
];

let context;
let page;
let profile;
const pageErrors = [];

before(async () => {
  profile = mkdtempSync(join(tmpdir(), 'tether-chromium-'));
  context = await chromium.launchPersistentContext(profile, { executablePath: CHROMIUM, headless: true, args: ARGS });
  page = context.pages()[0] ?? (await context.newPage());
  page.setDefaultTimeout(20_000);
  page.on('pageerror', (e) => pageErrors.push(String(e)));
  page.on('console', (m) => m.type() === 'error' && pageErrors.push(m.text()));
  await page.goto(`${URL_}/`);
  await page.waitForSelector('#state[data-state="open"]');
});

after(async () => {
  await context?.close();
  if (profile) rmSync(profile, { recursive: true, force: true });
});

/** Starts a fresh chat turn from the page's own controls. */
async function ask(prompt, maxTokens) {
  await page.click('#new-chat');
  await page.fill('#max-tokens', String(maxTokens));
  await page.fill('#temperature', '0');
  await page.fill('#prompt', prompt);
  await page.click('#send');
}

/** The last assistant message: its text and, once finished, how it ended. */
function reply() {
  return page.evaluate(() => {
    const msgs = document.querySelectorAll('.msg.assistant');
    const last = msgs[msgs.length - 1];
    return { text: last?.querySelector('.text')?.textContent ?? '', finish: last?.dataset.finish ?? '' };
  });
}

/** Polls the reply until it finished, recording the partial texts seen on the way. */
async function watch(onPartial = () => {}) {
  const partials = [];
  for (const deadline = Date.now() + 30_000; Date.now() < deadline; await sleep(40)) {
    const r = await reply();
    if (r.finish) return { ...r, partials };
    if (r.text && r.text !== partials[partials.length - 1]) {
      partials.push(r.text);
      await onPartial(r.text, partials.length);
    }
  }
  throw new Error('the reply did not finish in 30 s');
}

const stat = (id) => page.textContent(`#stat-${id}`);

test('type a prompt and watch the tokens stream in', async () => {
  const prompt = 'Write a haiku about the sea.';
  const expected = await reference({ messages: [{ role: 'user', content: prompt }], max_tokens: 40 });
  await ask(prompt, 40);
  assert.ok(await page.isDisabled('#send'), 'Send is disabled while streaming');
  const r = await watch();
  assert.ok(r.partials.length >= 3, `saw ${r.partials.length} partial texts before done`);
  for (let i = 1; i < r.partials.length; i++) assert.ok(r.partials[i].startsWith(r.partials[i - 1]), 'text only grows');
  assert.equal(r.text, expected.text);
  assert.equal(r.finish, expected.finishReason);
  assert.equal(await stat('status'), expected.finishReason);
  assert.equal(await stat('completion'), String(expected.usage.completion_tokens));
  assert.match(await stat('tps'), /^\d+(\.\d)?$/);
  assert.match(await stat('cached'), /^\d+$/);
  assert.ok(await page.isEnabled('#send'));
});

test('Stop cancels the stream', async () => {
  await ask('Tell me a long story about a brave dragon.', 300);
  let stopped = false;
  const r = await watch(async (text) => {
    if (!stopped && text.length > 20) {
      stopped = true;
      await page.click('#stop');
    }
  });
  // Ended by Stop, before its 300 tokens; how soon is the machine's load,
  // not the page's (watch() fails on a hang after 30 s).
  assert.ok(stopped, 'Stop was clicked mid-stream');
  assert.equal(r.finish, 'cancelled');
  assert.equal(await stat('status'), 'cancelled');
  assert.ok(Number(await stat('completion')) < 300);
});

test('killing the socket mid-stream: the stream resumes and completes with the uninterrupted text', async () => {
  const prompt = 'List five animals that live in the ocean, one per line.';
  const expected = await reference({ messages: [{ role: 'user', content: prompt }], max_tokens: 48 });
  await ask(prompt, 48);
  let dropped = false;
  const r = await watch(async (_, n) => {
    if (!dropped && n >= 3) {
      dropped = await page.evaluate(() => {
        window.tetherPlayground.dropConnection();
        return window.tetherPlayground.session.state === 'reconnecting';
      });
    }
  });
  assert.ok(dropped, 'the socket was dropped mid-stream');
  assert.equal(r.text, expected.text);
  assert.equal(r.finish, expected.finishReason);
  assert.equal(await stat('resumes'), '1');
  assert.equal(await page.getAttribute('#state', 'data-state'), 'open');
  assert.equal(await page.evaluate(() => window.tetherPlayground.session.reconnects), 1);
});

test('the FIM box shows the typed error of a model without FIM', async () => {
  assert.ok(await page.isVisible('#fim-hint'));
  await page.click('#fim-run');
  await page.waitForSelector('#fim-middle[data-finish="error"]', { state: 'attached' });
  assert.match(await page.textContent('#fim-error'), /^fim_unsupported: /);
  assert.equal(await stat('status'), 'fim_unsupported');
});

// Widths users open the page at, narrowest last: every control of every
// panel inside its panel (none cut off, none sticking out), no panel wider
// than the window; a screenshot of each for a human to look at.
test('the panels hold their controls at common window widths', async (t) => {
  const shots = mkdtempSync(join(tmpdir(), 'tether-playground-shots-'));
  t.diagnostic(`screenshots: ${shots}`);
  try {
    for (const [width, height] of [[1920, 1080], [1440, 900], [1280, 800], [1200, 800], [1024, 768], [800, 900], [390, 844]]) {
      await page.setViewportSize({ width, height });
      const problems = await page.evaluate(() => {
        const out = [];
        const doc = document.documentElement;
        if (doc.scrollWidth > doc.clientWidth) out.push(`the page scrolls sideways (${doc.scrollWidth} > ${doc.clientWidth})`);
        for (const panel of document.querySelectorAll('header, section, aside')) {
          const box = panel.getBoundingClientRect();
          for (const el of panel.querySelectorAll('button, input, textarea, label, .state, dd')) {
            if (el.offsetParent === null) continue; // hidden
            const r = el.getBoundingClientRect();
            if (r.left < box.left - 0.5 || r.right > box.right + 0.5) out.push(`${el.id || el.tagName} (${Math.round(r.left)}-${Math.round(r.right)}) leaves its panel (${Math.round(box.left)}-${Math.round(box.right)})`);
          }
          for (const b of panel.querySelectorAll('button')) {
            if (b.offsetParent !== null && b.scrollWidth > b.clientWidth + 1) out.push(`${b.id}: its label is cut (${b.scrollWidth} > ${b.clientWidth})`);
            const st = getComputedStyle(b);
            const text = b.clientHeight - parseFloat(st.paddingTop) - parseFloat(st.paddingBottom);
            if (b.offsetParent !== null && text > 1.5 * parseFloat(st.lineHeight)) out.push(`${b.id}: its label wraps`);
          }
        }
        return out;
      });
      await page.screenshot({ path: join(shots, `playground-${width}x${height}.png`) });
      assert.deepEqual(problems, [], `at ${width} x ${height}`);
    }
  } finally {
    await page.setViewportSize({ width: 1280, height: 800 });
  }
});

test('the page logged no errors', () => {
  assert.deepEqual(pageErrors, []);
});
