//! Fused projections (one product over concatenated q/k/v, gate/up, GatedDeltaNet inputs; the
//! GPU default) give the same outputs as separate products (the CPU default), on both of their
//! paths: one product for a few rows (decode), one product per part over views of the fused
//! weight for more (prefill).
use mlx_array::{Array, DType};
use mlx_models::{create_random_preset, load_model, KvCacheMode, LoadOptions, Logits, Model};
use std::path::Path;

fn load(dir: &Path, fuse: bool) -> Model {
    let opts = LoadOptions { dtype: Some(DType::F32), kv_cache: KvCacheMode::Flat, fuse_projections: Some(fuse), ..Default::default() };
    load_model(dir, &opts).unwrap().into_lm().unwrap()
}

/// Logits of a 24-token prompt (every position), of a 5-token step (every position: what a
/// speculative verify step reads; few rows run the joined product), then of 3 single-token
/// steps.
fn run(m: &Model) -> Vec<Vec<f32>> {
    let mut cache = m.new_cache();
    let ids: Vec<u32> = (0..24).map(|i| (i * 37 + 5) % 500).collect();
    let t = Array::from_slice(&ids, &[1, 24]).unwrap();
    let mut out = vec![m.forward(&t, &mut cache, Logits::All, false).unwrap().logits.unwrap().to_vec::<f32>().unwrap()];
    let t = Array::from_slice(&[11u32, 250, 3, 480, 77], &[1, 5]).unwrap();
    out.push(m.forward(&t, &mut cache, Logits::All, false).unwrap().logits.unwrap().to_vec::<f32>().unwrap());
    for id in [7u32, 300, 42] {
        let t = Array::from_slice(&[id], &[1, 1]).unwrap();
        out.push(m.forward(&t, &mut cache, Logits::Last, false).unwrap().logits.unwrap().to_vec::<f32>().unwrap());
    }
    out
}

fn check(name: &str, write: impl FnOnce(&Path)) {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path());
    let (fused, separate) = (run(&load(dir.path(), true)), run(&load(dir.path(), false)));
    for (step, (a, b)) in fused.iter().zip(&separate).enumerate() {
        assert_eq!(a.len(), b.len());
        let worst = a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
        assert!(worst < 1e-4, "{name} step {step}: fused and separate projections differ by {worst}");
    }
}

/// Every family with fused projections: Qwen3 (q/k/v, gate/up), Qwen3.5 (also the GatedDeltaNet
/// inputs), Gemma 4 and LFM2.
#[test]
fn fused_equals_separate() {
    for family in ["qwen3", "qwen3_5", "gemma4", "lfm2"] {
        check(family, |d| create_random_preset(family, "tiny", d, DType::F32, 3).unwrap());
    }
}
