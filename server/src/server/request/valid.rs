//! [`ValidGenerate`]: a `generate` that passed every check this server
//! makes, whichever edge it came from. Its one constructor,
//! [`ValidGenerate::new`], holds the request to the server's
//! [`GenerateLimits`] in a fixed order: the protocol's own ranges
//! (`GenerateRequest::validate`), `max_tokens` against the limits, what
//! this server can serve (a draft model, fill-in-the-middle), then, once
//! tokenized, the prompt against the context, its length settled, and its
//! constraint compiled.
//!
//! It does not parse a wire: each edge reads its own fields (and their
//! types, and limits only its API has, such as Anthropic's temperature in
//! [0, 1]) into a `GenerateRequest`, and maps the typed [`Refused`] into its
//! own shape through its `EdgeError`. The key decision: every limit is
//! worded here once, so an edge cannot drift from another, and a request the
//! engine sees cannot have skipped a check (the engine request is built
//! only from a `ValidGenerate`).
use protocol::{DraftSourceName, ErrorCode, GenerateInput, GenerateRequest, Limits, ProtocolError};

use crate::engine::constraint::Constraint;

/// How many tokens a request may generate.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Length {
    /// The request's `max_tokens`.
    #[default]
    AsAsked,
    /// Until the context is full (OpenAI's default when no limit is given),
    /// or `--default-max-tokens`, whichever comes first.
    FillContext,
    /// This many, or fewer where the context has less room (Anthropic's
    /// `max_tokens`: a large one is a ceiling, not an error).
    UpTo(u32),
    /// None: the prompt only warms the prefix cache.
    WarmOnly,
}

/// The server's limits a `generate` is held to.
#[derive(Clone, Debug)]
pub struct GenerateLimits {
    /// As announced in `session.ready`: `max_tokens`, `max_prompt_tokens`, `context_length`.
    pub limits: Limits,
    /// The cap of a request that names none (`--default-max-tokens`).
    pub default_max_tokens: u32,
    /// A draft model is loaded, so `speculation.source: "draft_model"` is served.
    pub has_draft_model: bool,
    /// The model has fill-in-the-middle tokens, so `fim` input is served.
    pub has_fim: bool,
}

/// What checking a request asks of the model it is for: the verdicts of
/// its tokenizer and grammar engine, which only the model can give.
pub trait ModelChecks {
    /// The token ids of `req`'s input.
    fn prompt_ids(&mut self, req: &GenerateRequest) -> Result<Vec<u32>, ProtocolError>;
    /// `req`'s constraint (its tools' grammar or `response_format`)
    /// compiled; an error names the field and says why.
    fn constraint(&mut self, req: &GenerateRequest) -> Result<Option<Constraint>, ProtocolError>;
}

/// Why a `generate` was refused: one variant per limit, each worded once.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum Refused {
    /// A field out of its range or badly formed: the protocol's own checks
    /// (`GenerateRequest::validate`), in its words.
    #[error("{0}")]
    Field(String),
    #[error("max_tokens must be in [0, {max}], got {got}")]
    MaxTokens { max: u32, got: u32 },
    /// `max_tokens` alone fills the context: even a one-token prompt would not fit.
    #[error("max_tokens {max_tokens} leaves no room for the prompt in the {context}-token context")]
    NoRoomForPrompt { max_tokens: u32, context: u32 },
    #[error("speculation.source \"draft_model\": this server has no draft model (start it with --draft-model)")]
    NoDraftModel,
    #[error("this model has no fill-in-the-middle tokens (model.fim is false); send `prompt` or `messages`")]
    FimUnsupported,
    #[error("prompt is {tokens} tokens, the limit is {max}")]
    PromptTooLong { tokens: usize, max: u32 },
    #[error("prompt ({prompt} tokens) + max_tokens ({max_tokens}) = {total} exceeds the context length {context}", total = sum(.prompt, .max_tokens))]
    ContextOverflow { prompt: usize, max_tokens: u32, context: u32 },
    /// A length settled by the server (not asked) finds the context full.
    #[error("the prompt ({prompt} tokens) leaves no room to generate in the {context}-token context")]
    NoRoomToGenerate { prompt: usize, context: u32 },
    /// The model's tokenizer or grammar engine refused the input (a chat
    /// template that raised, an empty input, a schema it cannot compile),
    /// with its own code and words.
    #[error("{}", .0.message)]
    Model(ProtocolError),
}

/// A prompt's and a length's tokens together, past any overflow.
fn sum(prompt: &usize, max_tokens: &u32) -> u64 {
    *prompt as u64 + u64::from(*max_tokens)
}

impl Refused {
    /// The protocol's code for this refusal.
    pub fn code(&self) -> ErrorCode {
        match self {
            Refused::Field(_) | Refused::MaxTokens { .. } | Refused::NoDraftModel => ErrorCode::InvalidParameter,
            Refused::NoRoomForPrompt { .. } | Refused::ContextOverflow { .. } | Refused::NoRoomToGenerate { .. } => ErrorCode::ContextOverflow,
            Refused::PromptTooLong { .. } => ErrorCode::PromptTooLong,
            Refused::FimUnsupported => ErrorCode::FimUnsupported,
            Refused::Model(e) => e.code,
        }
    }

    /// The refusal as the protocol's error of request `request_id`, which
    /// each edge maps into its own shape.
    pub fn for_request(self, request_id: &str) -> ProtocolError {
        ProtocolError::new(self.code(), self.to_string()).with_request_id(request_id)
    }
}

/// A `generate` that passed every check, its prompt tokenized and its
/// `max_tokens` settled; the only input the engine request is built from.
pub struct ValidGenerate {
    request: GenerateRequest,
    prompt: Vec<u32>,
    constraint: Option<Constraint>,
}

impl ValidGenerate {
    /// Checks `req` against `limits`, tokenizing and compiling it with
    /// `model`, and settles its length as `length` says. The checks that
    /// need no tokens come first, so a request refused by them costs none.
    pub fn new(mut req: GenerateRequest, length: Length, limits: &GenerateLimits, model: &mut impl ModelChecks) -> Result<ValidGenerate, Refused> {
        if length != Length::AsAsked {
            // Settled once the prompt's length is known; 0 holds the checks to the prompt.
            req.max_tokens = 0;
        }
        req.validate().map_err(|e| Refused::Field(e.message))?;
        let l = &limits.limits;
        if req.max_tokens > l.max_tokens {
            return Err(Refused::MaxTokens { max: l.max_tokens, got: req.max_tokens });
        }
        if req.max_tokens >= l.context_length {
            return Err(Refused::NoRoomForPrompt { max_tokens: req.max_tokens, context: l.context_length });
        }
        if req.speculation.and_then(|s| s.source) == Some(DraftSourceName::DraftModel) && !limits.has_draft_model {
            return Err(Refused::NoDraftModel);
        }
        if matches!(req.input, GenerateInput::Fim(_)) && !limits.has_fim {
            return Err(Refused::FimUnsupported);
        }
        let prompt = model.prompt_ids(&req).map_err(Refused::Model)?;
        req.max_tokens = settle(req.max_tokens, length, prompt.len(), limits)?;
        let constraint = model.constraint(&req).map_err(Refused::Model)?;
        Ok(ValidGenerate { request: req, prompt, constraint })
    }

    /// The request (its `max_tokens` as settled), its prompt's token ids
    /// and its compiled constraint.
    pub fn into_parts(self) -> (GenerateRequest, Vec<u32>, Option<Constraint>) {
        (self.request, self.prompt, self.constraint)
    }
}

/// The prompt of `prompt` tokens against the context, and how many tokens
/// the request generates: `asked` as asked, or as many as `length` allows
/// in the room the prompt leaves.
fn settle(asked: u32, length: Length, prompt: usize, limits: &GenerateLimits) -> Result<u32, Refused> {
    let l = &limits.limits;
    if prompt > l.max_prompt_tokens as usize {
        return Err(Refused::PromptTooLong { tokens: prompt, max: l.max_prompt_tokens });
    }
    if sum(&prompt, &asked) > u64::from(l.context_length) {
        return Err(Refused::ContextOverflow { prompt, max_tokens: asked, context: l.context_length });
    }
    let ceiling = match length {
        Length::AsAsked | Length::WarmOnly => return Ok(asked),
        Length::FillContext => limits.default_max_tokens.min(l.max_tokens),
        Length::UpTo(n) => n.min(l.max_tokens),
    };
    let room = (l.context_length as usize).saturating_sub(prompt);
    match room.min(ceiling as usize) {
        0 => Err(Refused::NoRoomToGenerate { prompt, context: l.context_length }),
        // At most `ceiling`, a u32.
        n => Ok(n as u32),
    }
}

#[cfg(test)]
mod tests;
