//! Gradient checkpointing lowers the peak memory of a gradient computation, with the same loss:
//! MLX's peak during one `loss_and_gradients` of 2 sequences of 768 tokens with every layer
//! checkpointed stays below half of the plain pass's, on an 8-layer random Qwen3 (hidden 64, 4
//! heads; the plain pass keeps every layer's attention probabilities and MLP activations for
//! the backward pass, the checkpointed one keeps the layers' inputs and rebuilds one layer at a
//! time) and on an 8-layer random Qwen3.5 (6 GatedDeltaNet layers, whose chunked rule keeps
//! each 64-position chunk's decay matrices and UT-transform rows, and 2 attention layers).
//! The test prints the peaks (`cargo test -p mlx-training --test grad_checkpoint_memory --
//! --nocapture`).
mod common;

use common::*;
use mlx_models::ParameterTree;
use mlx_training::{Example, SftConfig, SftTrainer};

/// Loss and MLX's peak memory above the baseline of one `loss_and_gradients` on the random
/// variant of `fixture` with `changes`, plain and checkpointed; asserts the same loss and the
/// checkpointed peak below half of the plain one.
fn check_peaks(fixture: &str, changes: &[(&str, serde_json::Value)]) {
    let dir = random_variant(fixture, changes);
    let tree = ParameterTree::load(dir.path(), &f32_options()).unwrap();
    let examples: Vec<Example> = (0..2u32)
        .map(|r| {
            Example::prompt_completion(
                &[1 + r],
                &(0..767u32)
                    .map(|i| (i * 131 + r * 7) % 512)
                    .collect::<Vec<_>>(),
            )
        })
        .collect();
    let batch: Vec<&Example> = examples.iter().collect();
    let peak_of = |gc: bool| {
        let cfg = SftConfig {
            gradient_checkpointing: gc,
            head_chunk: 2048,
            ..Default::default()
        };
        let t = SftTrainer::new(tree.clone(), &f32_options(), examples.clone(), cfg).unwrap();
        let ((loss, grads), peak) = peak_during(|| t.loss_and_gradients(&batch).unwrap());
        drop(grads);
        (loss, peak)
    };
    let (l_plain, plain) = peak_of(false);
    let (l_gc, gc) = peak_of(true);
    eprintln!(
        "{fixture}: peak above baseline: plain {:.1} MB, checkpointed {:.1} MB",
        plain as f64 / 1e6,
        gc as f64 / 1e6
    );
    assert!(
        ((l_plain - l_gc) / l_plain).abs() < 1e-6,
        "{fixture}: same loss: {l_plain} vs {l_gc}"
    );
    assert!(
        gc * 2 < plain,
        "{fixture}: checkpointed peak {gc} bytes vs plain {plain}"
    );
}

/// One test for both models: MLX's memory counters are the process's, so the two measurements
/// must not overlap.
#[test]
fn checkpointing_lowers_peak_memory() {
    check_peaks(
        "qwen3",
        &[
            ("num_hidden_layers", 8.into()),
            ("max_position_embeddings", 1024.into()),
        ],
    );
    let (lin, full) = ("linear_attention", "full_attention");
    check_peaks(
        "qwen3_5",
        &[
            ("num_hidden_layers", 8.into()),
            (
                "layer_types",
                serde_json::json!([lin, lin, lin, full, lin, lin, lin, full]),
            ),
            ("max_position_embeddings", 1024.into()),
        ],
    );
}
