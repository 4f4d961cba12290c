//! `apply` alone: made-up draws in, decisions out; no model.
use std::time::{Duration, Instant};

use super::*;
use crate::constraint::testing::Exactly;
use crate::constraint::ConstraintSpec;
use crate::drafting::{Drafting, START_DEPTH};
use crate::progress::Limits;
use crate::request::RequestId;

/// A row that has read its 3-token prompt and has `pending` to feed.
fn decoding(max_tokens: usize, pending: TokenId) -> RequestProgress {
    let mut p = RequestProgress::new(RequestId(7), vec![1, 2, 3], Limits { max_tokens, stop_ids: vec![0], ..Default::default() });
    p.prefilled = 3;
    p.generated = 1;
    p.tokens.push(pending);
    p.pending_token = Some(pending);
    p
}

fn decode(drafts: &[TokenId]) -> Option<Work> {
    Some(Work::Decode { drafts: drafts.to_vec() })
}

fn sampled(row: usize, targets: &[TokenId]) -> StepOutput {
    StepOutput { sampled: vec![Sampled { row, targets: targets.to_vec(), logits: None }], constraint_failed: Vec::new() }
}

#[test]
fn a_decode_emits_its_draw_and_feeds_it_next() {
    let mut rows = [decoding(10, 5)];
    let applied = apply(&mut rows, &[decode(&[])], sampled(0, &[9]), Instant::now());
    assert_eq!(applied.updates, vec![RowUpdate { row: 0, tokens: vec![9], ..Default::default() }]);
    assert_eq!((rows[0].pending_token, rows[0].generated, rows[0].tokens.as_slice()), (Some(9), 2, &[1, 2, 3, 5, 9][..]));
    assert_eq!(applied.counts.generated_tokens, 1);
}

#[test]
fn drafts_are_accepted_up_to_the_first_mismatch_and_the_rest_rolled_back() {
    let mut rows = [decoding(100, 5)];
    rows[0].drafting = Some(Drafting::new(8, START_DEPTH));
    // Drafts 6, 7, 8: the target agrees on 6 and 7, then says 4.
    let applied = apply(&mut rows, &[decode(&[6, 7, 8])], sampled(0, &[6, 7, 4, 2]), Instant::now());
    let u = &applied.updates[0];
    assert_eq!(u.tokens, vec![6, 7, 4], "accepted drafts plus the target's own token");
    assert_eq!(u.rejected_drafts, 1);
    assert_eq!(u.verified, Some(Verified { history_len: 4, drafted: 3, accepted: 2 }));
    assert_eq!(rows[0].pending_token, Some(4));
    let d = rows[0].drafting.as_ref().unwrap();
    assert_eq!((d.depth(), d.stats.drafted, d.stats.accepted), (3, 3, 2), "depth shrinks to just past the last accepted draft");
    assert_eq!((applied.counts.drafted_tokens, applied.counts.accepted_draft_tokens, applied.counts.spec_decode_tokens), (3, 2, 3));
}

#[test]
fn a_stop_token_ends_the_row_unemitted() {
    let mut rows = [decoding(100, 5)];
    let applied = apply(&mut rows, &[decode(&[6, 0, 8])], sampled(0, &[6, 0, 8, 9]), Instant::now());
    let u = &applied.updates[0];
    assert_eq!(u.tokens, vec![6], "tokens before the stop id are emitted, the stop id is not");
    assert_eq!(u.end, Some(End::Finished(Finish::Stop)));
    assert_eq!(u.rejected_drafts, 0, "the cache keeps what was accepted; the turn's end trims it to the emitted tokens");
}

#[test]
fn max_tokens_cuts_an_accepted_run() {
    let mut rows = [decoding(3, 5)];
    let applied = apply(&mut rows, &[decode(&[6, 7, 8])], sampled(0, &[6, 7, 8, 9]), Instant::now());
    assert_eq!(applied.updates[0].tokens, vec![6, 7]);
    assert_eq!(applied.updates[0].end, Some(End::Finished(Finish::Length)));
    assert_eq!(rows[0].generated, 3);
}

#[test]
fn the_grammar_ends_a_row_when_complete_and_fails_it_when_broken() {
    let mut rows = [decoding(100, 5), decoding(100, 5)];
    rows[0].constraint = Some(Exactly(vec![6, 7]).start().unwrap());
    rows[1].constraint = Some(Exactly(vec![6, 7]).start().unwrap());
    let output = StepOutput {
        sampled: vec![Sampled { row: 0, targets: vec![6, 7, 9], logits: None }, Sampled { row: 1, targets: vec![6, 3, 9], logits: None }],
        constraint_failed: Vec::new(),
    };
    let applied = apply(&mut rows, &[decode(&[6, 7]), decode(&[6, 3])], output, Instant::now());
    assert_eq!(applied.updates[0].tokens, vec![6, 7]);
    assert_eq!(applied.updates[0].end, Some(End::Finished(Finish::Stop)), "the grammar allows nothing more");
    assert!(applied.updates[1].tokens.is_empty(), "a failed row publishes nothing of the step");
    assert!(matches!(applied.updates[1].end, Some(End::Failed(EngineError::Constraint(_)))));
    assert_eq!(applied.counts.generated_tokens, 2);
}

#[test]
fn a_prompt_chunk_moves_progress_and_the_last_one_samples() {
    let mut row = RequestProgress::new(RequestId(1), (0..10).collect(), Limits { max_tokens: 4, ..Default::default() });
    let applied = apply(std::slice::from_mut(&mut row), &[Some(Work::Prefill { tokens: 6 })], StepOutput::default(), Instant::now());
    assert!(applied.updates.is_empty(), "a chunk that does not finish the prompt has nothing to carry out");
    assert_eq!(row.prompt_remaining(), 4);
    let applied = apply(std::slice::from_mut(&mut row), &[Some(Work::Prefill { tokens: 4 })], sampled(0, &[42]), Instant::now());
    assert_eq!(applied.updates[0].tokens, vec![42]);
    assert_eq!((row.prompt_remaining(), row.pending_token, row.generated), (0, Some(42), 1));
}

#[test]
fn deadlines_end_rows_that_ran_or_not_and_a_prewarm_ends_once_read() {
    let now = Instant::now();
    let past = Some(now - Duration::from_millis(1));
    let mut late_decode = decoding(100, 5);
    late_decode.limits.deadline = past;
    let mut late_reader = RequestProgress::new(RequestId(2), (0..100).collect(), Limits { max_tokens: 10, deadline: past, ..Default::default() });
    late_reader.prefilled = 10;
    let prewarm = RequestProgress::new(RequestId(3), (0..8).collect(), Limits { max_tokens: 0, ..Default::default() });
    let mut on_time = decoding(100, 5);
    on_time.limits.deadline = Some(now + Duration::from_secs(60));
    let mut rows = [late_decode, late_reader, prewarm, on_time];
    let work = [decode(&[]), None, Some(Work::Prefill { tokens: 8 }), decode(&[])];
    let output = StepOutput {
        sampled: vec![Sampled { row: 0, targets: vec![9], logits: None }, Sampled { row: 3, targets: vec![9], logits: None }],
        ..Default::default()
    };
    let applied = apply(&mut rows, &work, output, now);
    let ends: Vec<_> = applied.updates.iter().map(|u| (u.row, u.end.clone())).collect();
    assert_eq!(
        ends,
        vec![(0, Some(End::Finished(Finish::TimeLimit))), (1, Some(End::Finished(Finish::TimeLimit))), (2, Some(End::Finished(Finish::Length))), (3, None)]
    );
    assert_eq!(applied.updates[0].tokens, vec![9], "a late row still publishes what its last step drew");
}

#[test]
fn an_earlier_end_is_not_replaced_by_the_deadline() {
    let mut row = decoding(100, 5);
    row.limits.deadline = Some(Instant::now() - Duration::from_millis(1));
    let applied = apply(std::slice::from_mut(&mut row), &[decode(&[])], sampled(0, &[0]), Instant::now());
    assert_eq!(applied.updates[0].end, Some(End::Finished(Finish::Stop)));
}

#[test]
fn a_grammar_that_failed_before_sampling_fails_its_row() {
    let mut rows = [decoding(100, 5)];
    let output = StepOutput { constraint_failed: vec![(0, "no token allowed".into())], ..Default::default() };
    let applied = apply(&mut rows, &[decode(&[])], output, Instant::now());
    assert_eq!(applied.updates[0].end, Some(End::Failed(EngineError::Constraint("no token allowed".into()))));
}

#[test]
fn logprobs_come_from_each_emitted_position() {
    let mut rows = [decoding(100, 5)];
    rows[0].limits.logprobs = Some(1);
    // Vocabulary of 3; position 0 favours token 1 (the accepted draft), position 1 token 2.
    let logits = vec![0.0, 5.0, 0.0, 0.0, 0.0, 5.0];
    let output = StepOutput { sampled: vec![Sampled { row: 0, targets: vec![1, 2], logits: Some(logits) }], ..Default::default() };
    let applied = apply(&mut rows, &[decode(&[1])], output, Instant::now());
    let lp = &applied.updates[0].logprobs;
    assert_eq!(lp.iter().map(|l| (l.token_id, l.top[0].0)).collect::<Vec<_>>(), vec![(1, 1), (2, 2)]);
}

#[test]
fn logprobs_normalise_and_rank() {
    let lp = logprobs_of(&[0.0, 2.0, 1.0], 2, 2);
    let z = (1f32 + 2f32.exp() + 1f32.exp()).ln();
    assert!((lp.logprob - (1.0 - z)).abs() < 1e-6);
    assert_eq!(lp.top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 2]);
}
