//! Loading from a Hugging Face `tokenizer.json` directory.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde_json::Value;
use tokenizers::Tokenizer;

use super::bytes::{self, TokenBytes, TokenKind};
use super::error::{Result, TokenizerError};
use super::{Parts, TextTokenizer};

fn read_json(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path).map_err(|source| TokenizerError::Io { path: path.to_path_buf(), source })?;
    serde_json::from_str(&text).map_err(|e| TokenizerError::InvalidFile { path: path.to_path_buf(), detail: e.to_string() })
}

fn read_optional_json(path: PathBuf) -> Result<Option<Value>> {
    if path.is_file() {
        read_json(&path).map(Some)
    } else {
        Ok(None)
    }
}

/// `"bos_token": "<s>"` or `{"content": "<s>", ...}` or null.
fn token_text(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_string),
        _ => None,
    }
}

/// How to turn a vocabulary entry into bytes, from the `decoder` section.
enum Scheme {
    ByteLevel,
    SentencePiece { byte_fallback: bool, strip_leading_space: bool },
}

fn decoder_scheme(decoder: &Value, model_byte_fallback: bool) -> Result<Scheme> {
    let ty = decoder.get("type").and_then(Value::as_str).unwrap_or("");
    let parts: Vec<&Value> = match ty {
        "Sequence" => decoder.get("decoders").and_then(Value::as_array).map(|a| a.iter().collect()).unwrap_or_default(),
        "" if decoder.is_null() => return Err(TokenizerError::UnsupportedDecoder("none".into())),
        _ => vec![decoder],
    };
    let types: Vec<&str> = parts.iter().filter_map(|d| d.get("type").and_then(Value::as_str)).collect();
    if types.contains(&"ByteLevel") {
        return Ok(Scheme::ByteLevel);
    }
    let sp = types.iter().any(|t| matches!(*t, "Metaspace" | "ByteFallback" | "Replace" | "Fuse" | "Strip"));
    if !sp {
        return Err(TokenizerError::UnsupportedDecoder(decoder.to_string()));
    }
    let mut strip = false;
    for d in &parts {
        match d.get("type").and_then(Value::as_str) {
            Some("Strip") => {
                let content = d.get("content").and_then(Value::as_str).unwrap_or(" ");
                let start = d.get("start").and_then(Value::as_u64).unwrap_or(0);
                strip |= content == " " && start >= 1;
            }
            Some("Metaspace") => {
                let scheme = d.get("prepend_scheme").and_then(Value::as_str);
                let add = d.get("add_prefix_space").and_then(Value::as_bool);
                strip |= matches!(scheme, Some("always" | "first")) || (scheme.is_none() && add != Some(false));
            }
            _ => {}
        }
    }
    let byte_fallback = model_byte_fallback || types.contains(&"ByteFallback");
    Ok(Scheme::SentencePiece { byte_fallback, strip_leading_space: strip })
}

pub(crate) fn from_hf_dir(dir: &Path) -> Result<TextTokenizer> {
    let tok_path = dir.join("tokenizer.json");
    let raw = read_json(&tok_path)?;
    let tokenizer = Tokenizer::from_file(&tok_path).map_err(|e| TokenizerError::InvalidFile { path: tok_path.clone(), detail: e.to_string() })?;
    let config = read_optional_json(dir.join("tokenizer_config.json"))?.unwrap_or(Value::Null);
    let gen_config = read_optional_json(dir.join("generation_config.json"))?.unwrap_or(Value::Null);

    let model_byte_fallback = raw.pointer("/model/byte_fallback").and_then(Value::as_bool).unwrap_or(false);
    let scheme = decoder_scheme(raw.get("decoder").unwrap_or(&Value::Null), model_byte_fallback)?;

    // id -> vocabulary string (model vocab + added tokens).
    let vocab = tokenizer.get_vocab(true);
    let n = vocab.values().map(|&id| id as usize + 1).max().unwrap_or(0);
    let mut id_to_text: Vec<Option<&str>> = vec![None; n];
    for (text, &id) in &vocab {
        id_to_text[id as usize] = Some(text.as_str());
    }
    let added: HashMap<u32, (String, bool)> = tokenizer.get_added_tokens_decoder().into_iter().map(|(id, t)| (id, (t.content, t.special))).collect();

    let mut table = TokenBytes::with_capacity(n);
    for (id, text) in id_to_text.iter().enumerate() {
        if let Some((content, special)) = added.get(&(id as u32)) {
            let kind = if *special { TokenKind::Control } else { TokenKind::UserDefined };
            table.push_with(kind, |o| o.extend_from_slice(content.as_bytes()));
            continue;
        }
        match text {
            None => table.push_with(TokenKind::Unused, |_| {}),
            Some(t) => table.push_with(TokenKind::Normal, |o| match scheme {
                Scheme::ByteLevel => bytes::byte_level_decode(t, o),
                Scheme::SentencePiece { byte_fallback, .. } => bytes::sentencepiece_decode(t, byte_fallback, o),
            }),
        }
    }

    let lookup = |text: &Option<String>| text.as_deref().and_then(|t| tokenizer.token_to_id(t));
    let bos_text = token_text(config.get("bos_token"));
    let eos_text = token_text(config.get("eos_token"));
    let bos_id = lookup(&bos_text);
    let eos_id = lookup(&eos_text);

    let mut extra_eos = Vec::new();
    match gen_config.get("eos_token_id") {
        Some(Value::Number(x)) => extra_eos.extend(x.as_u64().map(|x| x as u32)),
        Some(Value::Array(a)) => extra_eos.extend(a.iter().filter_map(Value::as_u64).map(|x| x as u32)),
        _ => {}
    }

    let add_bos = match config.get("add_bos_token").and_then(Value::as_bool) {
        Some(b) => b,
        // No explicit flag: see whether the post-processor inserts BOS.
        None => match bos_id {
            Some(bos) => tokenizer.encode_fast("a", true).map(|e| e.get_ids().first() == Some(&bos)).unwrap_or(false),
            None => false,
        },
    };
    let add_eos = config.get("add_eos_token").and_then(Value::as_bool).unwrap_or(false);

    let chat_template = match config.get("chat_template") {
        Some(Value::String(s)) => Some(s.clone()),
        Some(Value::Array(list)) => {
            let named =
                |name: &str| list.iter().find(|e| e.get("name").and_then(Value::as_str) == Some(name)).and_then(|e| e.get("template").and_then(Value::as_str));
            named("default").or_else(|| list.first().and_then(|e| e.get("template").and_then(Value::as_str))).map(str::to_string)
        }
        _ => None,
    };
    let chat_template = match chat_template {
        Some(t) => Some(t),
        None => {
            let p = dir.join("chat_template.jinja");
            if p.is_file() {
                Some(std::fs::read_to_string(&p).map_err(|source| TokenizerError::Io { path: p, source })?)
            } else {
                None
            }
        }
    };

    let strip_leading_space = matches!(scheme, Scheme::SentencePiece { strip_leading_space: true, .. });
    TextTokenizer::assemble(Parts {
        tokenizer,
        bytes: table,
        bos_id,
        eos_id,
        extra_eos,
        add_bos,
        add_eos,
        chat_template,
        strip_leading_space,
        pre_family: "tokenizer.json".to_string(),
    })
}
