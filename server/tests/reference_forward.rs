//! The forward pass against an independent numpy reference
//! (tests/reference/make_fixtures.py): logits at the last prompt position and
//! 32 greedy tokens, on CPU in float32, for the real models (Gemma 3's
//! cases include a prompt past its local layers' 512-token window).
mod common;

use common::*;
use tether::generate::{greedy_tokens, prefill};
use tether::models::{load_transformer, LoadOptions, Transformer, Weight, WeightFormat};

const MAX_RELATIVE_ERROR: f64 = 1e-3;

/// `TETHER_CPU_ISA` lowers the CPU kernels' instruction sets (scripts/test.sh
/// runs these tests again with `avx2`): the level they run at is the one
/// asked for or, on a CPU without it, a lower one.
#[test]
fn the_cpu_kernels_run_at_the_level_asked_for() {
    let levels = ["portable", "avx2", "avx512", "avx512vnni"];
    let rank = |level: &str| levels.iter().position(|&l| l == level);
    let running = mlx::cpu_isa();
    assert!(rank(&running).is_some(), "{running}");
    if let Some(asked) = std::env::var("TETHER_CPU_ISA").ok().and_then(|v| rank(&v)) {
        assert!(rank(&running) <= Some(asked), "asked for {}, running {running}", levels[asked]);
    }
}

fn load(name: &str, weights: WeightFormat) -> Transformer {
    mlx::set_default_device(mlx::Device::Cpu).unwrap();
    load_transformer(&model_path(name), LoadOptions { dtype: mlx::Dtype::F32, weights }).unwrap()
}

fn check_model(name: &str, fixture: &str, weights: WeightFormat) {
    let model = load(name, weights);
    if matches!(weights, WeightFormat::Dense) && mlx::cpu_panels_supported() {
        // What runs dense float32 models on this CPU: the panel kernel, for
        // prefill chunks and one-row decode alike.
        let all_panels = model.linears().all(|l| matches!(l.weight, Weight::Panels { .. }));
        assert!(all_panels, "{name}: dense projections are not laid out in panels");
    }
    let fx = read_json(fixture);
    let mut failures = Vec::new();
    for case in fx["cases"].as_array().unwrap() {
        let case_name = case["name"].as_str().unwrap();
        let prompt = ids(&case["prompt_ids"]);
        let want = ids(&case["greedy_ids"]);

        if let Some(file) = case["logits_file"].as_str() {
            let reference = read_f32(file);
            let mut cache = model.new_cache();
            let got = prefill(&model, &mut cache, &prompt, 512).unwrap().to_vec_f32().unwrap();
            let err = relative_error(&got, &reference);
            println!("{name} {case_name}: logits relative error {err:.2e}");
            if err >= MAX_RELATIVE_ERROR {
                failures.push(format!("{case_name}: logits relative error {err:.2e}"));
            }
        }

        let got = greedy_tokens(&model, &prompt, want.len()).unwrap();
        if got != want {
            let at = got.iter().zip(&want).position(|(a, b)| a != b).unwrap_or(0);
            failures.push(format!("{case_name}: greedy tokens differ at step {at}: got {got:?}, want {want:?}"));
        }

        // The pipelined decode loop must produce exactly the same tokens.
        let streamed = pipelined_greedy(&model, &prompt, want.len(), 7);
        if streamed != want {
            failures.push(format!("{case_name}: pipelined generate with 7-token prefill chunks differs: {streamed:?}"));
        }
    }
    assert!(failures.is_empty(), "{name} ({weights:?}):\n{}", failures.join("\n"));
}

#[test]
fn smollm2_matches_reference() {
    check_model("smollm2-135m", "greedy/smollm2.json", WeightFormat::Dense);
}

#[test]
fn qwen_coder_matches_reference() {
    check_model("qwen2.5-coder-0.5b", "greedy/qwen2.5-coder-0.5b.json", WeightFormat::Dense);
}

/// Q4_1/Q4_K/Q8_0 blocks kept in MLX's affine form are exact, so the
/// quantized path (the CPU default, through the decode kernel) must meet the
/// same bar.
#[test]
fn smollm2_quantized_weights_match_reference() {
    check_model("smollm2-135m", "greedy/smollm2.json", WeightFormat::Quantized);
}

#[test]
fn qwen_coder_quantized_weights_match_reference() {
    check_model("qwen2.5-coder-0.5b", "greedy/qwen2.5-coder-0.5b.json", WeightFormat::Quantized);
}

/// Gemma 3: Q5_0/Q8_0 as 8-bit, Q4_K as 4-bit, Q6_K as 8-bit in groups of
/// 16 (the CPU default), with sliding-window layers that keep only their window.
#[test]
fn gemma3_quantized_weights_match_reference() {
    check_model("gemma3-270m", "greedy/gemma3-270m.json", WeightFormat::Quantized);
}
