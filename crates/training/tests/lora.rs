//! LoRA: adapters on every family's projections, forward and gradients against torch
//! (scripts/make_training_reference.py, lora_reference.*: loss within 1e-5 relative, gradients
//! 1e-4 relative per tensor and global norm, adapters after three AdamW steps 1e-5 absolute),
//! adapter files, fusing and saving a full model.
mod common;

use common::*;
use mlx_array::{Array, DType};
use mlx_models::{Logits, ParameterTree};
use mlx_training::lora::{self, LoraConfig};
use mlx_training::{AdamWConfig, ClipConfig, Example, OptimizerConfig, Schedule, SftConfig, SftTrainer};
use std::collections::HashMap;
use std::path::PathBuf;

fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs()
}

fn lora_reference() -> (serde_json::Value, HashMap<String, Array>) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let meta: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("lora_reference.json")).unwrap()).unwrap();
    let tensors = mlx_array::io::load_safetensors(dir.join("lora_reference.safetensors"), Some(DType::F32)).unwrap();
    (meta, tensors)
}

/// The reference's LoRA config over the tiny Qwen3, adapters set to the reference's initial values.
fn reference_lora_tree() -> (ParameterTree, LoraConfig) {
    let (meta, refs) = lora_reference();
    let l = &meta["lora"];
    let cfg = LoraConfig {
        rank: l["rank"].as_u64().unwrap() as usize,
        scale: l["scale"].as_f64().unwrap() as f32,
        num_layers: l["num_layers"].as_i64().unwrap(),
        keys: Some(l["keys"].as_array().unwrap().iter().map(|k| k.as_str().unwrap().to_string()).collect()),
        ..Default::default()
    };
    let mut tree = qwen3_tree();
    let targets = lora::apply_lora(&mut tree, &cfg).unwrap();
    assert_eq!(targets.len(), 6, "three projections in each of the last two layers");
    assert!(targets.iter().all(|t| !t.prefix.starts_with("model.layers.0.")));
    for name in tree.trainable_names().iter().map(|s| s.to_string()).collect::<Vec<_>>() {
        tree.set(&name, refs[&format!("init.{name}")].clone()).unwrap();
    }
    (tree, cfg)
}

#[test]
fn lora_loss_and_gradients_match_torch() {
    let (meta, refs) = lora_reference();
    let batches = reference_batches(&reference().0);
    let batch: Vec<&Example> = batches[0].iter().collect();
    for chunked in [true, false] {
        let (tree, cfg) = reference_lora_tree();
        let sft = SftConfig { chunked_head: chunked, lora: Some(cfg), ..Default::default() };
        let t = SftTrainer::new(tree, &f32_options(), batches.concat(), sft).unwrap();
        let (loss, grads) = t.loss_and_gradients(&batch).unwrap();
        let want = meta["loss"].as_f64().unwrap();
        assert!(rel(loss as f64, want) < 1e-5, "loss {loss} vs torch {want}");
        let names = t.tree().trainable_names();
        assert_eq!(names.len(), 12);
        let (mut sq, mut worst) = (0f64, 0f64);
        for (n, g) in names.iter().zip(&grads) {
            let ours = f32s(g);
            let e = norm_rel(&ours, &f32s(&refs[&format!("grad.{n}")]));
            assert!(e < 1e-4, "gradient of {n}: relative error {e:e}");
            worst = worst.max(e);
            sq += ours.iter().map(|x| (*x as f64).powi(2)).sum::<f64>();
        }
        let want_norm = meta["grad_global_norm"].as_f64().unwrap();
        assert!(rel(sq.sqrt(), want_norm) < 1e-4, "global norm {} vs {want_norm}", sq.sqrt());
        eprintln!("chunked head {chunked}: loss relative error {:e}, worst gradient {worst:e}, global norm {:e}", rel(loss as f64, want), rel(sq.sqrt(), want_norm));
    }
}

#[test]
fn lora_adamw_steps_match_torch() {
    let (meta, refs) = lora_reference();
    let l = &meta["lora"];
    let (tree, cfg) = reference_lora_tree();
    let base = qwen3_tree();
    let examples = reference_batches(&reference().0).concat();
    let sft = SftConfig {
        batch_size: 2,
        shuffle: false,
        max_steps: Some(l["steps"].as_u64().unwrap()),
        optimizer: OptimizerConfig::AdamW(AdamWConfig::default()),
        clip: ClipConfig { max_norm: l["max_grad_norm"].as_f64(), max_value: None },
        schedule: Schedule { lr: l["lr"].as_f64().unwrap(), ..Default::default() },
        lora: Some(cfg),
        ..Default::default()
    };
    let mut t = SftTrainer::new(tree, &f32_options(), examples, sft).unwrap();
    let mut norms = Vec::new();
    while let Some(m) = t.step().unwrap() {
        norms.push(m.grad_norm);
    }
    for (ours, theirs) in norms.iter().zip(meta["adamw_grad_norms"].as_array().unwrap()) {
        assert!(rel(*ours as f64, theirs.as_f64().unwrap()) < 1e-4, "pre-clip norm {ours} vs torch {theirs}");
    }
    let mut worst = 0f32;
    for (n, p) in t.tree().iter() {
        if p.trainable {
            let e = max_abs(&f32s(&p.array), &f32s(&refs[&format!("adamw.{n}")]));
            assert!(e < 1e-5, "{n} differs from torch by {e:e}");
            worst = worst.max(e);
        } else {
            assert_eq!(f32s(&p.array), f32s(&base.get(n).unwrap().array), "frozen {n} unchanged");
        }
    }
    eprintln!("LoRA AdamW: largest adapter difference from torch {worst:e}");
}

fn logits(tree: &ParameterTree, ids: &[u32]) -> Vec<f32> {
    let m = tree.build(&f32_options()).unwrap().into_lm().unwrap();
    let mut cache = m.new_cache();
    let x = Array::from_slice(ids, &[1, ids.len()]).unwrap();
    f32s(&m.forward(&x, &mut cache, Logits::All, false).unwrap().logits.unwrap())
}

/// Default targets (every linear projection of the last 16 layers) on every family's fixture,
/// dense and quantized: the model builds with the adapters, fresh adapters (B = 0) leave the
/// logits unchanged, non-zero ones change them, and fusing reproduces the adapted logits
/// (up to rounding for float bases; quantized bases are requantized, packed as before).
#[test]
fn default_targets_on_every_family() {
    let ids = [1u32, 5, 9, 17, 33, 2];
    for (fixture, quantized) in [
        ("qwen3", false),
        ("qwen3_untied", false),
        ("llama", false),
        ("gemma3_text", false),
        ("gemma4_text", false),
        ("lfm2", false),
        ("qwen3_5", false),
        ("qwen3_5_moe", false),
        ("lfm2_moe", false),
        ("gemma4_text_moe", false),
        ("llama_q4", true),
        ("qwen3_untied_q8g32", true),
    ] {
        let base = ParameterTree::load(model_fixture(fixture), &f32_options()).unwrap();
        let mut tree = base.clone();
        let targets = lora::apply_lora(&mut tree, &LoraConfig::default()).unwrap();
        assert!(!targets.is_empty(), "{fixture}");
        if quantized {
            assert!(targets.iter().any(|t| tree.get(&format!("{}.scales", t.prefix)).is_some()), "{fixture}: a quantized base is adapted");
            assert!(tree.iter().filter(|(_, p)| p.packed).all(|(_, p)| !p.trainable), "{fixture}: packed stays frozen");
        }
        let want = logits(&base, &ids);
        assert_eq!(logits(&tree, &ids), want, "{fixture}: B = 0 leaves the model unchanged");
        for t in &targets {
            let name = format!("{}.lora_b", t.prefix);
            let b = mlx_array::random::normal(&[8, t.out_dim], DType::F32, &mlx_array::random::Key::new(t.in_dim as u64).unwrap()).unwrap().mul_scalar(0.01).unwrap();
            tree.set(&name, b).unwrap();
        }
        let adapted = logits(&tree, &ids);
        let moved = max_abs(&adapted, &want);
        assert!(moved > 1e-3, "{fixture}: adapters change the logits ({moved})");
        let fused = lora::fuse_lora(&tree).unwrap();
        assert!(fused.iter().all(|(n, _)| !n.contains("lora_")));
        let e = max_abs(&logits(&fused, &ids), &adapted);
        if quantized {
            // requantized in the base's mode: packed as before (mlx_lm.fuse's output is compared
            // in tests/mlx_lm_interop.rs)
            for t in &targets {
                let w = format!("{}.weight", t.prefix);
                assert_eq!(fused.get(&w).unwrap().array.dtype(), base.get(&w).unwrap().array.dtype(), "{w}");
                assert_eq!(fused.get(&w).unwrap().array.shape(), base.get(&w).unwrap().array.shape(), "{w}");
            }
        } else {
            let scale = adapted.iter().fold(0f32, |m, x| m.max(x.abs())).max(1.0);
            assert!(e < 1e-4 * scale, "{fixture}: fused logits differ by {e}");
        }
        eprintln!("{fixture}: {} targets, adapters move logits {moved:.3e}, fused differs {e:.3e}", targets.len());
    }
}

#[test]
fn targets_keys_and_layers() {
    let tree = qwen3_tree();
    let cfg = |keys: Option<Vec<&str>>, n: i64| LoraConfig { keys: keys.map(|k| k.into_iter().map(String::from).collect()), num_layers: n, ..Default::default() };
    assert_eq!(lora::lora_targets(&tree, &cfg(None, -1)).unwrap().len(), 3 * 7, "q k v o gate up down in 3 layers");
    assert_eq!(lora::lora_targets(&tree, &cfg(None, 1)).unwrap().len(), 7);
    assert_eq!(lora::lora_targets(&tree, &cfg(Some(vec!["self_attn.q_proj"]), 0)).unwrap().len(), 3);
    assert!(lora::lora_targets(&tree, &cfg(Some(vec!["self_attn.nope"]), 16)).is_err());
    assert!(lora::lora_targets(&tree, &cfg(Some(vec![]), 16)).is_err());
    let untied = ParameterTree::load(model_fixture("qwen3_untied"), &f32_options()).unwrap();
    let t = lora::lora_targets(&untied, &cfg(Some(vec!["lm_head", "mlp.down_proj"]), 1)).unwrap();
    assert_eq!(t.iter().map(|t| t.prefix.as_str()).collect::<Vec<_>>(), ["lm_head", "model.layers.2.mlp.down_proj"]);
    for bad in [LoraConfig { rank: 0, ..Default::default() }, LoraConfig { dropout: 1.0, ..Default::default() }, LoraConfig { scale: f32::NAN, ..Default::default() }] {
        assert!(lora::apply_lora(&mut qwen3_tree(), &bad).is_err());
    }
    // a tree with adapters needs its config in SftConfig, and the other way round
    let mut t = qwen3_tree();
    lora::apply_lora(&mut t, &LoraConfig::default()).unwrap();
    let ex = reference_batches(&reference().0).concat();
    assert!(SftTrainer::new(t, &f32_options(), ex.clone(), SftConfig::default()).is_err());
    assert!(SftTrainer::new(qwen3_tree(), &f32_options(), ex, SftConfig { lora: Some(LoraConfig::default()), ..Default::default() }).is_err());
}

/// Adapters on the output head (untied) train through the model's logits (the chunked head
/// reads the head weight alone, so it is not used), and dropout draws the same masks for the
/// same seed.
#[test]
fn head_adapters_and_dropout() {
    let mut tree = ParameterTree::load(model_fixture("qwen3_untied"), &f32_options()).unwrap();
    let cfg = LoraConfig { keys: Some(vec!["lm_head".into(), "self_attn.q_proj".into()]), dropout: 0.3, ..Default::default() };
    lora::apply_lora(&mut tree, &cfg).unwrap();
    let ex = reference_batches(&reference().0).concat();
    let sft = SftConfig { batch_size: 2, shuffle: false, max_steps: Some(2), lora: Some(cfg), schedule: Schedule { lr: 1e-2, ..Default::default() }, ..Default::default() };
    let mut a = SftTrainer::new(tree.clone(), &f32_options(), ex.clone(), sft.clone()).unwrap();
    assert!(!a.uses_chunked_head());
    let mut b = SftTrainer::new(tree, &f32_options(), ex, sft).unwrap();
    while let (Some(x), Some(y)) = (a.step().unwrap(), b.step().unwrap()) {
        assert_eq!(x.loss, y.loss);
    }
    for ((n, p), (_, q)) in a.tree().iter().zip(b.tree().iter()) {
        assert_eq!(f32s(&p.array), f32s(&q.array), "{n}: same seed, same dropout masks");
    }
    assert!(a.tree().get("lm_head.lora_b").map(|p| f32s(&p.array).iter().any(|x| *x != 0.0)).unwrap(), "head adapter trained");
}

/// Adapters and full models saved, read back and refused when they do not fit.
#[test]
fn adapter_files_and_saved_model() {
    let (tree, cfg) = reference_lora_tree();
    let dir = tempfile::tempdir().unwrap();
    let ad = dir.path().join("adapters");
    lora::save_adapters(&ad, &tree, &cfg).unwrap();
    let written: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(ad.join("adapter_config.json")).unwrap()).unwrap();
    assert_eq!(written["fine_tune_type"], "lora");
    assert_eq!(written["num_layers"], 2);
    assert_eq!(written["lora_parameters"]["rank"], 4);
    assert_eq!(written["lora_parameters"]["scale"], 2.0);
    let mut back = qwen3_tree();
    let read = lora::load_adapters(&mut back, &ad).unwrap();
    assert_eq!((read.rank, read.scale, read.num_layers), (cfg.rank, cfg.scale, cfg.num_layers));
    assert_eq!(back.trainable_names(), tree.trainable_names());
    let ids = [3u32, 4, 5, 6];
    assert_eq!(logits(&back, &ids), logits(&tree, &ids));
    // mismatches are typed errors
    let mut other = ParameterTree::load(model_fixture("lfm2"), &f32_options()).unwrap();
    assert!(lora::load_adapters(&mut other, &ad).is_err(), "adapters of another model");
    let mut text = std::fs::read_to_string(ad.join("adapter_config.json")).unwrap();
    text = text.replace("\"rank\": 4", "\"rank\": 5");
    std::fs::write(ad.join("adapter_config.json"), &text).unwrap();
    assert!(lora::load_adapters(&mut qwen3_tree(), &ad).is_err(), "rank does not match the tensors");
    std::fs::write(ad.join("adapter_config.json"), "{\"fine_tune_type\": \"dora\", \"num_layers\": 2, \"lora_parameters\": {\"rank\": 4, \"scale\": 2.0}}").unwrap();
    assert!(lora::load_adapters(&mut qwen3_tree(), &ad).is_err(), "DoRA");
    std::fs::write(ad.join("adapter_config.json"), "not json").unwrap();
    assert!(lora::load_adapters(&mut qwen3_tree(), &ad).is_err());
    // a full model in Hugging Face's layout loads like the fused tree
    assert!(lora::save_model(&tree, &dir.path().join("m"), None).is_err(), "adapters must be fused first");
    let fused = lora::fuse_lora(&tree).unwrap();
    let out = dir.path().join("model");
    lora::save_model(&fused, &out, Some(DType::F32)).unwrap();
    for f in ["model.safetensors", "config.json", "tokenizer.json"] {
        assert!(out.join(f).is_file(), "{f}");
    }
    let cfg_json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg_json["torch_dtype"], "float32");
    let reloaded = ParameterTree::load(&out, &f32_options()).unwrap();
    let (x, y) = (logits(&reloaded, &ids), logits(&tree, &ids));
    assert!(max_abs(&x, &y) < 1e-4, "{}", max_abs(&x, &y));
}
