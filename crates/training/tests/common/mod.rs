//! Shared by the training tests: fixture paths, load options, references.
#![allow(dead_code)]
use mlx_array::{Array, DType};
use mlx_models::{KvCacheMode, LoadOptions, ParameterTree};
use mlx_training::Example;
use std::collections::HashMap;
use std::path::PathBuf;

pub fn model_fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../models/tests/fixtures/tiny")
        .join(name)
}

/// f32 weights, flat cache, separate projections: what the torch references compute.
pub fn f32_options() -> LoadOptions {
    LoadOptions {
        dtype: Some(DType::F32),
        kv_cache: KvCacheMode::Flat,
        fuse_projections: Some(false),
        ..Default::default()
    }
}

pub fn qwen3_tree() -> ParameterTree {
    ParameterTree::load(model_fixture("qwen3"), &f32_options()).unwrap()
}

pub fn reference() -> (serde_json::Value, HashMap<String, Array>) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    let tensors =
        mlx_array::io::load_safetensors(dir.join("reference.safetensors"), Some(DType::F32))
            .unwrap();
    (meta, tensors)
}

/// A JSON array of token ids.
pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// The reference's batches as examples, batch by batch.
pub fn reference_batches(meta: &serde_json::Value) -> Vec<Vec<Example>> {
    meta["batches"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| {
            b.as_array()
                .unwrap()
                .iter()
                .map(|pc| Example::prompt_completion(&ids(&pc[0]), &ids(&pc[1])))
                .collect()
        })
        .collect()
}

pub fn f32s(a: &Array) -> Vec<f32> {
    a.astype(DType::F32)
        .unwrap()
        .reshape(&[-1])
        .unwrap()
        .to_vec::<f32>()
        .unwrap()
}

/// ||a - b|| / ||b||.
pub fn norm_rel(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let d: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| ((x - y) as f64).powi(2))
        .sum::<f64>()
        .sqrt();
    let n: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum::<f64>().sqrt();
    d / n.max(1e-12)
}

pub fn max_abs(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()))
}

/// The parameter subset the reference's optimizer runs train.
pub fn ref_trainable(name: &str) -> bool {
    name.contains("self_attn") || name.contains("norm")
}

/// An example binary of this package (built by `cargo test`; built here, with the test's own
/// profile, when a test runs alone).
pub fn example_binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let profile = exe.parent().unwrap().parent().unwrap();
    let bin = profile.join("examples").join(name);
    if !bin.is_file() {
        let mut cmd = std::process::Command::new(env!("CARGO"));
        cmd.args(["build", "-p", "mlx-training", "--example", name]);
        if profile.file_name().is_some_and(|n| n == "release") {
            cmd.arg("--release");
        }
        assert!(cmd.status().unwrap().success(), "building the {name} example");
    }
    bin
}
/// Asserts that gradients `got` equal `want` (both in `names` order) within `tol`: per tensor,
/// ||a - b|| / ||b|| with ||b|| floored at 1e-3 of the global gradient norm (a gradient a
/// million times smaller than the largest is f32 rounding noise of both paths).
pub fn assert_grads_close(label: &str, names: &[&str], got: &[Array], want: &[Array], tol: f64) {
    assert_eq!(got.len(), want.len(), "{label}: gradient count");
    let global: f64 = want
        .iter()
        .map(|g| f32s(g).iter().map(|x| (*x as f64).powi(2)).sum::<f64>())
        .sum::<f64>()
        .sqrt();
    for ((n, a), b) in names.iter().zip(got).zip(want) {
        let (a, b) = (f32s(a), f32s(b));
        let diff: f64 = a
            .iter()
            .zip(&b)
            .map(|(x, y)| ((x - y) as f64).powi(2))
            .sum::<f64>()
            .sqrt();
        let scale: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum::<f64>().sqrt();
        let e = diff / scale.max(1e-3 * global);
        assert!(e < tol, "{label}: gradient of {n}: relative difference {e:e} (norm {scale:e}, global {global:e})");
    }
}

/// What `f` returns and MLX's peak memory while it ran, above the memory active before it
/// (the allocator's cache cleared first).
pub fn peak_during<T>(f: impl FnOnce() -> T) -> (T, usize) {
    mlx_array::memory::clear_cache().unwrap();
    mlx_array::memory::reset_peak().unwrap();
    let base = mlx_array::memory::active().unwrap();
    let out = f();
    (out, mlx_array::memory::peak().unwrap().saturating_sub(base))
}

/// A random-weight checkpoint in a temporary directory: the `fixture` model's config with the
/// `changes` applied.
pub fn random_variant(fixture: &str, changes: &[(&str, serde_json::Value)]) -> tempfile::TempDir {
    let mut cfg: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(model_fixture(fixture).join("config.json")).unwrap(),
    )
    .unwrap();
    for (k, v) in changes {
        cfg[*k] = v.clone();
    }
    let dir = tempfile::tempdir().unwrap();
    mlx_models::create_random_checkpoint(&cfg, dir.path(), DType::F32, 1).unwrap();
    dir
}

/// `b` with NaN recorded old log-probs (a non-finite GRPO loss) when `nan`.
pub fn nan_old_logprobs(mut b: mlx_training::GrpoBatch, nan: bool) -> mlx_training::GrpoBatch {
    if nan {
        b.old_logprobs = Some(
            b.completions
                .iter()
                .map(|c| vec![f32::NAN; c.completion_ids.len()])
                .collect(),
        );
    }
    b
}

/// Example `name` started with `args` in `dir` and killed (SIGKILL) after `delay_ms`; waits for
/// it to end.
pub fn killed_run(name: &str, args: &[&str], dir: &std::path::Path, delay_ms: u64) {
    let mut child = std::process::Command::new(example_binary(name))
        .args(args)
        .current_dir(dir)
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(delay_ms));
    child.kill().unwrap();
    child.wait().unwrap();
}

/// Example `name` run with `args` in `dir`: (success, stdout, stderr).
pub fn run_example(name: &str, args: &[&str], dir: &std::path::Path) -> (bool, String, String) {
    let out = std::process::Command::new(example_binary(name))
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
    )
}
