//! Structured outputs: a request's `response_format` (a JSON Schema, a
//! regular expression, a Lark grammar) compiled with llguidance into the
//! engine's [`Constraint`], a matcher over the model's token ids.
//!
//! llguidance (the grammar engine vLLM and SGLang also use) computes the set
//! of tokens that keep the output inside the grammar, walking a trie of the
//! vocabulary's bytes, in tens of microseconds a token; it also names the
//! tokens the grammar forces, which the engine verifies as drafts.
mod tok_env;
mod triggered;

use std::sync::{Arc, OnceLock};

use llguidance::api::{GrammarWithLexer, TopLevelGrammar};
use llguidance::toktrie::TokEnv;
use llguidance::{JsonCompileOptions, Matcher, ParserFactory, TokenParser};
use protocol::ResponseFormat;
use serde_json::{json, Value};

use crate::tokenizer::TextTokenizer;
use crate::tools::{self, CallGrammar};
use tether_sched::constraint::{Constraint, ConstraintSpec, TokenConstraint, TokenMask};
pub use tok_env::VocabEnv;
use triggered::Triggered;

/// Compiles response formats for one model. The vocabulary trie and
/// llguidance's tables (about a second for a 150k-token vocabulary on a
/// 2-core CPU) are built once, by [`Grammars::prepare`] in the background
/// at startup, or by the first request that needs them.
pub struct Grammars {
    tokenizer: Arc<TextTokenizer>,
    vocab: usize,
    factory: OnceLock<Result<ParserFactory, String>>,
}

impl Grammars {
    /// For a model with `vocab` logits per position.
    pub fn new(tokenizer: Arc<TextTokenizer>, vocab: usize) -> Grammars {
        Grammars { tokenizer, vocab, factory: OnceLock::new() }
    }

    /// Builds the vocabulary's tables now, so the first constrained request
    /// does not wait for them.
    pub fn prepare(&self) {
        let _ = self.factory();
    }

    fn factory(&self) -> Result<&ParserFactory, String> {
        self.factory
            .get_or_init(|| {
                let env: TokEnv = VocabEnv::build(self.tokenizer.clone(), self.vocab)?;
                let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
                factory.quiet();
                Ok(factory)
            })
            .as_ref()
            .map_err(Clone::clone)
    }

    /// The constraint of `format`; `None` for plain text. The error is the
    /// parser's own message (a bad schema, pattern or grammar), for the
    /// client.
    pub fn compile(&self, format: &ResponseFormat) -> Result<Option<Constraint>, String> {
        match format_grammar(format)? {
            None => Ok(None),
            Some(grammar) => self.build(TopLevelGrammar::from_grammar(grammar)).map(Some),
        }
    }

    /// The constraint of `tool_choice: "auto"` beside a `response_format`:
    /// `calls` ([`crate::tools::calls_or_answer_grammar`]) refers to the
    /// answer's grammar by name, and `format` is that grammar.
    pub fn compile_calls_or_answer(&self, calls: &str, format: &ResponseFormat) -> Result<Constraint, String> {
        let Some(mut answer) = format_grammar(format)? else { return Err("a plain-text response_format needs no grammar".into()) };
        answer.name = Some(tools::ANSWER_GRAMMAR.into());
        let grammars = vec![GrammarWithLexer::from_lark(calls.to_string()), answer];
        self.build(TopLevelGrammar { grammars, max_tokens: None })
    }

    /// The constraint of a request's tool calls ([`crate::tools::call_grammar`]).
    /// The error is llguidance's (a tool's parameters schema it rejects).
    pub fn compile_calls(&self, calls: &CallGrammar) -> Result<Constraint, String> {
        let inner = self.build(TopLevelGrammar::from_lark(calls.lark.clone()))?;
        Ok(match calls.trigger {
            Some(trigger) => Arc::new(Triggered { trigger, inner, vocab: self.vocab }),
            None => inner,
        })
    }

    fn build(&self, grammar: TopLevelGrammar) -> Result<Constraint, String> {
        let parser = self.factory()?.create_parser(grammar).map_err(|e| e.to_string())?;
        Ok(Arc::new(CompiledGrammar { parser }))
    }
}

/// The grammar of `format`; `None` for plain text.
fn format_grammar(format: &ResponseFormat) -> Result<Option<GrammarWithLexer>, String> {
    Ok(Some(match format {
        ResponseFormat::Text => return Ok(None),
        ResponseFormat::JsonObject => GrammarWithLexer::from_json_schema(with_json_style(json!({"type": "object"}))),
        ResponseFormat::JsonSchema { schema } => GrammarWithLexer::from_json_schema(with_json_style(schema_object(schema)?)),
        ResponseFormat::Regex { pattern } => GrammarWithLexer::from_regex(pattern),
        ResponseFormat::Grammar { lark } => GrammarWithLexer::from_lark(lark.clone()),
    }))
}

/// A boolean schema as the object schema it stands for.
fn schema_object(schema: &Value) -> Result<Value, String> {
    match schema {
        Value::Bool(true) => Ok(json!({})),
        Value::Bool(false) => Err("the schema `false` matches nothing".into()),
        other => Ok(other.clone()),
    }
}

/// JSON is written the way OpenAI's structured outputs write it (`", "` and
/// `": "` between items, no other whitespace) unless the schema says
/// otherwise in llguidance's `x-guidance` key. Free whitespace would let a
/// model pad its answer with newlines until `max_tokens`, and a fixed
/// layout leaves more tokens forced, which the engine then drafts.
pub fn with_json_style(mut schema: Value) -> Value {
    if let Some(obj) = schema.as_object_mut() {
        if !obj.contains_key("x-guidance") {
            let style =
                JsonCompileOptions { item_separator: ", ".into(), key_separator: ": ".into(), whitespace_flexible: false, ..JsonCompileOptions::default() };
            style.apply_to(&mut schema);
        }
    }
    schema
}

/// A grammar compiled for this model's vocabulary; each request gets its own copy.
struct CompiledGrammar {
    parser: TokenParser,
}

impl std::fmt::Debug for CompiledGrammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CompiledGrammar")
    }
}

impl ConstraintSpec for CompiledGrammar {
    fn start(&self) -> Result<Box<dyn TokenConstraint>, String> {
        let matcher = Matcher::new(Ok(self.parser.deep_clone()));
        let vocab = matcher.tok_env().map_err(message)?.tok_trie().vocab_size();
        Ok(Box::new(GrammarMatcher { matcher, vocab }))
    }
}

/// One request's position in its grammar.
struct GrammarMatcher {
    matcher: Matcher,
    /// The tokenizer's ids: llguidance stops a matcher asked about an id past them.
    vocab: usize,
}

fn message(e: impl std::fmt::Display) -> String {
    e.to_string()
}

impl TokenConstraint for GrammarMatcher {
    fn allowed(&mut self) -> Result<TokenMask, String> {
        let mask = self.matcher.compute_mask_or_eos().map_err(message)?;
        Ok(TokenMask { words: mask.as_slice().to_vec() })
    }

    fn accepts(&mut self, token: u32) -> Result<bool, String> {
        Ok((token as usize) < self.vocab && self.matcher.validate_tokens(&[token]).map_err(message)? == 1)
    }

    fn consume(&mut self, tokens: &[u32]) -> Result<(), String> {
        self.matcher.consume_tokens(tokens).map_err(message)
    }

    fn rollback(&mut self, n: usize) -> Result<(), String> {
        self.matcher.rollback(n).map_err(message)
    }

    fn forced(&mut self) -> Vec<u32> {
        self.matcher.compute_ff_tokens()
    }

    fn is_finished(&self) -> bool {
        self.matcher.is_stopped()
    }
}
