#!/usr/bin/env node
// Lays out dist/playground/ as one self-contained folder for `tether serve
// --ui-dir`: the page and its stylesheet, app.js (compiled by tsc), and the
// built client under lib/ (the page's import map points `@tether/client` there).
import { copyFileSync, mkdirSync, readdirSync, rmSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';

const root = join(dirname(fileURLToPath(import.meta.url)), '..');
const out = join(root, 'dist/playground');
for (const f of ['index.html', 'style.css']) copyFileSync(join(root, 'playground', f), join(out, f));
const lib = join(out, 'lib');
rmSync(lib, { recursive: true, force: true });
mkdirSync(lib, { recursive: true });
for (const f of readdirSync(join(root, 'dist'))) {
  if (f.endsWith('.js')) copyFileSync(join(root, 'dist', f), join(lib, f));
}
console.log(`playground: ${out}`);
