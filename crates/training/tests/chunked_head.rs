//! The chunked head's closed-form gradients (logits `head_chunk` rows at a time, the body's
//! gradients as a vector-Jacobian product) equal autodiff through the model's full logits, on
//! families with tied and untied heads and a logit softcap (Gemma 4), with and without label
//! smoothing: loss within 1e-5 relative, each gradient within 1e-4 (||a - b|| / ||b||, with
//! ||b|| floored at 1e-3 of the global gradient norm).
mod common;

use common::*;
use mlx_models::ParameterTree;
use mlx_training::{Example, SftConfig, SftTrainer};

#[test]
fn chunked_head_gradients_equal_autodiff_through_full_logits() {
    let examples = vec![Example::prompt_completion(&[3, 17, 99, 4], &[250, 8, 61, 7, 12]), Example::prompt_completion(&[40, 41], &[30, 31, 7, 9])];
    let batch: Vec<&Example> = examples.iter().collect();
    for (name, smoothing) in [("qwen3", 0.1), ("qwen3_untied", 0.0), ("gemma4_text", 0.2), ("llama", 0.0)] {
        let tree = ParameterTree::load(model_fixture(name), &f32_options()).unwrap();
        let make = |chunked: bool| SftTrainer::new(tree.clone(), &f32_options(), examples.clone(), SftConfig { head_chunk: 4, chunked_head: chunked, label_smoothing: smoothing, ..Default::default() }).unwrap();
        let (lean, full) = (make(true), make(false));
        assert!(lean.uses_chunked_head(), "{name}: the chunked head reproduces the model's logits");
        assert!(!full.uses_chunked_head());
        let (l1, g1) = lean.loss_and_gradients(&batch).unwrap();
        let (l2, g2) = full.loss_and_gradients(&batch).unwrap();
        assert!(((l1 - l2) / l2).abs() < 1e-5, "{name}: loss {l1} vs {l2}");
        assert_grads_close(name, &lean.tree().trainable_names(), &g1, &g2, 1e-4);
    }
}
