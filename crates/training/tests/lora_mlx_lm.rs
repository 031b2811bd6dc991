//! LoRA interchange with mlx-lm 0.32.2 (scripts/make_lora_mlx_lm_reference.py): adapters mlx-lm
//! made (its `linear_to_lora_layers`, saved from its trainable parameters) load into our trees
//! and give mlx-lm's logits, and so does the model fused from them (mlx-lm's `LoRALinear.fuse`,
//! requantized for the q4 base), within 1e-4 of the largest logit; the tiny Qwen3 (float) and
//! Llama q4 (QLoRA) fixtures. The other direction (mlx-lm loading ours) runs Python and is
//! ignored by default: `cargo test -p mlx-training --test lora_mlx_lm -- --ignored`
//! (`MLX_LM_PYTHON`, default /work/venvs/mlxlm/bin/python).
mod common;

use common::*;
use mlx_array::{Array, DType};
use mlx_models::{Logits, ParameterTree};
use mlx_training::lora::{self, LoraConfig};
use mlx_training::{SftConfig, SftTrainer};
use std::path::PathBuf;

const IDS: [u32; 8] = [1, 5, 9, 17, 33, 2, 250, 100];

fn reference_dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mlx_lm_lora").join(name)
}

fn logits(tree: &ParameterTree) -> Array {
    let m = tree.build(&f32_options()).unwrap().into_lm().unwrap();
    let mut cache = m.new_cache();
    let x = Array::from_slice(&IDS, &[1, IDS.len()]).unwrap();
    m.forward(&x, &mut cache, Logits::All, false).unwrap().logits.unwrap().astype(DType::F32).unwrap()
}

fn close(ours: &Array, theirs: &Array, what: &str) -> f32 {
    let (a, b) = (f32s(ours), f32s(theirs));
    let scale = b.iter().fold(1f32, |m, x| m.max(x.abs()));
    let e = max_abs(&a, &b);
    assert!(e <= 1e-4 * scale, "{what}: logits differ from mlx-lm's by {e} (largest {scale})");
    e
}

#[test]
fn mlx_lm_adapters_load_and_fuse_like_mlx_lm() {
    for (fixture, targets) in [("qwen3", 6), ("llama_q4", 14)] {
        let dir = reference_dir(fixture);
        let refs = mlx_array::io::load_safetensors(dir.join("logits.safetensors"), Some(DType::F32)).unwrap();
        let mut tree = ParameterTree::load(model_fixture(fixture), &f32_options()).unwrap();
        let cfg = lora::load_adapters(&mut tree, &dir).unwrap();
        assert_eq!((cfg.rank, cfg.scale, cfg.num_layers), (4, 3.0, 2));
        assert_eq!(tree.trainable_names().len(), 2 * targets, "{fixture}");
        let e1 = close(&logits(&tree), &refs["adapted"], &format!("{fixture} with adapters"));
        let fused = lora::fuse_lora(&tree).unwrap();
        let e2 = close(&logits(&fused), &refs["fused"], &format!("{fixture} fused"));
        eprintln!("{fixture}: adapted logits within {e1:e} of mlx-lm's, fused within {e2:e}");
        // the same projections are what our targets pick for the config mlx-lm wrote
        let picked = lora::lora_targets(&ParameterTree::load(model_fixture(fixture), &f32_options()).unwrap(), &cfg).unwrap();
        let mut names: Vec<String> = picked.iter().flat_map(|t| [format!("{}.lora_a", t.prefix), format!("{}.lora_b", t.prefix)]).collect();
        names.sort();
        assert_eq!(names, tree.trainable_names(), "{fixture}: our targets for mlx-lm's config");
    }
}

/// Adapters we train and save load in mlx-lm (its `load_adapters`) and give our logits.
#[test]
#[ignore = "runs mlx-lm 0.32.2 in Python (MLX_LM_PYTHON)"]
fn mlx_lm_loads_our_adapters() {
    let python = std::env::var("MLX_LM_PYTHON").unwrap_or_else(|_| "/work/venvs/mlxlm/bin/python".into());
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scripts/make_lora_mlx_lm_reference.py");
    let (meta, _) = reference();
    let examples = reference_batches(&meta).concat();
    for (fixture, cfg) in [
        ("qwen3", LoraConfig { rank: 4, scale: 2.0, keys: Some(vec!["self_attn.q_proj".into(), "mlp.up_proj".into()]), ..Default::default() }),
        ("llama_q4", LoraConfig { rank: 8, num_layers: 1, ..Default::default() }),
    ] {
        let mut tree = ParameterTree::load(model_fixture(fixture), &f32_options()).unwrap();
        lora::apply_lora(&mut tree, &cfg).unwrap();
        let sft = SftConfig { batch_size: 2, max_steps: Some(3), lora: Some(cfg.clone()), schedule: mlx_training::Schedule { lr: 1e-2, ..Default::default() }, ..Default::default() };
        let mut t = SftTrainer::new(tree, &f32_options(), examples.clone(), sft).unwrap();
        while t.step().unwrap().is_some() {}
        let tmp = tempfile::tempdir().unwrap();
        let ad = tmp.path().join("adapters");
        lora::save_adapters(&ad, t.tree(), &cfg).unwrap();
        let ours = logits(t.tree());
        let lf = tmp.path().join("logits.safetensors");
        mlx_array::io::save_safetensors(&lf, &[("adapted", &ours)], None).unwrap();
        // the test binary's library path points at our libmlx, not the Python package's
        let out = std::process::Command::new(&python).env_remove("LD_LIBRARY_PATH").arg(&script).arg("--check").arg(model_fixture(fixture)).arg(&ad).arg(&lf).output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        eprintln!("{fixture}: mlx-lm with our adapters: {text}");
        assert!(out.status.success(), "{fixture}: {text}{}", String::from_utf8_lossy(&out.stderr));
    }
}
