//! Speculative decoding benchmark: a code-edit workload (reproduce a file
//! with a rename) and a FIM workload (fill a removed function body), at
//! several concurrency levels, with speculation off and on in one run.
//! Prints end-to-end speedup and tokens per forward, and checks that the
//! outputs are identical.
use serde::Serialize;

use tether::engine::speculate::{DraftKind, SpecStats, Speculation};
use tether::engine::{EngineEvent, EngineHandle, SubmitRequest};
use tether::server::FimTokens;
use tether::tokenizer::{ChatMessage, TextTokenizer};

use super::throughput::StepProfile;

/// The file both workloads work on.
const SOURCE: &str = include_str!("../../../../bench/workloads/orders.py");

/// One rename per stream, so concurrent rows write different text.
const RENAMES: [(&str, &str); 8] = [
    ("total_price", "order_total"),
    ("discount_rate", "discount"),
    ("Item", "LineItem"),
    ("apply_coupon", "redeem_coupon"),
    ("format_receipt", "render_receipt"),
    ("subtotal", "line_total"),
    ("customer", "buyer"),
    ("quantity", "qty"),
];

/// Functions whose bodies the FIM workload removes, one per stream.
const FIM_HOLES: [&str; 8] = [
    "    def subtotal(self) -> float:\n",
    "    def add_item(self, name: str, unit_price: float, quantity: int = 1) -> None:\n",
    "    def remove_item(self, name: str) -> None:\n",
    "    def total_price(self) -> float:\n",
    "    def item_count(self) -> int:\n",
    "def apply_coupon(order: Order, code: str) -> None:\n",
    "def format_receipt(order: Order) -> str:\n",
    "if __name__ == \"__main__\":\n",
];

#[derive(Clone, Copy, Debug, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
enum Workload {
    Edit,
    Fim,
}

#[derive(Debug, Serialize)]
struct SpecRun {
    engine: &'static str,
    workload: Workload,
    streams: usize,
    speculation: &'static str,
    prompt_tokens: usize,
    completion_tokens: usize,
    /// From submitting all streams to the last one finishing.
    wall_s: f64,
    tok_s: f64,
    /// Generated tokens per decode forward, over all streams.
    tokens_per_forward: f64,
    drafted: u64,
    accepted: u64,
    step: StepProfile,
    #[serde(skip)]
    outputs: Vec<Vec<u32>>,
}

#[derive(Debug, Serialize)]
struct SpecComparison {
    workload: Workload,
    streams: usize,
    /// Wall time with speculation off over on.
    speculation: &'static str,
    speedup: f64,
    tokens_per_forward: f64,
    outputs_equal: bool,
    /// Streams whose output matched speculation off token for token.
    equal_streams: usize,
    /// Where the earliest mismatch came, in generated tokens (None: none
    /// did). On a GPU a verification forward of several tokens can round
    /// differently from one-token decoding (its kernels vary with the row
    /// count), so near-ties can flip; on the CPU outputs match.
    first_mismatch_at: Option<usize>,
}

/// The prompts of `streams` concurrent requests of `workload`.
fn prompts(tok: &TextTokenizer, fim: Option<&FimTokens>, workload: Workload, streams: usize) -> anyhow::Result<Vec<(Vec<u32>, usize)>> {
    (0..streams)
        .map(|s| match workload {
            Workload::Edit => {
                let (from, to) = RENAMES[s % RENAMES.len()];
                let ask = format!(
                    "Rename `{from}` to `{to}` everywhere in this Python module. Reply with the complete updated module in one \
                     ```python block and nothing else.\n\n```python\n{SOURCE}```"
                );
                let text = tok.apply_chat_template(&[ChatMessage::user(&ask)], true)?;
                let ids = tok.encode(&text, true)?;
                let budget = tok.encode(SOURCE, false)?.len() + 64;
                Ok((ids, budget))
            }
            Workload::Fim => {
                let fim = fim.ok_or_else(|| anyhow::anyhow!("the FIM workload needs a model with FIM tokens"))?;
                let sig = FIM_HOLES[s % FIM_HOLES.len()];
                let start = SOURCE.find(sig).ok_or_else(|| anyhow::anyhow!("hole {sig:?} not in the workload file"))? + sig.len();
                let end = SOURCE[start..].find("\n\n").map_or(SOURCE.len(), |e| start + e);
                let mut ids = vec![fim.prefix];
                ids.extend(tok.encode(&SOURCE[..start], false)?);
                ids.push(fim.suffix);
                ids.extend(tok.encode(&SOURCE[end..], false)?);
                ids.push(fim.middle);
                Ok((ids, 128))
            }
        })
        .collect()
}

/// Runs every prompt at once with `speculation` and waits for all.
fn run(engine: &EngineHandle, tok: &TextTokenizer, workload: Workload, prompts: &[(Vec<u32>, usize)], speculation: Speculation) -> anyhow::Result<SpecRun> {
    let name = speculation.kind.name();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let before = rt.block_on(engine.stats()).unwrap_or_default();
    let start = std::time::Instant::now();
    let results: Vec<(Vec<u32>, Option<SpecStats>)> = rt.block_on(async {
        let mut tasks = Vec::new();
        for (prompt, max_tokens) in prompts {
            let req = SubmitRequest { stop_ids: tok.eos_ids().to_vec(), speculation: speculation.clone(), ..SubmitRequest::new(prompt.clone(), *max_tokens) };
            let mut rx = engine.submit(req)?.events;
            tasks.push(tokio::spawn(async move {
                let mut ids = Vec::new();
                while let Some(ev) = rx.recv().await {
                    match ev {
                        EngineEvent::Tokens { ids: t, .. } => ids.extend(t),
                        EngineEvent::Finished(f) => return Ok((ids, f.speculative)),
                        EngineEvent::Failed(e) => anyhow::bail!("request failed: {e}"),
                        EngineEvent::Started { .. } => {}
                    }
                }
                anyhow::bail!("the engine dropped a request")
            }));
        }
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await??);
        }
        anyhow::Ok(out)
    })?;
    let wall_s = start.elapsed().as_secs_f64();
    let after = rt.block_on(engine.stats()).unwrap_or_default();
    let completion_tokens: usize = results.iter().map(|(ids, _)| ids.len()).sum();
    let stats: Vec<&SpecStats> = results.iter().filter_map(|(_, s)| s.as_ref()).collect();
    let (forwards, decoded): (u64, u64) = stats.iter().fold((0, 0), |(f, t), s| (f + s.decode_forwards, t + s.decode_tokens));
    Ok(SpecRun {
        engine: "tether",
        workload,
        streams: prompts.len(),
        speculation: name,
        prompt_tokens: prompts.iter().map(|(p, _)| p.len()).sum(),
        completion_tokens,
        wall_s,
        tok_s: completion_tokens as f64 / wall_s,
        tokens_per_forward: if forwards == 0 { 1.0 } else { decoded as f64 / forwards as f64 },
        drafted: stats.iter().map(|s| s.drafted).sum(),
        accepted: stats.iter().map(|s| s.accepted).sum(),
        step: StepProfile::between(&before, &after),
        outputs: results.into_iter().map(|(ids, _)| ids).collect(),
    })
}

/// The index of the first token where `a` and `b` differ, if they do.
fn first_mismatch(a: &[u32], b: &[u32]) -> Option<usize> {
    (a != b).then(|| a.iter().zip(b).take_while(|(x, y)| x == y).count())
}

/// Off, then each of `sources`, for each workload and stream count; prints
/// one JSON line per run and per comparison with off.
pub(super) fn run_all(
    engine: &EngineHandle,
    tok: &TextTokenizer,
    fim: Option<&FimTokens>,
    streams: &[usize],
    sources: &[DraftKind],
    max_draft: usize,
) -> anyhow::Result<()> {
    let workloads: &[Workload] = if fim.is_some() { &[Workload::Edit, Workload::Fim] } else { &[Workload::Edit] };
    for &workload in workloads {
        for &n in streams {
            let prompts = prompts(tok, fim, workload, n)?;
            let off = run(engine, tok, workload, &prompts, Speculation { kind: DraftKind::Off, max_draft, ..Default::default() })?;
            println!("{}", serde_json::to_string(&off)?);
            for kind in sources {
                let on = run(engine, tok, workload, &prompts, Speculation { kind: kind.clone(), max_draft, ..Default::default() })?;
                println!("{}", serde_json::to_string(&on)?);
                let cmp = SpecComparison {
                    workload,
                    streams: n,
                    speculation: on.speculation,
                    speedup: off.wall_s / on.wall_s,
                    tokens_per_forward: on.tokens_per_forward,
                    outputs_equal: off.outputs == on.outputs,
                    equal_streams: off.outputs.iter().zip(&on.outputs).filter(|(a, b)| a == b).count(),
                    first_mismatch_at: off.outputs.iter().zip(&on.outputs).filter_map(|(a, b)| first_mismatch(a, b)).min(),
                };
                println!("{}", serde_json::to_string(&cmp)?);
            }
        }
    }
    Ok(())
}
