//! llama.cpp's result objects, and this edge's relay writer.
//!
//! The writer applies the editor cut-offs llama.cpp's `/infill` has:
//! * `n_indent`: a generated line (after the first) indented less than the
//!   cursor's line ends the completion before its first non-blank
//!   character, so a completion never runs out of the block being edited.
//!   Leading whitespace of a line is held back until that is known.
//! * `t_max_predict_ms`: once generating took this long, the completion
//!   ends at the next newline (so it ends on a whole line).
//!
//! Either ends the turn as a stop string would: the KV state stays cached
//! for the next keystroke's request.
use std::time::Instant;

use protocol::FinishReason;
use serde_json::{json, Map, Value};

use super::super::http::edge::{self, Events};
use super::super::relay::{Ending, Finished, Piece, Writer};
use super::wire::Options;
use super::LlamaError;
use crate::engine::{StopHandle, StopReason};

/// What the final result repeats of the request.
pub struct Settings {
    pub model: String,
    pub n_ctx: u32,
    pub prompt_tokens: usize,
    pub max_tokens: u32,
    pub temperature: f32,
    pub top_k: Option<u32>,
    pub top_p: Option<f32>,
    pub min_p: Option<f32>,
    pub seed: Option<u64>,
    pub stop: Vec<String>,
}

pub struct EditorWriter {
    options: Options,
    settings: Settings,
    stop: StopHandle,
    /// Server-sent events when streaming.
    events: Option<Events<LlamaError>>,
    content: String,
    /// Whitespace starting a generated line, held until its indent is known.
    held: String,
    /// In the leading whitespace of a line after a generated newline.
    line_start: bool,
    first_token: Option<Instant>,
    /// A cut-off ended the completion: later tokens are dropped.
    cut: bool,
    tokens: Vec<u32>,
    ending: Option<Ending>,
}

impl EditorWriter {
    pub fn new(options: Options, settings: Settings, stop: StopHandle, events: Option<Events<LlamaError>>) -> Self {
        EditorWriter {
            options,
            settings,
            stop,
            events,
            content: String::new(),
            held: String::new(),
            line_start: false,
            first_token: None,
            cut: false,
            tokens: Vec::new(),
            ending: None,
        }
    }

    fn cut_here(&mut self) {
        self.cut = true;
        self.stop.stop(StopReason::StopString);
    }

    /// The part of `text` to show, applying the cut-offs.
    fn visible(&mut self, text: &str) -> String {
        let mut out = String::new();
        for ch in text.chars() {
            if self.line_start {
                match ch {
                    ' ' | '\t' => {
                        self.held.push(ch);
                        continue;
                    }
                    '\n' => {
                        out.push_str(&std::mem::take(&mut self.held));
                        out.push('\n');
                        continue;
                    }
                    _ => {
                        let indent = self.held.chars().count();
                        out.push_str(&std::mem::take(&mut self.held));
                        self.line_start = false;
                        if indent < self.options.n_indent {
                            self.cut_here();
                            return out;
                        }
                    }
                }
            }
            out.push(ch);
            if ch == '\n' && self.options.n_indent > 0 {
                self.line_start = true;
            }
        }
        if let (Some(limit), Some(first)) = (self.options.t_max_predict, self.first_token) {
            if text.contains('\n') && first.elapsed() > limit {
                self.cut_here();
            }
        }
        out
    }

    async fn send(&mut self, v: &Value) -> bool {
        match &mut self.events {
            Some(events) => events.send(None, v).await,
            None => true,
        }
    }

    fn stop_type(&self, f: &Finished) -> &'static str {
        match f.reason {
            _ if self.cut => "limit",
            FinishReason::Length | FinishReason::TimeLimit => "limit",
            FinishReason::Stop if f.stop_string.is_some() => "word",
            // (This edge offers no tools, so no call ends its turns.)
            FinishReason::Stop | FinishReason::ToolCalls => "eos",
            FinishReason::Cancelled => "none",
        }
    }

    /// The final result object (all of it; `response_fields` picks later).
    fn result(&self, f: &Finished, content: &str) -> Value {
        let s = &self.settings;
        let (prompt_n, cache_n) = (f.usage.prompt_tokens.saturating_sub(f.usage.cached_tokens), f.usage.cached_tokens);
        let predicted_n = f.usage.completion_tokens;
        let prompt_ms = f.timing.ttft_ms.saturating_sub(f.timing.queue_ms) as f64;
        let predicted_ms = f.timing.total_ms.saturating_sub(f.timing.ttft_ms) as f64;
        let per = |ms: f64, n: u32| if n > 0 { ms / n as f64 } else { 0.0 };
        let rate = |ms: f64, n: u32| if ms > 0.0 { n as f64 * 1e3 / ms } else { 0.0 };
        json!({
            "index": 0,
            "content": content,
            "tokens": if self.options.return_tokens { self.tokens.clone() } else { Vec::new() },
            "id_slot": self.options.id_slot,
            "stop": true,
            "model": s.model,
            "tokens_predicted": predicted_n,
            "tokens_evaluated": f.usage.prompt_tokens,
            "generation_settings": {
                "n_ctx": s.n_ctx,
                "n_predict": s.max_tokens,
                "temperature": s.temperature,
                "top_k": s.top_k.unwrap_or(0),
                "top_p": s.top_p.unwrap_or(1.0),
                "min_p": s.min_p.unwrap_or(0.0),
                "seed": s.seed.map_or(-1, |v| v as i64),
                "stop": s.stop,
                "samplers": self.options.samplers,
                "n_indent": self.options.n_indent,
                "t_max_predict_ms": self.options.t_max_predict.map_or(0, |d| d.as_millis() as u64),
                "ignore_eos": self.options.ignore_eos,
                "stream": self.options.stream,
                "cache_prompt": true,
            },
            "has_new_line": self.content.contains('\n'),
            "truncated": false,
            "stop_type": self.stop_type(f),
            "stopping_word": "",
            "tokens_cached": s.prompt_tokens + predicted_n as usize,
            "timings": {
                "cache_n": cache_n,
                "prompt_n": prompt_n,
                "prompt_ms": prompt_ms,
                "prompt_per_token_ms": per(prompt_ms, prompt_n),
                "prompt_per_second": rate(prompt_ms, prompt_n),
                "predicted_n": predicted_n,
                "predicted_ms": predicted_ms,
                "predicted_per_token_ms": per(predicted_ms, predicted_n),
                "predicted_per_second": rate(predicted_ms, predicted_n),
            },
        })
    }

    /// The whole answer of a request that did not stream.
    pub fn into_result(mut self) -> Result<Value, LlamaError> {
        match self.ending.take() {
            Some(Ok(f)) => Ok(pick_fields(self.result(&f, &self.content), self.options.response_fields.as_deref())),
            Some(Err(e)) => Err(edge::failed(e)),
            None => Err(LlamaError::server("the request ended without an answer")),
        }
    }
}

/// `response_fields`: only the named paths (`"timings/prompt_n"`), each
/// under its full path as the key, as llama.cpp answers.
fn pick_fields(result: Value, fields: Option<&[String]>) -> Value {
    let Some(fields) = fields else { return result };
    let mut out = Map::new();
    for path in fields {
        let found = path.split('/').try_fold(&result, |v, key| v.get(key));
        if let Some(v) = found.filter(|_| !path.is_empty()) {
            out.insert(path.clone(), v.clone());
        }
    }
    Value::Object(out)
}

impl Writer for EditorWriter {
    async fn piece(&mut self, piece: Piece) -> bool {
        if self.cut {
            return true;
        }
        self.first_token.get_or_insert_with(Instant::now);
        self.tokens.extend_from_slice(&piece.token_ids);
        let text = self.visible(&piece.text);
        self.content.push_str(&text);
        if self.events.is_none() || (text.is_empty() && piece.token_ids.is_empty()) {
            return true;
        }
        let partial = json!({
            "index": 0,
            "content": text,
            "tokens": if self.options.return_tokens { piece.token_ids } else { Vec::new() },
            "stop": false,
            "id_slot": self.options.id_slot,
            "tokens_predicted": self.tokens.len(),
            "tokens_evaluated": self.settings.prompt_tokens,
        });
        self.send(&partial).await
    }

    async fn end(&mut self, ending: Ending) {
        // Whitespace held at the end is part of the text (nothing followed it).
        let held = std::mem::take(&mut self.held);
        self.content.push_str(&held);
        match (ending, &mut self.events) {
            (ending, None) => self.ending = Some(ending),
            (Ok(f), Some(_)) => {
                let last = pick_fields(self.result(&f, &held), self.options.response_fields.as_deref());
                self.send(&last).await;
            }
            (Err(e), Some(events)) => events.fail(edge::failed(e), None).await,
        }
    }
}
