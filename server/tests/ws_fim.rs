//! Fill-in-the-middle through the server on Qwen2.5-Coder-0.5B (the model
//! with FIM tokens): the completion equals the greedy continuation of the
//! FIM prompt built by hand from the model's special tokens.
mod ws_harness;

use protocol::FinishReason;
use serde_json::json;
use tether::server::ServerConfig;
use ws_harness::*;

const PREFIX: &str = "def add(a, b):\n    return ";
const SUFFIX: &str = "\n\n\nprint(add(1, 2))\n";
const FIM_PROMPT: &str = "<|fim_prefix|>def add(a, b):\n    return <|fim_suffix|>\n\n\nprint(add(1, 2))\n<|fim_middle|>";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fim_request_fills_the_middle() {
    let h = harness_for("qwen2.5-coder-0.5b", &[(FIM_PROMPT, 8)]);
    let srv = h.start(ServerConfig::default()).await;
    let mut c = srv.client().await;
    let ready = c.open().await;
    assert!(ready.model.fim);
    assert_eq!(ready.model.architecture, "qwen2");

    c.generate("fim.1", json!({"fim": {"prefix": PREFIX, "suffix": SUFFIX}, "max_tokens": 8})).await;
    let out = c.collect("fim.1").await;
    out.assert_contiguous();
    let (ids, text) = h.greedy(FIM_PROMPT, 8);
    assert_eq!(out.token_ids(), ids);
    assert_eq!(out.text(), text);
    assert!(text.contains("a + b"), "{text:?}");
    let prompt_ids = h.tokenizer.encode(FIM_PROMPT, true).unwrap();
    assert_eq!(out.done().usage.prompt_tokens as usize, prompt_ids.len(), "the server builds the same FIM prompt");
    if ids.len() < 8 {
        assert_eq!(out.done().finish_reason, FinishReason::Stop);
    }

    // Repo-level context files go before the FIM part, behind <|file_sep|>.
    c.generate(
        "fim.2",
        json!({"fim": {"prefix": "from math_utils import mul\n\ndef square(x):\n    return ", "suffix": "\n", "extra": [{"path": "math_utils.py", "content": "def mul(a, b):\n    return a * b\n"}]}, "max_tokens": 8, "stop": ["\n"]}),
    )
    .await;
    let out = c.collect("fim.2").await;
    let done = out.done();
    assert!(done.usage.prompt_tokens > 20);
    assert!(!out.text().is_empty() && !out.text().contains('\n'), "{:?}", out.text());
    h.wait_idle().await;
}
