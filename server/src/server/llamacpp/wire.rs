//! llama.cpp's request bodies for `/completion` and `/infill`, as its
//! editor plugins send them (`tests/fixtures/llamacpp/`), turned into the
//! protocol's [`GenerateRequest`].
//!
//! llama.cpp ignores fields it does not know; this edge knows every field
//! those clients send and refuses the rest, so a typo is an error rather
//! than a silently different completion. A few known fields are accepted
//! and ignored, each for a reason given at [`IGNORED`].
use std::time::Duration;

use protocol::{FimExtra, FimInput, GenerateInput, GenerateRequest, ResponseFormat};
use serde::Deserialize;
use serde_json::{Map, Value};

/// Fields read here.
const FIELDS: &[&str] = &[
    "prompt",
    "input_prefix",
    "input_suffix",
    "input_extra",
    "n_predict",
    "max_tokens",
    "stream",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "seed",
    "stop",
    "samplers",
    "n_indent",
    "t_max_predict_ms",
    "response_fields",
    "n_cmpl",
    "n",
    "model",
    "ignore_eos",
    "return_tokens",
    "n_probs",
    "lora",
    "id_slot",
    "json_schema",
];
/// Accepted and ignored:
/// * `cache_prompt`: the prefix cache is always on, and reusing cached KV
///   state never changes the output, so `false` would only be slower;
/// * `t_max_prompt_ms`: llama.cpp itself ignores it (both plugins send it);
/// * `timings_per_token`: timings come with the final result.
///
/// `id_slot` is echoed, not honoured: there are no slots to pin; a
/// tenant's requests find their cached prefix wherever it is (by tokens).
pub const IGNORED: &[&str] = &["cache_prompt", "t_max_prompt_ms", "timings_per_token"];

/// llama.cpp's sampler names; those not implemented here (`infill`, `dry`,
/// `penalties`, ...) are accepted and skipped, as in a chain where they
/// change nothing at their defaults.
const SAMPLERS: &[&str] = &["dry", "top_k", "top_p", "top_n_sigma", "typ_p", "min_p", "temperature", "xtc", "infill", "penalties", "adaptive_p"];

/// The first field of `body` neither read nor ignored here.
pub fn unknown_field(body: &Map<String, Value>) -> Option<&str> {
    body.keys().map(String::as_str).find(|k| !FIELDS.contains(k) && !IGNORED.contains(k))
}

#[derive(Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize)]
pub struct Chunk {
    pub text: String,
    pub filename: Option<String>,
    /// llama.vim and llama.vscode send when the chunk was read; not used.
    #[serde(default, rename = "time")]
    _time: Option<serde::de::IgnoredAny>,
}

#[derive(Deserialize)]
pub struct Body {
    pub prompt: Option<Value>,
    pub input_prefix: Option<String>,
    pub input_suffix: Option<String>,
    pub input_extra: Option<Vec<Chunk>>,
    pub n_predict: Option<i64>,
    pub max_tokens: Option<i64>,
    #[serde(default)]
    pub stream: bool,
    pub temperature: Option<f32>,
    pub top_k: Option<i64>,
    pub top_p: Option<f32>,
    pub min_p: Option<f32>,
    pub seed: Option<i64>,
    pub stop: Option<Stop>,
    pub samplers: Option<Value>,
    #[serde(default)]
    pub n_indent: u32,
    #[serde(default)]
    pub t_max_predict_ms: u64,
    pub response_fields: Option<Vec<String>>,
    pub n_cmpl: Option<u32>,
    pub n: Option<u32>,
    pub model: Option<String>,
    #[serde(default)]
    pub ignore_eos: bool,
    #[serde(default)]
    pub return_tokens: bool,
    pub n_probs: Option<u32>,
    pub lora: Option<Vec<Value>>,
    pub id_slot: Option<i64>,
    /// Constrain the output to JSON valid against this schema (llama.cpp
    /// turns it into a GBNF grammar; here it is protocol v1's
    /// `response_format`). llama.cpp's `grammar` (GBNF) is not supported.
    pub json_schema: Option<Value>,
}

/// How many tokens to generate.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Predict {
    /// `n_predict` 0: evaluate the prompt into the cache, generate nothing.
    WarmOnly,
    /// -1 (the default): until the context is full.
    Unlimited,
    Tokens(u32),
}

/// What the edge does beside the engine request.
pub struct Options {
    pub predict: Predict,
    pub stream: bool,
    /// End at the first generated line indented less than this (0: off).
    pub n_indent: usize,
    /// End at the next newline once generating took this long.
    pub t_max_predict: Option<Duration>,
    pub response_fields: Option<Vec<String>>,
    pub ignore_eos: bool,
    pub return_tokens: bool,
    pub id_slot: i64,
    /// The sampler chain as applied, for `generation_settings`.
    pub samplers: Vec<String>,
}

/// A parameter error (llama.cpp's `invalid_request_error`).
pub struct Invalid(pub String);

fn invalid<T>(m: impl Into<String>) -> Result<T, Invalid> {
    Err(Invalid(m.into()))
}

/// Which endpoint a body came to.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Completion,
    Infill,
}

impl Body {
    /// The protocol request (its id `request_id`) and the edge's options.
    pub fn into_generate(self, endpoint: Endpoint, request_id: String, served_model: &str) -> Result<(GenerateRequest, Options), Invalid> {
        if self.model.as_deref().is_some_and(|m| !m.is_empty() && m != served_model) {
            return invalid(format!("model {:?} is not served here; this server serves {served_model:?}", self.model.unwrap_or_default()));
        }
        if self.lora.as_ref().is_some_and(|l| !l.is_empty()) {
            return invalid("LoRA adapters are not supported");
        }
        if self.n_probs.is_some_and(|n| n > 0) {
            return invalid("n_probs is not supported on this endpoint (only 0)");
        }
        let prompt = match self.prompt {
            None => String::new(),
            Some(Value::String(s)) => s,
            Some(_) => return invalid("prompt must be a string (token-id prompts are not supported)"),
        };
        let input = match endpoint {
            Endpoint::Completion => {
                if self.input_prefix.is_some() || self.input_suffix.is_some() || self.input_extra.is_some() {
                    return invalid("input_prefix, input_suffix and input_extra belong to /infill");
                }
                if prompt.is_empty() {
                    return invalid("prompt is required and must not be empty");
                }
                GenerateInput::Prompt(prompt)
            }
            Endpoint::Infill => {
                let (Some(prefix), Some(suffix)) = (self.input_prefix, self.input_suffix) else {
                    return invalid("input_prefix and input_suffix are required (strings, may be empty)");
                };
                let extra = self.input_extra.unwrap_or_default().into_iter().map(|c| FimExtra { path: c.filename, content: c.text }).collect();
                // llama.cpp appends `prompt` (the cursor line's text) to the prefix.
                GenerateInput::Fim(FimInput { prefix: prefix + &prompt, suffix, extra })
            }
        };
        let predict = match self.n_predict.or(self.max_tokens).unwrap_or(-1) {
            -1 => Predict::Unlimited,
            0 => Predict::WarmOnly,
            n if n > 0 && n <= u32::MAX as i64 => Predict::Tokens(n as u32),
            n => return invalid(format!("n_predict must be -1, 0 or a positive count, got {n}")),
        };
        // More than one completion per request: llama.vscode asks for 3 and
        // takes either an array or one object; one is answered.
        if self.n_cmpl.or(self.n) == Some(0) {
            return invalid("n_cmpl must be at least 1");
        }
        let samplers: Vec<String> = match self.samplers {
            None => ["top_k", "top_p", "min_p", "temperature"].map(String::from).to_vec(),
            Some(Value::Array(names)) => {
                let mut out = Vec::new();
                for n in names {
                    match n.as_str() {
                        Some(s) if SAMPLERS.contains(&s) => out.push(s.to_string()),
                        _ => return invalid(format!("unknown sampler {n}: expected one of {}", SAMPLERS.join(", "))),
                    }
                }
                out
            }
            Some(_) => return invalid("samplers must be a list of names (the one-letter string form is not supported)"),
        };
        let uses = |name: &str| samplers.iter().any(|s| s == name);
        let mut req = GenerateRequest::new(request_id, input);
        // llama.cpp's defaults: sampled at 0.8 with top_k 40, top_p 0.95, min_p 0.05.
        req.temperature = self.temperature.unwrap_or(0.8).max(0.0);
        let top_k = self.top_k.unwrap_or(40);
        if top_k < 0 {
            return invalid(format!("top_k must be 0 (off) or positive, got {top_k}"));
        }
        req.top_k = (uses("top_k") && top_k > 0).then_some(top_k.min(u32::MAX as i64) as u32);
        req.top_p = Some(self.top_p.unwrap_or(0.95)).filter(|&p| uses("top_p") && p < 1.0);
        req.min_p = Some(self.min_p.unwrap_or(0.05)).filter(|&p| uses("min_p") && p > 0.0);
        req.seed = self.seed.filter(|&s| s >= 0).map(|s| s as u64);
        req.stop = match self.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s],
            Some(Stop::Many(v)) => v,
        };
        if let Predict::Tokens(n) = predict {
            req.max_tokens = n;
        }
        req.response_format = match self.json_schema {
            None => None,
            Some(schema @ (Value::Object(_) | Value::Bool(_))) => Some(ResponseFormat::JsonSchema { schema }),
            Some(_) => return invalid("json_schema must be a JSON Schema object"),
        };
        let options = Options {
            predict,
            stream: self.stream,
            n_indent: self.n_indent as usize,
            t_max_predict: (self.t_max_predict_ms > 0).then(|| Duration::from_millis(self.t_max_predict_ms)),
            response_fields: self.response_fields,
            ignore_eos: self.ignore_eos,
            return_tokens: self.return_tokens,
            id_slot: self.id_slot.unwrap_or(-1),
            samplers,
        };
        Ok((req, options))
    }
}
