//! MLX-quantized checkpoints against mlx-lm: fixtures from `scripts/make_quantized_fixtures.py`
//! (mlx-lm's `quantize_model` on the tiny transformers fixtures, its f32 outputs on the CPU):
//! affine 4-bit with a quantized tied embedding (Llama), affine 8-bit in groups of 32 with an
//! untied quantized head (Qwen3), mxfp4 (Gemma 3) and mlx-lm's mixed_3_6 recipe with per-layer
//! bits (Llama 3), and MoE with stacked `switch_mlp` experts through `gather_qmm` and 8-bit routers
//! (LFM2-MoE 4-bit; Qwen3.5-MoE 8-bit in mlx-lm's `language_model.` layout; Gemma 4 MoE's
//! `experts.switch_glu` at mlx_lm.convert -q's affine 4/64, where the 32-wide expert down_proj
//! stays float, and in mxfp4; dense Gemma 4 with a quantized per-layer embedding table and
//! KV-shared layers). Logits within 1e-4 relative, 16 greedy tokens identical through the cache, with
//! the packed weights kept (`quantized_matmul`) and dequantized at load. And our `quantize`
//! writes exactly mlx-lm's tensors and config for the same source.
mod common;
use common::*;
use mlx_models::{load_model, LoadOptions, QuantizedWeights};

const FIXTURES: [(&str, &str); 9] = [
    ("llama_q4", "llama"),
    ("qwen3_untied_q8g32", "qwen3"),
    ("gemma3_text_mxfp4", "gemma3"),
    ("llama_mixed_3_6", "llama"),
    ("lfm2_moe_q4", "lfm2_moe"),
    ("qwen3_5_moe_vl_q8", "qwen3_5_moe"),
    ("gemma4_text_moe_q4", "gemma4"),
    ("gemma4_text_moe_mxfp4", "gemma4"),
    ("gemma4_text_q4g32", "gemma4"),
];

fn check(name: &str, model_type: &str, quantized: QuantizedWeights) {
    let r = reference(name);
    let opts = LoadOptions { quantized, ..test_load_options() };
    let model = load_model(fixture(name), &opts).unwrap().into_lm().unwrap();
    assert_eq!(model.info().model_type, model_type);
    let prompt = ids(&r["input_ids"]);
    let e = rel_err(&full_logits(&model, &prompt).concat(), &r["logits"].to_vec::<f32>().unwrap());
    eprintln!("{name} {quantized:?}: prefill logits rel err {e:.2e}");
    assert!(e < 1e-4, "{name} {quantized:?}: prefill logits rel err {e}");
    let mut cache = model.new_cache();
    let (toks, steps) = greedy_cached(&model, &mut cache, &prompt, 16);
    assert_eq!(toks, ids(&r["greedy_ids"])[prompt.len()..], "{name} {quantized:?}: greedy tokens");
    let e = rel_err(&steps.concat(), &r["decode_logits"].to_vec::<f32>().unwrap());
    assert!(e < 1e-4, "{name} {quantized:?}: decode logits rel err {e}");
}

#[test]
fn quantized_checkpoints_match_mlx_lm_with_packed_weights() {
    for (name, t) in FIXTURES {
        check(name, t, QuantizedWeights::Keep);
    }
}

#[test]
fn quantized_checkpoints_match_mlx_lm_dequantized_at_load() {
    for (name, t) in FIXTURES {
        check(name, t, QuantizedWeights::Dequantize);
    }
}

/// Prompts of 9 to [`mlx_array::ops::CPU_PACKED_NARROW_MAX_ROWS`] tokens run the packed
/// weights' products by the CPU kernels in one forward (longer ones dequantize every weight): the
/// logits of prefixes of such lengths are mlx-lm's for the same positions of its 72-token prompt,
/// within 1e-4 relative.
#[test]
fn short_prefills_match_mlx_lm() {
    let most = mlx_array::ops::CPU_PACKED_NARROW_MAX_ROWS;
    for (name, _) in FIXTURES {
        let r = reference(name);
        let model = load_model(fixture(name), &LoadOptions { quantized: QuantizedWeights::Keep, ..test_load_options() }).unwrap().into_lm().unwrap();
        let prompt = ids(&r["input_ids"]);
        let want = r["logits"].to_vec::<f32>().unwrap();
        let vocab = want.len() / prompt.len();
        for n in [9, 40, most] {
            let e = rel_err(&full_logits(&model, &prompt[..n]).concat(), &want[..n * vocab]);
            assert!(e < 1e-4, "{name}: a {n}-token prefill's logits rel err {e}");
        }
    }
}

/// Our `quantize` of each fixture's source equals mlx-lm's output tensor for tensor, bit for bit
/// (in mlx-lm's layout where its model stores tensors differently, as Gemma 4's experts), and
/// writes the same `quantization` entries.
#[test]
fn our_quantize_writes_mlx_lm_tensors() {
    use mlx_convert::{quantize_dir, QuantizeOptions, Recipe};
    use mlx_array::QuantMode;
    let dir = tempfile::tempdir().unwrap();
    let cases: [(&str, &str, QuantMode, Option<Recipe>); 9] = [
        ("llama_q4", "llama", QuantMode::Affine { bits: 4, group_size: 64 }, None),
        ("qwen3_untied_q8g32", "qwen3_untied", QuantMode::Affine { bits: 8, group_size: 32 }, None),
        ("gemma3_text_mxfp4", "gemma3_text", QuantMode::Mxfp4, None),
        ("llama_mixed_3_6", "llama_scaled", QuantMode::Affine { bits: 4, group_size: 32 }, Some(Recipe::Mixed3_6)),
        // Gemma 4 MoE: HF's fused experts written as mlx-lm's switch_glu, router at 8/64
        ("gemma4_text_moe_q4", "gemma4_text_moe", QuantMode::Affine { bits: 4, group_size: 64 }, None),
        ("gemma4_text_moe_mxfp4", "gemma4_text_moe", QuantMode::Mxfp4, None),
        ("gemma4_text_q4g32", "gemma4_text", QuantMode::Affine { bits: 4, group_size: 32 }, None),
        // LFM2-MoE: experts stacked into switch_mlp; Qwen3.5-MoE (ConditionalGeneration):
        // language_model.*, experts split into switch_mlp, norms stored as w + 1
        ("lfm2_moe_q4", "lfm2_moe", QuantMode::Affine { bits: 4, group_size: 32 }, None),
        ("qwen3_5_moe_vl_q8", "qwen3_5_moe_vl", QuantMode::Affine { bits: 8, group_size: 32 }, None),
    ];
    for (name, src, mode, recipe) in cases {
        let out = dir.path().join(name);
        let opts = QuantizeOptions { mode, recipe, dtype: Some(mlx_convert::OutDtype::F32), ..Default::default() };
        quantize_dir(&fixture(src), &out, &opts, |_| {}).unwrap();
        let ours = mlx_array::io::load_dir(&out, None).unwrap();
        let theirs = mlx_array::io::load_dir(&fixture(name), None).unwrap();
        let mut names: Vec<&String> = theirs.keys().collect();
        names.sort();
        for n in names {
            let (a, b) = (&ours.get(n).unwrap_or_else(|| panic!("{name}: we did not write {n}")), &theirs[n]);
            assert_eq!((a.dtype(), a.shape()), (b.dtype(), b.shape()), "{name}: {n}");
            let (x, y) = (a.astype(mlx_array::DType::F32).unwrap().to_vec::<f32>().unwrap(), b.astype(mlx_array::DType::F32).unwrap().to_vec::<f32>().unwrap());
            assert!(x.iter().zip(&y).all(|(p, q)| p.to_bits() == q.to_bits()), "{name}: {n} differs");
        }
        // mlx-lm drops a tied model's unused copies (none here): every tensor we wrote is theirs too
        let extra: Vec<&String> = ours.keys().filter(|k| !theirs.contains_key(*k)).collect();
        assert!(extra.is_empty(), "{name}: extra tensors {extra:?}");
        let cfg = |d: &std::path::Path| -> serde_json::Value { serde_json::from_str(&std::fs::read_to_string(d.join("config.json")).unwrap()).unwrap() };
        assert_eq!(cfg(&out)["quantization"], cfg(&fixture(name))["quantization"], "{name}: quantization config");
        // and it loads and runs like mlx-lm's
        let m = load_model(&out, &LoadOptions { quantized: QuantizedWeights::Keep, ..test_load_options() }).unwrap().into_lm().unwrap();
        let r = reference(name);
        let prompt = ids(&r["input_ids"]);
        if name != "gemma3_text_mxfp4" {
            let e = rel_err(&full_logits(&m, &prompt).concat(), &r["logits"].to_vec::<f32>().unwrap());
            assert!(e < 1e-4, "{name}: ours-quantized logits rel err {e}");
        }
    }
}

/// On the CPU (f32 compute) the scales and biases of quantized layers load in their stored dtype:
/// a checkpoint with bf16 scales computes exactly what the same checkpoint with those values
/// stored as f32 computes, through prefill (dequantized products, more rows than the packed
/// kernels take), cached decode steps (the packed kernels reading bf16 scales) and MoE experts.
#[test]
fn bf16_scales_compute_as_their_f32_copies() {
    use mlx_array::DType;
    if std::env::var("MLX_MODELS_TEST_DTYPE").is_ok_and(|d| d != "f32") {
        return;
    }
    for name in ["llama_q4", "qwen3_untied_q8g32", "lfm2_moe_q4"] {
        let tmp = tempfile::tempdir().unwrap();
        let dirs = [tmp.path().join("bf16"), tmp.path().join("f32")];
        let src = fixture(name);
        let tensors = mlx_array::io::load_dir(&src, None).unwrap();
        for (dir, dt) in dirs.iter().zip([DType::BF16, DType::F32]) {
            std::fs::create_dir_all(dir).unwrap();
            for f in std::fs::read_dir(&src).unwrap() {
                let p = f.unwrap().path();
                let n = p.file_name().unwrap().to_str().unwrap().to_string();
                if n.ends_with(".json") && !n.starts_with("model.safetensors.index") && !n.starts_with("reference") {
                    std::fs::copy(&p, dir.join(&n)).unwrap();
                }
            }
            let mut out: Vec<(String, mlx_array::Array)> = Vec::new();
            for (k, a) in &tensors {
                let q = (k.ends_with(".scales") || k.ends_with(".biases")) && a.dtype() == DType::F32;
                out.push((k.clone(), if q { a.astype(DType::BF16).unwrap().astype(dt).unwrap() } else { a.clone() }));
            }
            let refs: Vec<(&str, &mlx_array::Array)> = out.iter().map(|(k, a)| (k.as_str(), a)).collect();
            mlx_array::io::save_safetensors(dir.join("model.safetensors"), &refs, None).unwrap();
        }
        let opts = LoadOptions { quantized: QuantizedWeights::Keep, ..test_load_options() };
        let (a, b) = (load_model(&dirs[0], &opts).unwrap().into_lm().unwrap(), load_model(&dirs[1], &opts).unwrap().into_lm().unwrap());
        let prompt: Vec<u32> = (0..12u32).map(|i| (i * 37 + 5) % 200 + 3).collect();
        let differ = |x: &[Vec<f32>], y: &[Vec<f32>]| x.concat().iter().zip(y.concat()).filter(|(p, q)| p.to_bits() != q.to_bits()).count();
        let (pa, pb) = (full_logits(&a, &prompt), full_logits(&b, &prompt));
        assert_eq!(differ(&pa, &pb), 0, "{name}: prefill logits differ (rel err {})", rel_err(&pa.concat(), &pb.concat()));
        let (ta, la) = greedy_cached(&a, &mut a.new_cache(), &prompt[..5], 6);
        let (tb, lb) = greedy_cached(&b, &mut b.new_cache(), &prompt[..5], 6);
        assert_eq!(ta, tb, "{name}: greedy tokens");
        assert_eq!(differ(&la, &lb), 0, "{name}: decode logits differ ({})", rel_err(&la.concat(), &lb.concat()));
    }
}
