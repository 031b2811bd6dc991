//! GGUF -> Hugging Face directory against references from `scripts/gguf_reference.py` (gguf-py's
//! dequantization with transformers' Q/K un-permutation) and `scripts/gguf_tokenizer_reference.py`
//! (transformers' GGUF tokenizer import).
use std::path::{Path, PathBuf};

use mlx_convert::{gguf_to_hf, ConvertError, GgufToHfOptions, OutDtype};
use serde_json::Value;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
}

fn convert(input: &Path, out: &Path, dtype: OutDtype) -> mlx_convert::ConvertSummary {
    gguf_to_hf(input, out, &GgufToHfOptions { dtype, config_from: None }, |_| {}).unwrap()
}

fn read_json(p: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

/// Our tokenizer.json encodes and decodes the reference texts as transformers' GGUF import does.
fn check_tokenizer(dir: &Path, reference: &Path) {
    let tok = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
    let r = read_json(reference);
    let texts = r["texts"].as_array().unwrap();
    assert!(texts.len() >= 8);
    for (i, t) in texts.iter().enumerate() {
        let t = t.as_str().unwrap();
        let want: Vec<u32> = r["ids"][i].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        let got = tok.encode(t, false).unwrap().get_ids().to_vec();
        assert_eq!(got, want, "encoding {t:?}");
        let decoded = tok.decode(&got, false).unwrap();
        assert_eq!(decoded, r["decoded"][i].as_str().unwrap(), "decoding {t:?}");
    }
}

#[test]
fn tiny_llama_tensors_equal_gguf_py_with_the_permutation_undone() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("hf");
    let s = convert(&fixtures().join("tiny-llama.gguf"), &out, OutDtype::F32);
    assert_eq!((s.architecture.as_str(), s.model_type.as_str(), s.tensors), ("llama", "llama", 21));
    let reference = std::fs::read(fixtures().join("tiny-llama.reference.safetensors")).unwrap();
    let reference = safetensors::SafeTensors::deserialize(&reference).unwrap();
    let ours = std::fs::read(out.join("model.safetensors")).unwrap();
    let ours = safetensors::SafeTensors::deserialize(&ours).unwrap();
    let mut names: Vec<_> = reference.names().into_iter().map(str::to_string).collect();
    names.sort();
    let mut our_names: Vec<_> = ours.names().into_iter().map(str::to_string).collect();
    our_names.sort();
    assert_eq!(names, our_names);
    for n in &names {
        let (a, b) = (ours.tensor(n).unwrap(), reference.tensor(n).unwrap());
        assert_eq!(a.shape(), b.shape(), "{n}");
        assert_eq!(a.dtype(), safetensors::Dtype::F32);
        assert_eq!(f32s(a.data()), f32s(b.data()), "{n}");
    }

    let cfg = read_json(&out.join("config.json"));
    assert_eq!(cfg["model_type"], "llama");
    assert_eq!(cfg["hidden_size"], 32);
    assert_eq!(cfg["num_attention_heads"], 4);
    assert_eq!(cfg["num_key_value_heads"], 2);
    assert_eq!(cfg["head_dim"], 8);
    assert_eq!(cfg["rms_norm_eps"], 1e-5);
    assert_eq!(cfg["tie_word_embeddings"], false);
    assert_eq!(cfg["vocab_size"], 273);
    let tc = read_json(&out.join("tokenizer_config.json"));
    assert_eq!(tc["bos_token"], "<|im_start|>");
    assert_eq!(tc["eos_token"], "<|im_end|>");
    assert_eq!(tc["pad_token"], "<|endoftext|>");
    assert!(tc["chat_template"].as_str().unwrap().contains("<|im_start|>"));
    assert_eq!(read_json(&out.join("generation_config.json"))["eos_token_id"], 2);
    check_tokenizer(&out, &fixtures().join("tiny-llama.tokens.json"));
}

#[test]
fn half_precision_output_rounds_the_f32_values() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("f32"), dir.path().join("bf16"));
    convert(&fixtures().join("tiny-llama.gguf"), &a, OutDtype::F32);
    convert(&fixtures().join("tiny-llama.gguf"), &b, OutDtype::Bf16);
    let a = std::fs::read(a.join("model.safetensors")).unwrap();
    let b = std::fs::read(b.join("model.safetensors")).unwrap();
    let (a, b) = (safetensors::SafeTensors::deserialize(&a).unwrap(), safetensors::SafeTensors::deserialize(&b).unwrap());
    let t32 = a.tensor("model.layers.0.self_attn.q_proj.weight").unwrap();
    let t16 = b.tensor("model.layers.0.self_attn.q_proj.weight").unwrap();
    assert_eq!(t16.dtype(), safetensors::Dtype::BF16);
    let want: Vec<u16> = f32s(t32.data()).iter().map(|&x| half::bf16::from_f32(x).to_bits()).collect();
    let got: Vec<u16> = t16.data().chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect();
    assert_eq!(got, want);
}

#[test]
fn a_failed_conversion_leaves_the_previous_output() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("hf");
    convert(&fixtures().join("tiny-llama.gguf"), &out, OutDtype::F32);
    let before = std::fs::read(out.join("model.safetensors")).unwrap();
    // a GGUF whose metadata is cut: the conversion fails before anything replaces `out`
    let bytes = std::fs::read(fixtures().join("tiny-llama.gguf")).unwrap();
    let broken = dir.path().join("broken.gguf");
    std::fs::write(&broken, &bytes[..bytes.len() / 3]).unwrap();
    let err = gguf_to_hf(&broken, &out, &GgufToHfOptions::default(), |_| {}).unwrap_err();
    assert!(matches!(err, ConvertError::Gguf(_)), "{err}");
    assert_eq!(std::fs::read(out.join("model.safetensors")).unwrap(), before);
    let leftovers: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(leftovers.len(), 2, "nothing partial may remain: {leftovers:?}");
    // a successful conversion replaces it whole
    convert(&fixtures().join("tiny-llama.gguf"), &out, OutDtype::F16);
    assert_ne!(std::fs::read(out.join("model.safetensors")).unwrap(), before);
}

#[test]
fn config_from_copies_the_hf_files_and_checks_them() {
    let dir = tempfile::tempdir().unwrap();
    let hf = dir.path().join("authoritative");
    std::fs::create_dir(&hf).unwrap();
    let cfg = serde_json::json!({"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}});
    std::fs::write(hf.join("config.json"), cfg.to_string()).unwrap();
    std::fs::write(hf.join("chat_template.jinja"), "{{ messages }}").unwrap();
    let out = dir.path().join("out");
    let opts = GgufToHfOptions { dtype: OutDtype::F32, config_from: Some(hf.clone()) };
    gguf_to_hf(&fixtures().join("tiny-llama.gguf"), &out, &opts, |_| {}).unwrap();
    assert_eq!(read_json(&out.join("config.json")), cfg);
    assert_eq!(std::fs::read_to_string(out.join("chat_template.jinja")).unwrap(), "{{ messages }}");
    assert!(!out.join("tokenizer.json").exists());

    let wrong = serde_json::json!({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4});
    std::fs::write(hf.join("config.json"), wrong.to_string()).unwrap();
    let err = gguf_to_hf(&fixtures().join("tiny-llama.gguf"), &dir.path().join("out2"), &opts, |_| {}).unwrap_err();
    assert!(matches!(&err, ConvertError::ConfigMismatch { key, .. } if key == "hidden_size"), "{err}");
    assert!(!dir.path().join("out2").exists());
}

#[test]
fn progress_reports_every_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let mut seen = Vec::new();
    gguf_to_hf(&fixtures().join("tiny-llama.gguf"), &dir.path().join("o"), &GgufToHfOptions::default(), |p| {
        seen.push((p.index, p.total, p.tensor.to_string()))
    })
    .unwrap();
    assert_eq!(seen.len(), 21);
    assert!(seen.iter().enumerate().all(|(i, s)| s.0 == i && s.1 == 21));
}

fn real_gguf(name: &str) -> PathBuf {
    let cache = std::env::var_os("MLX_MODELS_CACHE").map(PathBuf::from).unwrap_or_else(|| {
        PathBuf::from(std::env::var_os("HOME").expect("HOME")).join(".cache/mlx-models")
    });
    let p = cache.join("gguf").join(name);
    assert!(p.exists(), "{} missing: run scripts/fetch_gguf.sh", p.display());
    p
}

/// SmolLM2 (gpt2 BPE) and Gemma 3 (SentencePiece) checkpoints: their tensors convert and the
/// converted tokenizer encodes like transformers'. Needs the real files (`scripts/fetch_gguf.sh`).
#[test]
#[ignore]
fn real_tokenizers_encode_like_transformers() {
    for (gguf, tensors, tokens) in [
        ("SmolLM2-135M-Instruct.Q4_1.gguf", 272, "smollm2-135m-instruct.tokens.json"),
        ("gemma-3-270m-q4_k_m.gguf", 236, "gemma-3-270m.tokens.json"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let s = convert(&real_gguf(gguf), &dir.path().join("hf"), OutDtype::Bf16);
        assert_eq!(s.tensors, tensors, "{gguf}");
        check_tokenizer(&dir.path().join("hf"), &fixtures().join(tokens));
    }
}
