//! One GRPO step against torch + TRL (scripts/make_grpo_reference.py: TRL's own
//! `GRPOTrainer._compute_loss` on fixed inputs, tiny Qwen3 fixture, f32), for every loss type at
//! both importance-sampling levels: advantages within 1e-5 absolute, loss within 1e-5 relative,
//! gradients within 1e-4 relative (per tensor and global norm, as ||ours - torch|| / ||torch||),
//! parameters after clipping to norm 1.0 and one AdamW step within 1e-5 absolute. Cases with
//! `beta > 0` run the reference model (the fixture with its norm weights times 1.1).
mod common;

use common::*;
use mlx_training::{
    compute_advantages, AdamWConfig, Completion, GrpoBatch, GrpoConfig, GrpoTrainer,
    ImportanceSampling, LossType, OptimizerConfig, ScaleRewards, Schedule,
};
use serde_json::Value;
use std::path::PathBuf;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs().max(1e-12)
}

/// What a GRPO loss may differ by: 1e-5 of the larger of |`want`| and the mean |advantage|. The
/// loss is a weighted mean of per-token terms ratio·A whose advantages nearly cancel (grpo_token:
/// terms of |A| ≈ 0.75 on average, loss −0.018; at beta 0 over the rewards below, ~2e-8), so its
/// f32 rounding is relative to the terms, not to the loss.
fn loss_tolerance(want: f64, advantages: &[f64]) -> f64 {
    let mean_abs = advantages.iter().map(|a| a.abs()).sum::<f64>() / advantages.len() as f64;
    1e-5 * want.abs().max(mean_abs)
}

fn config_of(case: &Value, group: usize) -> GrpoConfig {
    let s = |k: &str| case[k].as_str().unwrap().to_string();
    GrpoConfig {
        group_size: group,
        loss: serde_json::from_value(Value::String(s("loss_type"))).unwrap(),
        importance_sampling: if s("level") == "token" {
            ImportanceSampling::Token
        } else {
            ImportanceSampling::Sequence
        },
        scale_rewards: serde_json::from_value(Value::String(s("scale"))).unwrap(),
        beta: case["beta"].as_f64().unwrap(),
        epsilon: case["epsilon"].as_f64().unwrap(),
        epsilon_high: case.get("epsilon_high").and_then(Value::as_f64),
        max_completion_length: case
            .get("max_completion_length")
            .and_then(Value::as_u64)
            .unwrap_or(512) as usize,
        micro_batch_size: match case["ga"].as_u64().unwrap() {
            1 => None,
            ga => Some(8 / ga as usize),
        },
        ..Default::default()
    }
}

#[test]
fn one_grpo_step_matches_trl() {
    let meta: Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("grpo_reference.json")).unwrap(),
    )
    .unwrap();
    let group = meta["group_size"].as_u64().unwrap() as usize;
    let prompts: Vec<Vec<u32>> = meta["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(ids)
        .collect();
    let completions: Vec<Vec<u32>> = meta["completions"]
        .as_array()
        .unwrap()
        .iter()
        .map(ids)
        .collect();
    let rewards: Vec<f64> = meta["rewards"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();
    let trainable: Vec<&str> = meta["trainable"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    let a = &meta["adamw"];
    let cases = meta["cases"].as_array().unwrap();
    let mut seen = std::collections::BTreeSet::new();
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let mut cfg = config_of(case, group);
        seen.insert((
            format!("{:?}", cfg.loss),
            format!("{:?}", cfg.importance_sampling),
        ));
        cfg.optimizer = OptimizerConfig::AdamW(AdamWConfig {
            beta1: a["betas"][0].as_f64().unwrap(),
            beta2: a["betas"][1].as_f64().unwrap(),
            eps: a["eps"].as_f64().unwrap(),
            weight_decay: a["weight_decay"].as_f64().unwrap(),
        });
        cfg.schedule = Schedule {
            lr: a["lr"].as_f64().unwrap(),
            ..Default::default()
        };
        cfg.clip.max_norm = a["max_grad_norm"].as_f64();
        let refs = mlx_array::io::load_safetensors(
            fixtures().join(format!("grpo_{name}.safetensors")),
            Some(mlx_array::DType::F32),
        )
        .unwrap();

        // advantages
        let want_adv: Vec<f64> = case["advantages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect();
        let adv = compute_advantages(&rewards, group, cfg.scale_rewards).unwrap();
        for (x, y) in adv.iter().zip(&want_adv) {
            assert!((x - y).abs() < 1e-5, "{name}: advantage {x} vs TRL {y}");
        }

        let mut tree = qwen3_tree();
        tree.freeze(|n| !trainable.contains(&n));
        assert_eq!(tree.trainable_names(), trainable);
        let reference = (cfg.beta > 0.0).then(|| {
            let mut r = qwen3_tree();
            let names: Vec<String> = r
                .iter()
                .filter(|(n, _)| n.ends_with("norm.weight"))
                .map(|(n, _)| n.to_string())
                .collect();
            for n in names {
                let scaled = r.get(&n).unwrap().array.mul_scalar(1.1).unwrap();
                r.set(&n, scaled).unwrap();
            }
            r
        });
        let mut batch = GrpoBatch::single_reward(
            completions
                .iter()
                .enumerate()
                .map(|(i, c)| (prompts[i / group].clone(), c.clone()))
                .collect(),
            &rewards,
        )
        .unwrap();
        if let Some(old) = case["old_logprobs"].as_array() {
            batch.old_logprobs = Some(
                old.iter()
                    .map(|r| {
                        r.as_array()
                            .unwrap()
                            .iter()
                            .map(|v| v.as_f64().unwrap() as f32)
                            .collect()
                    })
                    .collect(),
            );
        }
        // the chunked head in chunks of 5 positions, except in one case: the full logits
        let full = name == "dapo_token";
        cfg.chunked_head = !full;
        cfg.head_chunk = 5;
        let mut t = GrpoTrainer::new(tree, reference, &f32_options(), cfg).unwrap();
        assert_eq!(t.uses_chunked_head(), !full);
        let (out, grads) = t.loss_and_gradients(&batch).unwrap();
        let want = case["loss"].as_f64().unwrap();
        let tol = loss_tolerance(want, &want_adv);
        assert!(
            (out.loss as f64 - want).abs() < tol,
            "{name}: loss {} vs TRL {want} (tolerance {tol:e})",
            out.loss
        );
        let mut sq = 0f64;
        let mut worst = 0f64;
        for (n, g) in trainable.iter().zip(&grads) {
            let (ours, theirs) = (f32s(g), f32s(&refs[&format!("grad.{n}")]));
            let e = norm_rel(&ours, &theirs);
            assert!(e < 1e-4, "{name}: gradient of {n}: relative error {e:e}");
            worst = worst.max(e);
            sq += ours.iter().map(|x| (*x as f64).powi(2)).sum::<f64>();
        }
        let want_norm = case["grad_global_norm"].as_f64().unwrap();
        assert!(
            rel(sq.sqrt(), want_norm) < 1e-4,
            "{name}: global norm {} vs {want_norm}",
            sq.sqrt()
        );
        // TRL's clip-ratio metric (region mean, per micro-batch) and KL (per micro-batch)
        let ratios: Vec<f64> = case["clip_ratio_region"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect();
        if ratios.len() == 1 {
            assert!(
                (out.clip_fraction - ratios[0]).abs() < 1e-6,
                "{name}: clip fraction {} vs TRL {}",
                out.clip_fraction,
                ratios[0]
            );
        }
        match (out.kl, case["kl"].as_array()) {
            (Some(kl), Some(k)) if k.len() == 1 => assert!(
                rel(kl, k[0].as_f64().unwrap()) < 1e-4,
                "{name}: kl {kl} vs {}",
                k[0]
            ),
            (Some(_), Some(_)) | (None, None) => {}
            (ours, theirs) => panic!("{name}: kl {ours:?} vs TRL {theirs:?}"),
        }

        let m = t.step(&batch).unwrap();
        assert!(
            rel(m.grad_norm as f64, case["pre_clip_norm"].as_f64().unwrap()) < 1e-4,
            "{name}: pre-clip norm {}",
            m.grad_norm
        );
        assert!(!m.skipped && m.step == 1);
        let original = qwen3_tree();
        let mut pworst = 0f32;
        for (n, p) in t.tree().iter() {
            let got = f32s(&p.array);
            if p.trainable {
                let e = max_abs(&got, &f32s(&refs[&format!("param.{n}")]));
                pworst = pworst.max(e);
                assert!(
                    e < 1e-5,
                    "{name}: parameter {n} differs from torch's by {e:e}"
                );
                assert!(
                    max_abs(&got, &f32s(&original.get(n).unwrap().array)) > 1e-5,
                    "{name}: {n} was updated"
                );
            } else {
                assert_eq!(
                    got,
                    f32s(&original.get(n).unwrap().array),
                    "{name}: frozen {n} unchanged"
                );
            }
        }
        eprintln!("{name} ({}): loss relative error {:.2e}, worst gradient {worst:.2e}, parameters {pworst:.2e}, clip fraction {:.3}, kl {:?}", if full { "full logits" } else { "chunked head" }, rel(out.loss as f64, want), out.clip_fraction, out.kl);
    }
    assert_eq!(seen.len(), 8, "every loss type at both levels: {seen:?}");
    let _ = (LossType::Grpo, ScaleRewards::None);
}

/// The chunked head (chunks of 3 positions) gives the gradients of the full-logits path for
/// every parameter, the tied embedding (the head's weight) included, with and without a
/// reference model.
#[test]
fn chunked_head_matches_full_logits() {
    let rows = vec![
        (vec![3, 17, 99], vec![250, 8, 61, 7]),
        (vec![3, 17, 99], vec![300, 301]),
        (vec![3, 17, 99], vec![5, 6, 7, 8, 9]),
        (vec![3, 17, 99], vec![11]),
    ];
    let rewards = [0.5, 1.0, 0.0, 0.25];
    let batch = GrpoBatch::single_reward(rows, &rewards).unwrap();
    let d = GrpoConfig::default();
    let advantages = compute_advantages(&rewards, d.group_size, d.scale_rewards).unwrap();
    for beta in [0.0, 0.1] {
        let run = |chunked: bool| {
            let cfg = GrpoConfig {
                chunked_head: chunked,
                head_chunk: 3,
                beta,
                loss: LossType::Grpo,
                ..Default::default()
            };
            let mut reference = qwen3_tree();
            let n = "model.norm.weight";
            let scaled = reference.get(n).unwrap().array.mul_scalar(1.1).unwrap();
            reference.set(n, scaled).unwrap();
            let t = GrpoTrainer::new(qwen3_tree(), Some(reference), &f32_options(), cfg).unwrap();
            assert_eq!(t.uses_chunked_head(), chunked);
            let names: Vec<String> = t
                .tree()
                .trainable_names()
                .iter()
                .map(|s| s.to_string())
                .collect();
            let (out, grads) = t.loss_and_gradients(&batch).unwrap();
            (out, names, grads)
        };
        let (a, names, ga) = run(true);
        let (b, _, gb) = run(false);
        assert!(
            names.iter().any(|n| n.ends_with("embed_tokens.weight")),
            "the tied head is trained"
        );
        let tol = loss_tolerance(b.loss as f64, &advantages);
        assert!(
            ((a.loss - b.loss) as f64).abs() < tol,
            "beta {beta}: loss {} vs {} (tolerance {tol:e})",
            a.loss,
            b.loss
        );
        assert_eq!(a.kl.is_some(), beta > 0.0);
        for ((n, x), y) in names.iter().zip(&ga).zip(&gb) {
            let e = norm_rel(&f32s(x), &f32s(y));
            assert!(
                e < 1e-5,
                "beta {beta}: gradient of {n}: chunked vs full {e:e}"
            );
        }
    }
}

/// Advantages by hand: group scaling, batch scaling, none; an unscorable completion gets 0 and
/// stays out of its group's statistics.
#[test]
fn advantages_by_hand() {
    let r = [1.0, 2.0, 3.0, 4.0];
    let std = (5.0f64 / 3.0).sqrt(); // unbiased std of 1..4
    let a = compute_advantages(&r, 4, ScaleRewards::Group).unwrap();
    assert!((a[0] - (-1.5 / (std + 1e-4))).abs() < 1e-12, "{a:?}");
    let a = compute_advantages(&r, 4, ScaleRewards::None).unwrap();
    assert_eq!(a, vec![-1.5, -0.5, 0.5, 1.5]);
    let a = compute_advantages(&[1.0, 3.0, 10.0, 20.0], 2, ScaleRewards::Batch).unwrap();
    let m = 8.5;
    let bstd = (((1.0f64 - m).powi(2)
        + (3.0f64 - m).powi(2)
        + (10.0f64 - m).powi(2)
        + (20.0f64 - m).powi(2))
        / 3.0)
        .sqrt();
    assert!(
        (a[0] - (-1.0 / (bstd + 1e-4))).abs() < 1e-12
            && (a[3] - (5.0 / (bstd + 1e-4))).abs() < 1e-12,
        "{a:?}"
    );
    let a = compute_advantages(&[1.0, f64::NAN, 3.0, 5.0], 4, ScaleRewards::None).unwrap();
    assert_eq!(a, vec![-2.0, 0.0, 0.0, 2.0]);
    assert!(compute_advantages(&r, 3, ScaleRewards::Group).is_err());
}

/// Bad batches and settings are typed errors, not panics.
#[test]
fn invalid_inputs_are_errors() {
    let t = GrpoTrainer::new(qwen3_tree(), None, &f32_options(), GrpoConfig::default()).unwrap();
    let c = |p: Vec<u32>, c: Vec<u32>| (p, c);
    // three completions for a group of four
    let b = GrpoBatch::single_reward(vec![c(vec![1], vec![2]); 3], &[0.0; 3]).unwrap();
    assert!(t.loss_and_gradients(&b).is_err());
    // a completion longer than max_completion_length
    let short = GrpoTrainer::new(
        qwen3_tree(),
        None,
        &f32_options(),
        GrpoConfig {
            max_completion_length: 2,
            ..Default::default()
        },
    )
    .unwrap();
    let b = GrpoBatch::single_reward(vec![c(vec![1], vec![2, 3, 4]); 4], &[0.0, 1.0, 0.0, 1.0])
        .unwrap();
    assert!(short.loss_and_gradients(&b).is_err());
    assert!(t.loss_and_gradients(&b).is_ok());
    // a group mixing two prompts
    let b = GrpoBatch::single_reward(
        vec![
            c(vec![1], vec![2]),
            c(vec![1], vec![2]),
            c(vec![5], vec![2]),
            c(vec![1], vec![2]),
        ],
        &[0.0; 4],
    )
    .unwrap();
    assert!(t.loss_and_gradients(&b).is_err());
    // an empty prompt
    let b = GrpoBatch::single_reward(vec![c(vec![], vec![2]); 4], &[0.0; 4]).unwrap();
    assert!(t.loss_and_gradients(&b).is_err());
    // old log-probs of the wrong length
    let mut b =
        GrpoBatch::single_reward(vec![c(vec![1], vec![2, 3]); 4], &[0.0, 1.0, 0.0, 1.0]).unwrap();
    b.old_logprobs = Some(vec![vec![0.0]; 4]);
    assert!(t.loss_and_gradients(&b).is_err());
    assert!(GrpoBatch::single_reward(vec![c(vec![1], vec![2])], &[0.0, 1.0]).is_err());
    let d = GrpoConfig::default();
    for (what, bad) in [
        ("group_size 1", GrpoConfig { group_size: 1, ..d.clone() }),
        ("epsilon 1.5", GrpoConfig { epsilon: 1.5, ..d.clone() }),
        ("beta -1", GrpoConfig { beta: -1.0, ..d.clone() }),
    ] {
        assert!(GrpoTrainer::new(qwen3_tree(), None, &f32_options(), bad).is_err(), "{what}");
    }
    // the batch is scored by one function but a completion carries two rewards
    let mut b = GrpoBatch::single_reward(vec![c(vec![1], vec![2]); 4], &[0.0; 4]).unwrap();
    b.completions[0] = Completion {
        prompt_ids: vec![1],
        completion_ids: vec![2],
        rewards: vec![0.0, 1.0],
    };
    assert!(t.loss_and_gradients(&b).is_err());
}
