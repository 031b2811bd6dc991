//! The parameter tree: checkpoint names and marks, a model rebuilt from it, and gradients through
//! a model built from replaced arrays (checked against finite differences).
mod common;

use common::{fixture, test_load_options};
use mlx_array::grad::value_and_grad;
use mlx_array::{Array, DType};
use mlx_models::{expected_tensors, load_model, Logits, Model, ParameterTree};

fn logits(m: &Model, ids: &[u32]) -> Array {
    let t = Array::from_slice(ids, &[1, ids.len()]).unwrap();
    let mut cache = m.new_cache();
    m.forward(&t, &mut cache, Logits::All, false).unwrap().logits.unwrap()
}

const IDS: [u32; 9] = [3, 17, 99, 4, 250, 8, 61, 7, 12];

/// The tree holds exactly the tensors the model reads (what a random checkpoint of the same
/// config holds), all trainable; the model built from it computes what the loaded one does.
#[test]
fn tree_names_the_checkpoint_and_rebuilds_the_model() {
    for name in ["qwen3", "gemma3_text", "lfm2"] {
        let dir = fixture(name);
        let opts = test_load_options();
        let tree = ParameterTree::load(&dir, &opts).unwrap();
        let mut want: Vec<String> = expected_tensors(&serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap()).unwrap().into_iter().map(|t| t.name).collect();
        want.sort();
        let got: Vec<&str> = tree.iter().map(|(n, _)| n).collect();
        assert_eq!(got, want, "{name}: tree names");
        assert_eq!(tree.trainable_names().len(), tree.len(), "{name}: float checkpoints start all trainable");
        let loaded = load_model(&dir, &opts).unwrap().into_lm().unwrap();
        let rebuilt = tree.build(&opts).unwrap().into_lm().unwrap();
        let (a, b) = (logits(&loaded, &IDS).to_vec::<f32>().unwrap(), logits(&rebuilt, &IDS).to_vec::<f32>().unwrap());
        assert_eq!(a, b, "{name}: rebuilt model's logits");
    }
}

/// Freezing and unfreezing by name; packed quantized tensors stay frozen; replacements are
/// checked.
#[test]
fn marks_and_replacements() {
    let opts = test_load_options();
    let mut tree = ParameterTree::load(fixture("qwen3"), &opts).unwrap();
    let n = tree.len();
    let frozen = tree.freeze(|k| k.contains("embed_tokens") || k.contains(".mlp."));
    assert!(frozen > 0);
    assert_eq!(tree.trainable_names().len(), n - frozen);
    assert!(tree.trainable_names().iter().all(|k| !k.contains(".mlp.")));
    assert_eq!(tree.unfreeze(|k| k.contains(".mlp.")), frozen - 1);
    assert!(tree.set("model.norm.weight", Array::zeros(&[3], DType::F32).unwrap()).is_err(), "wrong shape");
    assert!(tree.set("no.such.tensor", Array::zeros(&[3], DType::F32).unwrap()).is_err());
    assert!(tree.with_trainable(&[]).is_err(), "wrong count");

    let q = ParameterTree::load(fixture("llama_q4"), &opts).unwrap();
    let packed: Vec<&str> = q.iter().filter(|(_, p)| p.array.dtype() == DType::U32).map(|(k, _)| k).collect();
    assert!(!packed.is_empty());
    for k in &packed {
        let layer = k.strip_suffix(".weight").unwrap();
        for part in [".weight", ".scales", ".biases"] {
            let p = q.get(&format!("{layer}{part}")).unwrap();
            assert!(!p.trainable, "{layer}{part} is part of a quantized layer");
        }
    }
    let mut q2 = q.clone();
    assert_eq!(q2.unfreeze(|_| true), 0, "quantized layers cannot be made trainable, float ones already are");
    assert!(packed.iter().all(|k| q.get(k).unwrap().packed));
    let norms = q.trainable_names();
    assert!(!norms.is_empty() && norms.iter().all(|k| q.get(k).unwrap().array.dtype().is_float()));
    // the quantized tree rebuilds the same model too
    let loaded = load_model(fixture("llama_q4"), &opts).unwrap().into_lm().unwrap();
    let rebuilt = q.build(&opts).unwrap().into_lm().unwrap();
    assert_eq!(logits(&loaded, &IDS).to_vec::<f32>().unwrap(), logits(&rebuilt, &IDS).to_vec::<f32>().unwrap());
}

/// d loss / d params through a model built from the tree inside `value_and_grad` equals central
/// finite differences of the same loss (f32; a norm weight, an attention and an MLP projection),
/// with projections separate and fused (q/k/v and gate/up concatenated at build).
#[test]
fn gradients_flow_through_a_rebuilt_model() {
    for fuse in [false, true] {
        gradient_check(fuse);
    }
}

fn gradient_check(fuse: bool) {
    // flat caches: a paged pool queues its writes, which a gradient transform does not allow
    let opts = mlx_models::LoadOptions { dtype: Some(DType::F32), kv_cache: mlx_models::KvCacheMode::Flat, fuse_projections: Some(fuse), ..Default::default() };
    let mut tree = ParameterTree::load(fixture("qwen3"), &opts).unwrap();
    let picked = ["model.norm.weight", "model.layers.1.self_attn.k_proj.weight", "model.layers.0.mlp.down_proj.weight"];
    tree.freeze(|k| !picked.contains(&k));
    assert_eq!(tree.trainable_names(), {
        let mut p = picked.to_vec();
        p.sort();
        p
    });
    let targets = Array::from_slice(&IDS[1..], &[IDS.len() - 1]).unwrap();
    let loss_of = |params: &[Array]| -> mlx_array::Result<Array> {
        let m = tree.with_trainable(params).and_then(|t| t.build(&opts)).and_then(|m| m.into_lm()).map_err(|e| mlx_array::Error::InvalidArgument { op: "loss", msg: e.to_string() })?;
        let l = logits(&m, &IDS[..IDS.len() - 1]).reshape(&[(IDS.len() - 1) as i32, -1])?;
        // mean cross-entropy of the next token
        let logp = l.log_softmax(-1)?.take_along_axis(&targets.reshape(&[-1, 1])?.astype(DType::I32)?, -1)?;
        logp.mean(&[], false)?.mul_scalar(-1.0)
    };
    let params = tree.trainable_arrays();
    let (loss, grads) = value_and_grad(loss_of, &params).unwrap();
    let base = loss.item::<f32>().unwrap();
    assert!(base.is_finite() && base > 0.0);
    let eps = 1e-2f32;
    for (pi, (p, g)) in params.iter().zip(&grads).enumerate() {
        assert_eq!(g.shape(), p.shape());
        let flat = p.reshape(&[-1]).unwrap().to_vec::<f32>().unwrap();
        let gflat = g.reshape(&[-1]).unwrap().to_vec::<f32>().unwrap();
        assert!(gflat.iter().any(|x| x.abs() > 1e-3), "{}: gradient is zero", tree.trainable_names()[pi]);
        // the coordinates with the largest gradients (well above finite-difference noise)
        let mut order: Vec<usize> = (0..gflat.len()).collect();
        order.sort_by(|&a, &b| gflat[b].abs().total_cmp(&gflat[a].abs()));
        for &i in order.iter().take(3) {
            let shifted = |d: f32| {
                let mut v = flat.clone();
                v[i] += d;
                let mut ps = params.clone();
                ps[pi] = Array::from_slice(&v, &p.shape()).unwrap();
                loss_of(&ps).unwrap().item::<f32>().unwrap()
            };
            let fd = (shifted(eps) - shifted(-eps)) / (2.0 * eps);
            let rel = (fd - gflat[i]).abs() / gflat[i].abs().max(1e-3);
            assert!(rel < 2e-2, "fuse {fuse}: {}[{i}]: autodiff {} vs finite difference {fd}", tree.trainable_names()[pi], gflat[i]);
        }
    }
}
