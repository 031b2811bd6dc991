//! Activation-amax calibration against mlx-lm: `scripts/make_amax_fixture.py` quantizes the tiny
//! Qwen3 with mxfp8 attention projections, and all in nvfp4 (mlx-lm's `quantize_model`), and
//! records the running max |x| at each site's input over the texts of `calibration.txt` (prefill
//! of each text cut to 24 tokens, through a wrapper around mlx-lm's `QuantizedLinear`), then
//! mlx-lm's logits with those inputs quantized and dequantized (E4M3 per tensor; NVFP4 with the
//! maximum as MLX's global scale). Our maxima agree within 1e-5 relative (f32 on the CPU on both
//! sides), the forward that reads them gives mlx-lm's logits within 1e-4 relative (packed and
//! dequantized weights), and failures leave config.json as it was, byte for byte.
mod common;
use common::*;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use mlx_models::calibrate::{calibrate_activation_amax, calibrate_activation_amax_with, CalibrateError};
use mlx_models::{load_model, LoadOptions, QuantizedWeights};
use serde_json::Value;

/// Calibrations in this binary run one at a time (a concurrent one is refused by design).
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// A writable copy of a fixture directory (plus `extra` files from other fixtures).
/// A copy of the mxfp8 fixture, its config.json path and bytes.
fn mxfp8_copy() -> (tempfile::TempDir, PathBuf, PathBuf, Vec<u8>) {
    let (t, dir) = copy_of("qwen3_mxfp8_attn", &[]);
    let cfg = dir.join("config.json");
    let before = std::fs::read(&cfg).unwrap();
    (t, dir, cfg, before)
}

fn copy_of(name: &str, extra: &[(&str, &str)]) -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join(name);
    std::fs::create_dir(&dir).unwrap();
    for e in std::fs::read_dir(fixture(name)).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dir.join(e.file_name())).unwrap();
    }
    for (src, file) in extra {
        std::fs::copy(fixture(src).join(file), dir.join(file)).unwrap();
    }
    (tmp, dir)
}

fn texts() -> Vec<String> {
    std::fs::read_to_string(fixture("qwen3_mxfp8_attn").join("calibration.txt")).unwrap().lines().filter(|l| !l.is_empty()).map(String::from).collect()
}

fn json(p: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

#[test]
fn mxfp8_attention_amax_matches_mlx_lm_and_the_forward_reads_it() {
    check_fixture("qwen3_mxfp8_attn", 12);
}

#[test]
fn nvfp4_amax_matches_mlx_lm_and_the_forward_reads_it() {
    check_fixture("qwen3_nvfp4", 21);
}

fn check_fixture(name: &str, sites: usize) {
    let _s = serial();
    let (_tmp, dir) = copy_of(name, &[]);
    let before = json(&dir.join("config.json"));
    let r = json(&fixture(name).join("reference.json"));
    let s = calibrate_activation_amax(&dir, &texts(), 24).unwrap();
    let ref_amax = r["amax"].as_object().unwrap();
    assert_eq!(s.projections, sites);
    assert_eq!(s.rows, r["ids"].as_array().unwrap().len());
    assert_eq!(s.tokens, r["ids"].as_array().unwrap().iter().map(|ids| ids.as_array().unwrap().len()).sum::<usize>());
    assert_eq!(s.amax.keys().collect::<Vec<_>>(), ref_amax.keys().collect::<Vec<_>>());
    let after = json(&dir.join("config.json"));
    let mut worst = 0f64;
    for (layer, want) in ref_amax {
        let want = want.as_f64().unwrap();
        for alias in ["quantization", "quantization_config"] {
            let got = after[alias][layer]["input_amax"].as_f64().unwrap_or_else(|| panic!("{alias}.{layer} has no input_amax"));
            worst = worst.max((got - want).abs() / want);
        }
    }
    eprintln!("{name} amax: worst relative difference to mlx-lm {worst:.2e} over {} projections", ref_amax.len());
    assert!(worst <= 1e-5, "amax rel diff {worst}");
    // nothing else changed; a site without an entry of its own got one spelling out its mode
    let mut stripped = after.clone();
    for alias in ["quantization", "quantization_config"] {
        let block = stripped[alias].as_object_mut().unwrap();
        let default = serde_json::json!({"group_size": block["group_size"], "bits": block["bits"], "mode": block["mode"]});
        for (layer, e) in block.iter_mut() {
            if let Some(o) = e.as_object_mut() {
                o.remove("input_amax");
                if before[alias].get(layer).is_none() {
                    assert_eq!(*e, default, "{alias}.{layer}");
                }
            }
        }
        block.retain(|layer, _| before[alias].get(layer).is_some());
    }
    assert_eq!(stripped, before);

    // the forward fake-quantizes the calibrated inputs as mlx-lm's reference does
    let reference = mlx_array::io::load_safetensors(fixture(name).join("reference.safetensors"), Some(mlx_array::DType::F32)).unwrap();
    let prompt = ids(&reference["input_ids"]);
    let fq = reference["logits_fakequant"].to_vec::<f32>().unwrap();
    let plain = reference["logits_plain"].to_vec::<f32>().unwrap();
    for quantized in [QuantizedWeights::Keep, QuantizedWeights::Dequantize] {
        let m = load_model(&dir, &LoadOptions { quantized, ..Default::default() }).unwrap().into_lm().unwrap();
        let got = full_logits(&m, &prompt).concat();
        let e = rel_err(&got, &fq);
        eprintln!("{name} {quantized:?}: quantized-activation logits rel err {e:.2e}, against the plain logits {:.2e}", rel_err(&got, &plain));
        assert!(e < 1e-4, "{name} {quantized:?}: quantized-activation logits rel err {e}");
        assert!(rel_err(&got, &plain) > 1e-2, "{name} {quantized:?}: the activations were not quantized");
    }
    // without calibration the same checkpoint gives the plain logits
    let m = load_model(fixture(name), &LoadOptions::default()).unwrap().into_lm().unwrap();
    let e = rel_err(&full_logits(&m, &prompt).concat(), &plain);
    assert!(e < 1e-4, "{name}: uncalibrated logits rel err {e}");

    // a calibrated checkpoint re-calibrates on its raw activations: the same maxima
    let again = calibrate_activation_amax(&dir, &texts(), 24).unwrap();
    assert_eq!(again.amax, s.amax);
}

#[test]
fn a_second_concurrent_calibration_is_refused() {
    let _s = serial();
    let (_ta, a) = copy_of("qwen3_mxfp8_attn", &[]);
    let (_tb, b) = copy_of("qwen3_mxfp8_attn", &[]);
    let b_before = std::fs::read(b.join("config.json")).unwrap();
    let mut second = None;
    calibrate_activation_amax_with(&a, &texts(), 24, |p| {
        if p.row == 0 {
            let b = b.clone();
            second = Some(std::thread::spawn(move || calibrate_activation_amax(&b, &texts(), 24)).join().unwrap());
        }
    })
    .unwrap();
    assert!(matches!(second, Some(Err(CalibrateError::Busy))), "{second:?}");
    assert_eq!(std::fs::read(b.join("config.json")).unwrap(), b_before);
    // and once the first is done, the next one runs
    calibrate_activation_amax(&b, &texts(), 24).unwrap();
}

#[test]
fn failures_leave_config_json_byte_identical() {
    let _s = serial();
    let (_t, dir, cfg, before) = mxfp8_copy();
    let listing = |d: &Path| {
        let mut v: Vec<String> = std::fs::read_dir(d).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        v.sort();
        v
    };
    let files = listing(&dir);
    // zero rows: no text, or only texts that encode to nothing
    let e = calibrate_activation_amax(&dir, &[], 24).unwrap_err();
    assert!(matches!(e, CalibrateError::NoRows { texts: 0 }), "{e}");
    let e = calibrate_activation_amax(&dir, &[String::new(), String::new()], 24).unwrap_err();
    assert!(matches!(e, CalibrateError::NoRows { texts: 2 }), "{e}");
    let e = calibrate_activation_amax(&dir, &texts(), 0).unwrap_err();
    assert!(matches!(e, CalibrateError::ZeroSeqLen), "{e}");
    assert_eq!(std::fs::read(&cfg).unwrap(), before);
    assert_eq!(listing(&dir), files);

    // a quantized checkpoint without mxfp8 attention: zero projections is an error too
    let (_t2, affine) = copy_of("qwen3_untied_q8g32", &[("qwen3_untied", "tokenizer.json"), ("qwen3_untied", "tokenizer_config.json")]);
    let e = failed_calibration(&affine);
    assert!(matches!(e, CalibrateError::NoSites(_)), "{e}");

    // an unreadable checkpoint: the load fails, config.json stays
    let (_t3, broken) = copy_of("qwen3_mxfp8_attn", &[]);
    std::fs::remove_file(broken.join("tokenizer.json")).unwrap();
    failed_calibration(&broken);
}

/// Calibrate `dir`, which must fail and leave its config.json as it was; the error.
fn failed_calibration(dir: &Path) -> CalibrateError {
    let before = std::fs::read(dir.join("config.json")).unwrap();
    let e = calibrate_activation_amax(dir, &texts(), 24).unwrap_err();
    assert_eq!(std::fs::read(dir.join("config.json")).unwrap(), before, "{}: config.json changed", dir.display());
    e
}

/// config.json is replaced by a rename, not rewritten in place: a handle opened before still
/// reads the old file, and no temporary file is left.
#[test]
fn config_json_is_replaced_atomically() {
    use std::io::Read;
    let _s = serial();
    let (_t, dir, cfg, before) = mxfp8_copy();
    let mut old = std::fs::File::open(&cfg).unwrap();
    calibrate_activation_amax(&dir, &texts(), 24).unwrap();
    let mut seen = Vec::new();
    old.read_to_end(&mut seen).unwrap();
    assert_eq!(seen, before, "the open handle saw the file change in place");
    assert_ne!(std::fs::read(&cfg).unwrap(), before);
    let stray: Vec<String> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).filter(|n| n.starts_with('.')).collect();
    assert!(stray.is_empty(), "{stray:?}");
}

/// `input_amax` where no activation quantisation is implemented is a load error, never ignored.
#[test]
fn input_amax_outside_mxfp8_attention_is_a_load_error() {
    let (_t, dir) = copy_of("qwen3_mxfp8_attn", &[]);
    let cfg = dir.join("config.json");
    let original = json(&cfg);
    let load = |c: &Value| {
        std::fs::write(&cfg, serde_json::to_vec_pretty(c).unwrap()).unwrap();
        load_model(&dir, &LoadOptions::default()).map(|_| ())
    };
    // an affine MLP projection
    let mut c = original.clone();
    c["quantization"]["model.layers.0.mlp.down_proj"] = serde_json::json!({"group_size": 64, "bits": 4, "input_amax": 3.0});
    let e = load(&c).unwrap_err().to_string();
    assert!(e.contains("input_amax") && e.contains("mxfp8"), "{e}");
    // an mxfp8 layer outside attention
    let mut c = original.clone();
    c["quantization"]["model.layers.0.mlp.down_proj"] = serde_json::json!({"group_size": 32, "bits": 8, "mode": "mxfp8", "input_amax": 3.0});
    let e = load(&c).unwrap_err().to_string();
    assert!(e.contains("input_amax"), "{e}");
    // a maximum that is not a positive number
    for bad in [serde_json::json!(0.0), serde_json::json!(-1.0), serde_json::json!("3")] {
        let mut c = original.clone();
        c["quantization"]["model.layers.0.self_attn.q_proj"]["input_amax"] = bad.clone();
        let e = load(&c).unwrap_err().to_string();
        assert!(e.contains("input_amax"), "{bad}: {e}");
    }
    // at the top level, where it would name no layer
    let mut c = original.clone();
    c["quantization"]["input_amax"] = serde_json::json!(3.0);
    assert!(load(&c).unwrap_err().to_string().contains("input_amax"));
    // an nvfp4 layer that is no projection (the embedding table): no layer reads it
    let (_t2, nv) = copy_of("qwen3_nvfp4", &[]);
    let mut c = json(&nv.join("config.json"));
    c["quantization"]["model.embed_tokens"] = serde_json::json!({"group_size": 16, "bits": 4, "mode": "nvfp4", "input_amax": 3.0});
    std::fs::write(nv.join("config.json"), serde_json::to_vec_pretty(&c).unwrap()).unwrap();
    let e = load_model(&nv, &LoadOptions::default()).map(|_| ()).unwrap_err().to_string();
    assert!(e.contains("input_amax of model.embed_tokens"), "{e}");
    // a positive maximum on an mxfp8 attention projection loads
    let mut c = original;
    c["quantization"]["model.layers.0.self_attn.q_proj"]["input_amax"] = serde_json::json!(3.0);
    load(&c).unwrap();
}
