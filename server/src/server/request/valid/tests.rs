//! Each limit of [`ValidGenerate::new`] refused with its own [`Refused`] at
//! one past its boundary and accepted at it; the length settled for each
//! [`Length`]; the model's verdicts passed through with their codes. The
//! model is played by a prompt of a chosen length (the tokenizer and the
//! grammar engine have tests of their own).
use protocol::{DraftSourceName, ErrorCode, FimInput, GenerateInput, GenerateRequest, Limits, ProtocolError, SpeculationOptions};

use super::{GenerateLimits, Length, ModelChecks, Refused, ValidGenerate};
use crate::engine::constraint::Constraint;

/// A prompt of `tokens` tokens; `refuse` is the tokenizer's verdict when set.
struct Prompt {
    tokens: usize,
    refuse: Option<ProtocolError>,
    /// How often the input was tokenized.
    tokenized: usize,
}

impl ModelChecks for Prompt {
    fn prompt_ids(&mut self, _: &GenerateRequest) -> Result<Vec<u32>, ProtocolError> {
        self.tokenized += 1;
        self.refuse.clone().map_or(Ok(vec![7; self.tokens]), Err)
    }

    fn constraint(&mut self, _: &GenerateRequest) -> Result<Option<Constraint>, ProtocolError> {
        Ok(None)
    }
}

fn prompt(tokens: usize) -> Prompt {
    Prompt { tokens, refuse: None, tokenized: 0 }
}

/// A server of a 4096-token context, prompts up to 3000, `max_tokens` up to
/// 1024, 512 when a request names none.
fn limits() -> GenerateLimits {
    let limits = Limits {
        max_frame_bytes: 1 << 20,
        max_prompt_tokens: 3000,
        max_tokens: 1024,
        max_in_flight: 4,
        session_ttl_ms: 60_000,
        idle_timeout_ms: 30_000,
        context_length: 4096,
    };
    GenerateLimits { limits, default_max_tokens: 512, has_draft_model: false, has_fim: false }
}

fn request(max_tokens: u32) -> GenerateRequest {
    GenerateRequest { max_tokens, ..GenerateRequest::new("r1", GenerateInput::Prompt("x".into())) }
}

/// `req` checked as asked with a prompt of `tokens` tokens.
fn check(req: GenerateRequest, tokens: usize) -> Result<ValidGenerate, Refused> {
    ValidGenerate::new(req, Length::AsAsked, &limits(), &mut prompt(tokens))
}

/// The `max_tokens` `length` settles on for a prompt of `tokens` tokens.
fn settled(length: Length, asked: u32, tokens: usize, limits: &GenerateLimits) -> Result<u32, Refused> {
    ValidGenerate::new(request(asked), length, limits, &mut prompt(tokens)).map(|v| v.into_parts().0.max_tokens)
}

#[test]
fn max_tokens_is_held_to_the_servers_limit() {
    assert_eq!(check(request(1024), 1).unwrap().into_parts().0.max_tokens, 1024);
    let e = check(request(1025), 1).err().unwrap();
    assert_eq!(e, Refused::MaxTokens { max: 1024, got: 1025 });
    assert_eq!((e.code(), e.to_string().as_str()), (ErrorCode::InvalidParameter, "max_tokens must be in [0, 1024], got 1025"));
}

#[test]
fn max_tokens_must_leave_room_for_a_prompt() {
    let small = GenerateLimits { limits: Limits { max_tokens: 8192, context_length: 2048, ..limits().limits }, ..limits() };
    let e = ValidGenerate::new(request(2048), Length::AsAsked, &small, &mut prompt(1)).err().unwrap();
    assert_eq!(e, Refused::NoRoomForPrompt { max_tokens: 2048, context: 2048 });
    assert_eq!(e.code(), ErrorCode::ContextOverflow);
    assert!(e.to_string().contains("2048-token context"), "{e}");
    assert!(ValidGenerate::new(request(2047), Length::AsAsked, &small, &mut prompt(1)).is_ok());
}

#[test]
fn the_prompt_is_held_to_its_limit_and_with_max_tokens_to_the_context() {
    assert_eq!(check(request(1000), 3000).unwrap().into_parts().1.len(), 3000);
    let e = check(request(1000), 3001).err().unwrap();
    assert_eq!(e, Refused::PromptTooLong { tokens: 3001, max: 3000 });
    assert_eq!((e.code(), e.to_string().as_str()), (ErrorCode::PromptTooLong, "prompt is 3001 tokens, the limit is 3000"));

    let wide = GenerateLimits { limits: Limits { max_prompt_tokens: 4096, ..limits().limits }, ..limits() };
    let asked = |max_tokens| ValidGenerate::new(request(max_tokens), Length::AsAsked, &wide, &mut prompt(3072));
    assert!(asked(1024).is_ok(), "3072 + 1024 fills the context exactly");
    let e = ValidGenerate::new(request(1024), Length::AsAsked, &wide, &mut prompt(3073)).err().unwrap();
    assert_eq!(e, Refused::ContextOverflow { prompt: 3073, max_tokens: 1024, context: 4096 });
    assert_eq!(e.code(), ErrorCode::ContextOverflow);
    assert_eq!(e.to_string(), "prompt (3073 tokens) + max_tokens (1024) = 4097 exceeds the context length 4096");
}

#[test]
fn a_draft_model_or_fill_in_the_middle_is_refused_where_the_server_has_none() {
    let draft = GenerateRequest { speculation: Some(SpeculationOptions { source: Some(DraftSourceName::DraftModel), max_draft: None }), ..request(8) };
    let mut model = prompt(4);
    let e = ValidGenerate::new(draft.clone(), Length::AsAsked, &limits(), &mut model).err().unwrap();
    assert_eq!((e.code(), e.clone()), (ErrorCode::InvalidParameter, Refused::NoDraftModel));
    assert!(e.to_string().contains("--draft-model"), "{e}");
    let fim = GenerateRequest { input: GenerateInput::Fim(FimInput { prefix: "a".into(), suffix: "b".into(), extra: Vec::new() }), ..request(8) };
    let e = ValidGenerate::new(fim.clone(), Length::AsAsked, &limits(), &mut model).err().unwrap();
    assert_eq!((e.code(), e), (ErrorCode::FimUnsupported, Refused::FimUnsupported));
    assert_eq!(model.tokenized, 0, "refused before tokenizing");

    let able = GenerateLimits { has_draft_model: true, has_fim: true, ..limits() };
    assert!(ValidGenerate::new(draft, Length::AsAsked, &able, &mut model).is_ok());
    assert!(ValidGenerate::new(fim, Length::AsAsked, &able, &mut model).is_ok());
}

#[test]
fn field_ranges_are_the_protocols_checks_at_their_bounds() {
    let refused = |req: GenerateRequest| check(req, 1).err().unwrap();
    let field = |m: &str| Refused::Field(m.into());
    assert_eq!(refused(GenerateRequest { temperature: 2.01, ..request(8) }), field("temperature must be in [0, 2], got 2.01"));
    assert_eq!(refused(GenerateRequest { top_p: Some(0.0), ..request(8) }), field("top_p must be in (0, 1], got 0"));
    assert_eq!(refused(GenerateRequest { top_k: Some(1001), ..request(8) }), field("top_k must be in [0, 1000] (0 = off), got 1001"));
    assert_eq!(refused(GenerateRequest { min_p: Some(1.5), ..request(8) }), field("min_p must be in [0, 1], got 1.5"));
    assert_eq!(refused(GenerateRequest { stop: vec!["s".into(); 9], ..request(8) }), field("stop must have at most 8 entries, got 9"));
    assert_eq!(refused(GenerateRequest { stop: vec!["s".repeat(65)], ..request(8) }), field("stop[0] must be 1 to 64 bytes long, got 65 bytes"));
    assert_eq!(refused(GenerateRequest { logprobs: true, top_logprobs: Some(21), ..request(8) }), field("top_logprobs must be in [0, 20], got 21"));
    assert_eq!(refused(GenerateRequest { top_logprobs: Some(1), ..request(8) }), field("top_logprobs requires logprobs: true"));
    let at_bounds = GenerateRequest {
        temperature: 2.0,
        top_p: Some(1.0),
        top_k: Some(1000),
        min_p: Some(1.0),
        stop: vec!["s".repeat(64); 8],
        logprobs: true,
        top_logprobs: Some(20),
        ..request(8)
    };
    assert!(check(at_bounds, 1).is_ok());
}

#[test]
fn a_length_the_server_settles_fits_the_room_the_prompt_leaves() {
    let l = limits();
    // Asked lengths beyond the limit are not errors here: the edge's own
    // field, if any, was a ceiling, and FillContext names none.
    assert_eq!(settled(Length::FillContext, 100_000, 10, &l), Ok(512), "--default-max-tokens");
    assert_eq!(settled(Length::FillContext, 0, 3000, &l), Ok(512));
    assert_eq!(settled(Length::UpTo(100), 0, 10, &l), Ok(100));
    assert_eq!(settled(Length::UpTo(100_000), 0, 10, &l), Ok(1024), "the server's max_tokens");
    assert_eq!(settled(Length::WarmOnly, 50, 10, &l), Ok(0));
    assert_eq!(settled(Length::AsAsked, 50, 10, &l), Ok(50));

    let wide = GenerateLimits { limits: Limits { max_prompt_tokens: 4096, ..l.limits.clone() }, default_max_tokens: 4096, ..l };
    assert_eq!(settled(Length::FillContext, 0, 4095, &wide), Ok(1), "the room left");
    assert_eq!(settled(Length::UpTo(8), 0, 4090, &wide), Ok(6));
    let e = settled(Length::FillContext, 0, 4096, &wide).unwrap_err();
    assert_eq!(e, Refused::NoRoomToGenerate { prompt: 4096, context: 4096 });
    assert_eq!(e.code(), ErrorCode::ContextOverflow);
    assert_eq!(settled(Length::UpTo(1), 0, 4096, &wide), Err(e));
    assert_eq!(settled(Length::WarmOnly, 0, 4096, &wide), Ok(0), "a warm-up generates nothing, so needs no room");
}

#[test]
fn the_models_verdicts_keep_their_code_and_every_refusal_names_its_request() {
    let mut model = Prompt { refuse: Some(ProtocolError::invalid_parameter("the input is empty: it tokenizes to no tokens")), ..prompt(0) };
    let e = ValidGenerate::new(request(8), Length::AsAsked, &limits(), &mut model).err().unwrap();
    assert_eq!(e.code(), ErrorCode::InvalidParameter);
    let internal = ProtocolError::new(ErrorCode::Internal, "tokenizing the input failed: x");
    model.refuse = Some(internal.clone());
    let e = ValidGenerate::new(request(8), Length::AsAsked, &limits(), &mut model).err().unwrap();
    assert_eq!(e, Refused::Model(internal));
    assert_eq!(e.for_request("r1"), ProtocolError::new(ErrorCode::Internal, "tokenizing the input failed: x").with_request_id("r1"));
    let e = check(request(1025), 1).err().unwrap().for_request("r9");
    assert_eq!((e.code, e.request_id.as_deref()), (ErrorCode::InvalidParameter, Some("r9")));
}
