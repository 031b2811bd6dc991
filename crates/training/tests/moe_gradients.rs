//! MoE families train: the SFT loss and every parameter's gradient of the tiny LFM2-MoE,
//! Qwen3.5-MoE and Gemma 4 MoE fixtures against torch + transformers
//! (`scripts/make_moe_gradient_reference.py`): loss within 1e-5 relative; per tensor, the
//! gradient's norm within 1e-4 relative and its product with the probe `cos(0.37 i)` within
//! 1e-4 of `||g|| ||probe||` (norms floored at 1e-3 of the global gradient norm, as
//! `assert_grads_close` does); the global norm within 1e-4 relative. The routing choice is a
//! constant to the gradients in both (transformers' top-k indices carry no gradient; ours are
//! stopped, as mlx-lm stops them); the chosen experts' weights, the router and everything
//! before it get gradients through the routing weights.
mod common;

use common::*;
use mlx_models::ParameterTree;
use mlx_training::{Example, SftConfig, SftTrainer};
use serde_json::Value;

#[test]
fn moe_gradients_match_transformers() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/moe_grad_reference.json");
    let meta: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let examples: Vec<Example> = meta["examples"]
        .as_array()
        .unwrap()
        .iter()
        .map(|pc| Example::prompt_completion(&ids(&pc[0]), &ids(&pc[1])))
        .collect();
    let batch: Vec<&Example> = examples.iter().collect();
    for (name, r) in meta["models"].as_object().unwrap() {
        let tree = ParameterTree::load(model_fixture(name), &f32_options()).unwrap();
        let t = SftTrainer::new(
            tree.clone(),
            &f32_options(),
            examples.clone(),
            SftConfig::default(),
        )
        .unwrap();
        let (loss, grads) = t.loss_and_gradients(&batch).unwrap();
        let want_loss = r["loss"].as_f64().unwrap();
        let e = (loss as f64 - want_loss).abs() / want_loss.abs();
        assert!(e < 1e-5, "{name}: loss {loss} vs {want_loss} ({e:e})");
        let names = tree.trainable_names();
        let reference = r["gradients"].as_object().unwrap();
        let global = r["global_norm"].as_f64().unwrap();
        let (mut ours_sq, mut worst_norm, mut worst_probe) = (0f64, 0f64, 0f64);
        for (n, want) in reference {
            let i = names
                .iter()
                .position(|t| t == n)
                .unwrap_or_else(|| panic!("{name}: {n} has no gradient here"));
            let g: Vec<f64> = f32s(&grads[i]).iter().map(|x| *x as f64).collect();
            let norm = g.iter().map(|x| x * x).sum::<f64>().sqrt();
            let probe: Vec<f64> = (0..g.len()).map(|k| (0.37 * k as f64).cos()).collect();
            let dot: f64 = g.iter().zip(&probe).map(|(a, b)| a * b).sum();
            let probe_norm = probe.iter().map(|x| x * x).sum::<f64>().sqrt();
            let (want_norm, want_dot) = (
                want["norm"].as_f64().unwrap(),
                want["probe"].as_f64().unwrap(),
            );
            let scale = want_norm.max(1e-3 * global);
            let (en, ep) = (
                (norm - want_norm).abs() / scale,
                (dot - want_dot).abs() / (scale * probe_norm),
            );
            assert!(
                en < 1e-4,
                "{name}: gradient norm of {n}: {norm:e} vs {want_norm:e} ({en:e})"
            );
            assert!(
                ep < 1e-4,
                "{name}: probe product of {n}'s gradient: {dot:e} vs {want_dot:e} ({ep:e})"
            );
            ours_sq += norm * norm;
            (worst_norm, worst_probe) = (worst_norm.max(en), worst_probe.max(ep));
        }
        let eg = (ours_sq.sqrt() - global).abs() / global;
        assert!(
            eg < 1e-4,
            "{name}: global gradient norm {} vs {global} ({eg:e})",
            ours_sq.sqrt()
        );
        eprintln!(
            "{name}: loss {e:.1e} rel, {} gradients: norms {worst_norm:.1e}, probes {worst_probe:.1e}, global norm {eg:.1e}",
            reference.len()
        );
    }
}
