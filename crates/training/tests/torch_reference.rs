//! One SFT step and a few optimizer steps against torch + transformers
//! (scripts/make_training_reference.py, tiny Qwen3 fixture, f32): loss within 1e-5 relative,
//! gradients within 1e-4 relative (per tensor and global norm, as ||ours - torch|| / ||torch||),
//! parameters after three AdamW (clipping by global norm) and three SGD-momentum (clipping by
//! value) steps within 1e-5 absolute.
mod common;

use common::*;
use mlx_training::{AdamWConfig, ClipConfig, Example, OptimizerConfig, Schedule, SftConfig, SftTrainer, SgdConfig};

fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs()
}

/// Loss and every parameter's gradient of the first reference batch, through the chunked head
/// (in chunks of 3 loss positions and in one) and through the model's own full logits.
#[test]
fn one_step_loss_and_gradients_match_torch() {
    let (meta, refs) = reference();
    let batches = reference_batches(&meta);
    let batch: Vec<&Example> = batches[0].iter().collect();
    for (chunked, chunk) in [(true, 3), (true, 1024), (false, 1024)] {
        let cfg = SftConfig { head_chunk: chunk, chunked_head: chunked, ..Default::default() };
        let t = SftTrainer::new(qwen3_tree(), &f32_options(), batches.concat(), cfg).unwrap();
        assert_eq!(t.uses_chunked_head(), chunked);
        let (loss, grads) = t.loss_and_gradients(&batch).unwrap();
        let want = meta["loss_plain"].as_f64().unwrap();
        assert!(rel(loss as f64, want) < 1e-5, "chunked {chunked}/{chunk}: loss {loss} vs torch {want}");
        let names = t.tree().trainable_names();
        assert_eq!(names.len(), meta["grad_norms"].as_object().unwrap().len(), "every tensor torch differentiates");
        let mut sq = 0f64;
        let mut worst = 0f64;
        for (n, g) in names.iter().zip(&grads) {
            let (ours, theirs) = (f32s(g), f32s(&refs[&format!("grad.{n}")]));
            let e = norm_rel(&ours, &theirs);
            assert!(e < 1e-4, "chunked {chunked}/{chunk}: gradient of {n}: relative error {e:e}");
            worst = worst.max(e);
            sq += ours.iter().map(|x| (*x as f64).powi(2)).sum::<f64>();
        }
        let want = meta["grad_global_norm"].as_f64().unwrap();
        assert!(rel(sq.sqrt(), want) < 1e-4, "global norm {} vs {want}", sq.sqrt());
        eprintln!("chunked {chunked}/{chunk}: loss relative error {:e}, worst gradient {worst:e}, global norm {:e}", rel(loss as f64, meta["loss_plain"].as_f64().unwrap()), rel(sq.sqrt(), want));
        let (l1, _) = t.loss_and_gradients(&batches[1].iter().collect::<Vec<_>>()).unwrap();
        assert!(rel(l1 as f64, meta["loss_batch1"].as_f64().unwrap()) < 1e-5, "second batch loss {l1}");
    }
}

#[test]
fn label_smoothing_matches_torch() {
    let (meta, _) = reference();
    let batches = reference_batches(&meta);
    let eps = meta["label_smoothing"].as_f64().unwrap();
    let t = SftTrainer::new(qwen3_tree(), &f32_options(), batches.concat(), SftConfig { label_smoothing: eps, ..Default::default() }).unwrap();
    let (loss, _) = t.loss_and_gradients(&batches[0].iter().collect::<Vec<_>>()).unwrap();
    let want = meta["loss_smoothed"].as_f64().unwrap();
    assert!(rel(loss as f64, want) < 1e-5, "smoothed loss {loss} vs torch {want}");
    assert!(rel(want, meta["loss_plain"].as_f64().unwrap()) > 1e-3, "smoothing changes the loss");
}

/// Three updates, batches in the reference's order (batch 0, 1, 0: two examples a batch, no
/// shuffling, so the second epoch starts over), attention and norms trained, the rest frozen.
fn run_optimizer(optimizer: OptimizerConfig, lr: f64, clip: ClipConfig) -> (SftTrainer, Vec<f32>) {
    let (meta, _) = reference();
    let mut tree = qwen3_tree();
    tree.freeze(|n| !ref_trainable(n));
    let examples = reference_batches(&meta).concat();
    let cfg = SftConfig { batch_size: 2, shuffle: false, max_steps: Some(3), optimizer, clip, schedule: Schedule { lr, ..Default::default() }, ..Default::default() };
    let mut t = SftTrainer::new(tree, &f32_options(), examples, cfg).unwrap();
    let mut norms = Vec::new();
    while let Some(m) = t.step().unwrap() {
        norms.push(m.grad_norm);
    }
    assert_eq!(t.steps_done(), 3);
    (t, norms)
}

fn check_params(t: &SftTrainer, prefix: &str) {
    let (meta, refs) = reference();
    let original = qwen3_tree();
    let want: Vec<&str> = meta["trainable"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
    assert_eq!(t.tree().trainable_names(), want);
    let mut worst = 0f32;
    for (n, p) in t.tree().iter() {
        let got = f32s(&p.array);
        if p.trainable {
            let e = max_abs(&got, &f32s(&refs[&format!("{prefix}.{n}")]));
            worst = worst.max(e);
            assert!(e < 1e-5, "{prefix}: {n} differs from torch by {e:e}");
            assert!(max_abs(&got, &f32s(&original.get(n).unwrap().array)) > 1e-4, "{n} was updated");
        } else {
            assert_eq!(got, f32s(&original.get(n).unwrap().array), "frozen {n} unchanged");
        }
    }
    eprintln!("{prefix}: largest parameter difference from torch {worst:e}");
}

#[test]
fn adamw_with_norm_clipping_matches_torch() {
    let (meta, _) = reference();
    let a = &meta["adamw"];
    let cfg = AdamWConfig { beta1: a["betas"][0].as_f64().unwrap(), beta2: a["betas"][1].as_f64().unwrap(), eps: a["eps"].as_f64().unwrap(), weight_decay: a["weight_decay"].as_f64().unwrap() };
    assert_eq!(cfg, AdamWConfig::default(), "the reference uses the defaults");
    let (t, norms) = run_optimizer(OptimizerConfig::AdamW(cfg), a["lr"].as_f64().unwrap(), ClipConfig { max_norm: a["max_grad_norm"].as_f64(), max_value: None });
    for (ours, theirs) in norms.iter().zip(meta["adamw_grad_norms"].as_array().unwrap()) {
        let theirs = theirs.as_f64().unwrap();
        assert!(rel(*ours as f64, theirs) < 1e-4, "pre-clip norm {ours} vs torch {theirs}");
        assert!(theirs > a["max_grad_norm"].as_f64().unwrap(), "clipping is active");
    }
    check_params(&t, "adamw");
}

#[test]
fn sgd_momentum_with_value_clipping_matches_torch() {
    let (meta, _) = reference();
    let s = &meta["sgd"];
    let cfg = SgdConfig { momentum: s["momentum"].as_f64().unwrap(), ..Default::default() };
    let (t, _) = run_optimizer(OptimizerConfig::Sgd(cfg), s["lr"].as_f64().unwrap(), ClipConfig { max_norm: None, max_value: s["clip_value"].as_f64() });
    check_params(&t, "sgd");
}
