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

/// An editor's habits: pre-warm the session's cache with the file (no
/// tokens generated), then ask for completions with and without echo drafts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prewarmed_fim_with_echo_drafts_equals_without() {
    const EDIT_PREFIX: &str = "def area(w, h):\n    return w * h\n\n\ndef perimeter(w, h):\n    return 2 * (w + h)\n\n\n# The same for squares.\n";
    const EDIT_SUFFIX: &str = "\n\nprint(square_area(3), square_perimeter(3))\n";
    let h = harness_for("qwen2.5-coder-0.5b", &[(FIM_PROMPT, 8)]);
    let srv = h.start(ServerConfig::default()).await;
    let mut c = srv.client().await;
    c.open().await;
    let fim = json!({"prefix": EDIT_PREFIX, "suffix": EDIT_SUFFIX});

    c.generate("warm", json!({"fim": fim, "max_tokens": 0})).await;
    let warm = c.collect("warm").await;
    assert!(warm.token_ids().is_empty());
    assert_eq!((warm.done().finish_reason, warm.done().usage.completion_tokens), (FinishReason::Length, 0));

    c.generate("echo", json!({"fim": fim, "max_tokens": 40, "speculation": {"source": "echo", "max_draft": 8}})).await;
    let echo = c.collect("echo").await;
    echo.assert_contiguous();
    let done = echo.done();
    assert!(done.usage.cached_tokens > 0, "the pre-warmed file is reused");
    let spec = done.speculative.as_ref().expect("a speculating request reports its stats");
    assert!(spec.accepted <= spec.drafted && spec.tokens_per_forward >= 1.0, "{spec:?}");

    c.generate("plain", json!({"fim": fim, "max_tokens": 40, "speculation": {"source": "off"}})).await;
    let plain = c.collect("plain").await;
    assert!(plain.done().speculative.is_none());
    assert_eq!(echo.token_ids(), plain.token_ids(), "speculation must not change greedy output");
    assert_eq!(echo.text(), plain.text());
    h.wait_idle().await;
}
