//! `quantize` output written in shards as mlx-lm's `save_model` writes them: a tiny shard limit
//! gives several `model-0000k-of-0000n.safetensors` files whose tensors are bit for bit those of
//! the single-file output, which load in mlx-models to the same logits; the index has mlx-lm's
//! layout (its own index of the same quantization, from `scripts/make_quantized_fixtures.py`, and a
//! multi-shard index from `scripts/make_sharded_index_reference.py` running mlx-lm's `save_model`).
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use mlx_array::{Array, DType, QuantMode};
use mlx_convert::output::ShardedWriter;
use mlx_convert::{quantize_dir, ConvertError, QuantizeOptions};
use mlx_models::{load_model, LoadOptions, Logits, QuantizedWeights};
use serde_json::Value;

fn tiny(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/tests/fixtures/tiny").join(name)
}

fn read_json(p: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

/// Every tensor of a directory as (dtype, shape, raw bytes of its f32 view or u32 data).
fn tensors(dir: &Path) -> BTreeMap<String, (DType, Vec<usize>, Vec<u32>)> {
    mlx_array::io::load_dir(dir, None)
        .unwrap()
        .into_iter()
        .map(|(n, a)| {
            let bits = if a.dtype().is_float() {
                a.astype(DType::F32).unwrap().to_vec::<f32>().unwrap().iter().map(|x| x.to_bits()).collect()
            } else {
                a.astype(DType::U32).unwrap().to_vec::<u32>().unwrap()
            };
            (n, (a.dtype(), a.shape(), bits))
        })
        .collect()
}

fn logits(dir: &Path, prompt: &[u32]) -> Vec<f32> {
    let m = load_model(dir, &LoadOptions { quantized: QuantizedWeights::Keep, ..Default::default() }).unwrap().into_lm().unwrap();
    let mut cache = m.new_cache();
    let t = Array::from_slice(prompt, &[1, prompt.len()]).unwrap();
    m.forward(&t, &mut cache, Logits::All, false).unwrap().logits.unwrap().to_vec::<f32>().unwrap()
}

#[test]
fn tiny_shard_limit_gives_shards_equal_to_the_single_file() {
    let dir = tempfile::tempdir().unwrap();
    let (single, sharded) = (dir.path().join("single"), dir.path().join("sharded"));
    let opts = QuantizeOptions::default();
    let s1 = quantize_dir(&tiny("llama"), &single, &opts, |_| {}).unwrap();
    let limit = 16 * 1024;
    let s2 = quantize_dir(&tiny("llama"), &sharded, &QuantizeOptions { max_shard_bytes: limit, ..opts }, |_| {}).unwrap();
    assert_eq!(s1.shards, vec!["model.safetensors".to_string()]);
    let n = s2.shards.len();
    assert!(n >= 4, "{n} shards under a {limit}-byte limit for {} bytes", s2.bytes_written);
    let want: Vec<String> = (1..=n).map(|k| format!("model-{k:05}-of-{n:05}.safetensors")).collect();
    assert_eq!(s2.shards, want);
    assert_eq!(s1.bytes_written, s2.bytes_written);

    // what is on disk: the shards, the index, config and side files; no staging leftovers
    let names: BTreeSet<String> = std::fs::read_dir(&sharded).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    assert!(names.iter().all(|n| !n.starts_with('.')), "leftover files in {names:?}");
    assert!(!names.contains("model.safetensors"));
    let parent: Vec<String> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    assert!(parent.iter().all(|n| !n.starts_with('.')), "staging directory left: {parent:?}");

    // each shard holds at most `limit` bytes unless it is one oversized tensor, and the index
    // maps every tensor to the shard that holds it
    let index = read_json(&sharded.join("model.safetensors.index.json"));
    let map = index["weight_map"].as_object().unwrap();
    let mut total = 0u64;
    let mut seen = 0usize;
    for shard in &s2.shards {
        let f = mlx_array::io::SafetensorsFile::open(sharded.join(shard)).unwrap();
        assert_eq!(f.metadata().get("format").map(String::as_str), Some("mlx"), "{shard}");
        let infos = f.tensors();
        let bytes: u64 = infos.iter().map(|t| (t.shape.iter().product::<usize>() * t.dtype.size()) as u64).sum();
        assert!(bytes <= limit || infos.len() == 1, "{shard}: {bytes} bytes in {} tensors", infos.len());
        for t in &infos {
            assert_eq!(map[&t.name], Value::from(shard.as_str()), "{}", t.name);
        }
        total += bytes;
        seen += infos.len();
    }
    assert_eq!(seen, map.len());
    assert_eq!(index["metadata"]["total_size"], Value::from(total));
    assert_eq!(total, s2.bytes_written);
    let single_index = read_json(&single.join("model.safetensors.index.json"));
    assert_eq!(index["metadata"], single_index["metadata"]);

    // the same tensors bit for bit, and the same logits through the loader
    assert_eq!(tensors(&single), tensors(&sharded));
    let prompt = [1u32, 5, 9, 42, 7, 3, 100, 17];
    let (a, b) = (logits(&single, &prompt), logits(&sharded, &prompt));
    assert_eq!(a.len(), b.len());
    assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()), "sharded logits differ from single-file logits");
}

/// Our index of the Llama 4-bit quantization is mlx-lm's own (`save_model` of `quantize_model`'s
/// output, the parity fixture `llama_q4`): same metadata (total_size, total_parameters) and the
/// same weight_map.
#[test]
fn single_shard_index_equals_mlx_lm_index() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("q4");
    let opts = QuantizeOptions { mode: QuantMode::Affine { bits: 4, group_size: 64 }, dtype: Some(mlx_convert::OutDtype::F32), ..Default::default() };
    quantize_dir(&tiny("llama"), &out, &opts, |_| {}).unwrap();
    let ours = read_json(&out.join("model.safetensors.index.json"));
    let theirs = read_json(&tiny("llama_q4").join("model.safetensors.index.json"));
    assert_eq!(ours, theirs);
    // and written as json.dump(indent=4) writes it, keys in sorted order
    let text = std::fs::read_to_string(out.join("model.safetensors.index.json")).unwrap();
    assert!(text.starts_with("{\n    \"metadata\": {\n        \"total_size\": "), "{}", &text[..80.min(text.len())]);
}

/// A multi-shard index has the keys, metadata and file names mlx-lm's `save_model` writes
/// (reference: mlx-lm 0.32.2 run by `scripts/make_sharded_index_reference.py` with a 16 KiB limit
/// on the same quantization). The tensor order inside mlx-lm follows its module tree and ours
/// follows tensor names, so which tensor lands in which shard may differ; the rest is compared.
#[test]
fn multi_shard_index_has_mlx_lm_layout() {
    let reference = read_json(&PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llama_q4_sharded_16k.index.json"));
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("q4");
    let opts = QuantizeOptions { dtype: Some(mlx_convert::OutDtype::F32), max_shard_bytes: 16 * 1024, ..Default::default() };
    quantize_dir(&tiny("llama"), &out, &opts, |_| {}).unwrap();
    let ours = read_json(&out.join("model.safetensors.index.json"));
    let keys = |v: &Value| v.as_object().unwrap().keys().cloned().collect::<Vec<_>>();
    assert_eq!(keys(&ours), keys(&reference));
    assert_eq!(ours["metadata"], reference["metadata"]);
    assert_eq!(keys(&ours["weight_map"]), keys(&reference["weight_map"]));
    let files = |v: &Value| v["weight_map"].as_object().unwrap().values().map(|f| f.as_str().unwrap().to_string()).collect::<BTreeSet<_>>();
    let (a, b) = (files(&ours), files(&reference));
    // both: n > 1 shards named model-{k:05}-of-{n:05}.safetensors for k = 1..=n
    for set in [&a, &b] {
        let n = set.len();
        assert!(n > 1, "{set:?}");
        let want: BTreeSet<String> = (1..=n).map(|k| format!("model-{k:05}-of-{n:05}.safetensors")).collect();
        assert_eq!(*set, want);
    }
}

/// mlx-lm's `make_shards` rule: a new shard when the next tensor would pass the limit, and a
/// tensor larger than the limit alone in its shard.
#[test]
fn shard_boundaries_follow_make_shards() {
    let dir = tempfile::tempdir().unwrap();
    let mut w = ShardedWriter::new(dir.path(), 80).unwrap();
    // f32 tensors of 40, 40, 100, 20, 20, 40 bytes -> [a b] [c] [d e f] (20 + 20 + 40 = 80 fits)
    for (name, n) in [("a", 10), ("b", 10), ("c", 25), ("d", 5), ("e", 5), ("f", 10)] {
        w.add(name.into(), Array::from_slice(&vec![1f32; n], &[n]).unwrap()).unwrap();
    }
    let written = w.finish(55).unwrap();
    assert_eq!(written.files.len(), 3);
    let index = read_json(&dir.path().join("model.safetensors.index.json"));
    let shard_of = |t: &str| index["weight_map"][t].as_str().unwrap().to_string();
    assert_eq!(shard_of("a"), "model-00001-of-00003.safetensors");
    assert_eq!(shard_of("b"), "model-00001-of-00003.safetensors");
    assert_eq!(shard_of("c"), "model-00002-of-00003.safetensors");
    for t in ["d", "e", "f"] {
        assert_eq!(shard_of(t), "model-00003-of-00003.safetensors");
    }
    assert_eq!(index["metadata"]["total_size"], Value::from(260u64));
    assert_eq!(index["metadata"]["total_parameters"], Value::from(55u64));
}

#[test]
fn zero_shard_limit_and_duplicate_names_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    assert!(matches!(ShardedWriter::new(dir.path(), 0), Err(ConvertError::BadOption(_))));
    let mut w = ShardedWriter::new(dir.path(), 1 << 20).unwrap();
    w.add("a".into(), Array::from_slice(&[1f32], &[1]).unwrap()).unwrap();
    assert!(matches!(w.add("a".into(), Array::from_slice(&[1f32], &[1]).unwrap()), Err(ConvertError::Internal(_))));
    let out = dir.path().join("never");
    let e = quantize_dir(&tiny("llama"), &out, &QuantizeOptions { max_shard_bytes: 0, ..Default::default() }, |_| {}).unwrap_err();
    assert!(matches!(e, ConvertError::BadOption(_)), "{e}");
    assert!(!out.exists());
}
