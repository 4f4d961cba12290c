//! Serde shims. On the wire, `generate` is one flat object with `prompt`,
//! `messages` or `fim` side by side; [`GenerateRequest`] holds whichever was
//! given as one `input`. Its `Serialize`, `Deserialize` and `JsonSchema` impls
//! here all go through that flat form, [`GenerateWire`].

use std::fmt;

use schemars::JsonSchema;
use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::messages::{
    CacheScopeName, ChatMessage, FimInput, GenerateInput, GenerateRequest, ResponseFormat, SpeculationOptions, Tool, ToolChoice, DEFAULT_MAX_TOKENS,
};

/// The flat wire form of `generate` (what the JSON looks like).
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(
    title = "GenerateRequest",
    description = "`generate`: start a request. Exactly one of `prompt`, `messages`, `fim` is required.",
    extend("oneOf" = [
        {"required": ["prompt"]},
        {"required": ["messages"]},
        {"required": ["fim"]},
    ])
)]
struct GenerateWire {
    /// Client-chosen id, unique within the session.
    #[schemars(length(min = 1, max = 64), regex(pattern = r"^[A-Za-z0-9._:-]+$"))]
    request_id: String,
    /// Raw prompt text (no chat template).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    prompt: Option<String>,
    /// Chat messages, rendered with the model's chat template.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1))]
    messages: Option<Vec<ChatMessage>>,
    /// Fill-in-the-middle input.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    fim: Option<FimInput>,
    /// Most tokens to generate (at most `limits.max_tokens`); 0 pre-warms the session's cache.
    #[serde(default = "default_max_tokens")]
    #[schemars(range(min = 0))]
    max_tokens: u32,
    /// Sampling temperature; 0 = greedy.
    #[serde(default)]
    #[schemars(range(min = 0.0, max = 2.0))]
    temperature: f32,
    /// Nucleus sampling mass, in (0, 1].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(max = 1.0), extend("exclusiveMinimum" = 0))]
    top_p: Option<f32>,
    /// Top-k; 0 = off.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 1000))]
    top_k: Option<u32>,
    /// Min-p, in [0, 1].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.0, max = 1.0))]
    min_p: Option<f32>,
    /// RNG seed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    seed: Option<u64>,
    /// Stop sequences, each 1..=64 UTF-8 bytes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 8), inner(length(min = 1)))]
    stop: Vec<String>,
    /// Return per-token log-probabilities.
    #[serde(default, skip_serializing_if = "is_false")]
    logprobs: bool,
    /// Alternatives per token (0..=20); requires `logprobs: true`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(max = 20))]
    top_logprobs: Option<u8>,
    /// Cap on generation wall time, ms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    max_time_ms: Option<u32>,
    /// Prefill chunk size, tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    chunk_size: Option<u32>,
    /// Speculative decoding; omitted = the server's default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    speculation: Option<SpeculationOptions>,
    /// Prefix-cache scope this request's state is stored in: `session` (default) or `shared`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    cache: Option<CacheScopeName>,
    /// Constrain the output: `{type: "json_schema", schema}`, `{type: "json_object"}`, `{type: "regex", pattern}`, `{type: "grammar", lark}` or `{type: "text"}`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    response_format: Option<ResponseFormat>,
    /// Functions the model may call (`messages` input only): `{name, description, parameters}`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 128))]
    tools: Vec<Tool>,
    /// `"auto"` (default), `"none"`, `"required"`, or `{"type": "function", "name"}`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    tool_choice: Option<ToolChoice>,
    /// Whether one answer may hold several calls (default true).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    parallel_tool_calls: Option<bool>,
}

fn default_max_tokens() -> u32 {
    DEFAULT_MAX_TOKENS
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// Why a wire `generate` couldn't become a [`GenerateRequest`] (a field error).
#[derive(Debug)]
struct InputChoiceError(String);

impl fmt::Display for InputChoiceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl TryFrom<GenerateWire> for GenerateRequest {
    type Error = InputChoiceError;

    fn try_from(w: GenerateWire) -> Result<Self, Self::Error> {
        let input = match (w.prompt, w.messages, w.fim) {
            (Some(p), None, None) => GenerateInput::Prompt(p),
            (None, Some(m), None) => GenerateInput::Messages(m),
            (None, None, Some(f)) => GenerateInput::Fim(f),
            (p, m, f) => {
                let given: Vec<&str> = [("`prompt`", p.is_some()), ("`messages`", m.is_some()), ("`fim`", f.is_some())]
                    .into_iter()
                    .filter_map(|(n, on)| on.then_some(n))
                    .collect();
                let got = if given.is_empty() { "none".to_string() } else { given.join(" and ") };
                return Err(InputChoiceError(format!("exactly one of `prompt`, `messages` or `fim` is required, got {got}")));
            }
        };
        Ok(GenerateRequest {
            request_id: w.request_id,
            input,
            max_tokens: w.max_tokens,
            temperature: w.temperature,
            top_p: w.top_p,
            top_k: w.top_k,
            min_p: w.min_p,
            seed: w.seed,
            stop: w.stop,
            logprobs: w.logprobs,
            top_logprobs: w.top_logprobs,
            max_time_ms: w.max_time_ms,
            chunk_size: w.chunk_size,
            speculation: w.speculation,
            cache: w.cache,
            response_format: w.response_format,
            tools: w.tools,
            tool_choice: w.tool_choice,
            parallel_tool_calls: w.parallel_tool_calls,
            continue_final_message: false,
        })
    }
}

impl From<GenerateRequest> for GenerateWire {
    fn from(r: GenerateRequest) -> Self {
        let (prompt, messages, fim) = match r.input {
            GenerateInput::Prompt(p) => (Some(p), None, None),
            GenerateInput::Messages(m) => (None, Some(m), None),
            GenerateInput::Fim(f) => (None, None, Some(f)),
        };
        GenerateWire {
            request_id: r.request_id,
            prompt,
            messages,
            fim,
            max_tokens: r.max_tokens,
            temperature: r.temperature,
            top_p: r.top_p,
            top_k: r.top_k,
            min_p: r.min_p,
            seed: r.seed,
            stop: r.stop,
            logprobs: r.logprobs,
            top_logprobs: r.top_logprobs,
            max_time_ms: r.max_time_ms,
            chunk_size: r.chunk_size,
            speculation: r.speculation,
            cache: r.cache,
            response_format: r.response_format,
            tools: r.tools,
            tool_choice: r.tool_choice,
            parallel_tool_calls: r.parallel_tool_calls,
        }
    }
}

impl Serialize for GenerateRequest {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        GenerateWire::from(self.clone()).serialize(s)
    }
}

impl<'de> Deserialize<'de> for GenerateRequest {
    // Field errors come from `GenerateWire`, a bad input choice as a custom error.
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        GenerateRequest::try_from(GenerateWire::deserialize(d)?).map_err(D::Error::custom)
    }
}

impl JsonSchema for GenerateRequest {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "GenerateRequest".into()
    }

    fn json_schema(generator: &mut schemars::SchemaGenerator) -> schemars::Schema {
        GenerateWire::json_schema(generator)
    }
}
