//! Harrier embeddings vs sentence-transformers semantics computed with transformers 5.23.
mod common;
use common::*;
use mlx_models::load_model;

#[test]
fn harrier_embeddings_match_reference() {
    let r = reference("qwen3_embed");
    let m = load_model(fixture("qwen3_embed"), &test_load_options()).unwrap().into_embedding().unwrap();
    // Inputs of different lengths (72, 17, 4 tokens) are listed in reference.json.
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(fixture("qwen3_embed").join("reference.json")).unwrap()).unwrap();
    let inputs: Vec<Vec<u32>> = serde_json::from_value(json["embed_inputs"].clone()).unwrap();
    let n = inputs.len();
    let want = r["embeddings"].to_vec::<f32>().unwrap();
    let d = m.hidden_size();
    for i in 0..n {
        let e = m.encode_ids(&inputs[i]).unwrap();
        let w = &want[i * d..(i + 1) * d];
        let cos: f32 = e.iter().zip(w).map(|(a, b)| a * b).sum::<f32>()
            / (e.iter().map(|x| x * x).sum::<f32>().sqrt() * w.iter().map(|x| x * x).sum::<f32>().sqrt());
        assert!(cos >= 0.999, "embedding {i}: cosine {cos}");
        let norm: f32 = e.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-4, "not L2-normalized: {norm}");
    }
    assert!(load_model(fixture("qwen3_embed"), &test_load_options()).unwrap().into_lm().is_err());
    assert!(m.encode_ids(&[]).is_err());
    let batch = m.encode_batch_ids(&inputs).unwrap();
    assert_eq!(batch[1], m.encode_ids(&inputs[1]).unwrap());
}

#[test]
fn text_encoding_with_instruction_presets() {
    let dir = fixture("qwen3_embed");
    let m = load_model(&dir, &test_load_options()).unwrap().into_embedding().unwrap();
    let tok = mlx_models::chat::Tokenizer::from_dir(&dir).unwrap();
    let q = m.prompts["query"].clone();
    assert!(q.starts_with("Instruct:"));
    let via_text = m.encode("hello world", Some("query")).unwrap();
    let via_ids = m.encode_ids(&tok.encode(&format!("{q}hello world"), true).unwrap()).unwrap();
    assert_eq!(via_text, via_ids);
    assert_eq!(m.encode("hello world", Some("document")).unwrap(), m.encode_ids(&tok.encode("hello world", true).unwrap()).unwrap());
    let b = m.encode_batch(&["a", "hello world"], Some("query")).unwrap();
    assert_eq!(b[1], via_text);
    assert!(m.encode("x", Some("nope")).is_err());
    assert!(m.encode_ids(&[100_000]).is_err(), "ids out of vocab are refused");
}

/// One loaded embedding model serves several threads: `Arc<HarrierModel>` is `Send + Sync`, and
/// embeddings computed on other threads at once equal the loading thread's.
#[test]
fn embeddings_on_threads_share_one_model() {
    fn send_sync<T: Send + Sync>(_: &T) {}
    let m = load_model(fixture("qwen3_embed"), &test_load_options()).unwrap().into_embedding().unwrap();
    send_sync(&m);
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(fixture("qwen3_embed").join("reference.json")).unwrap()).unwrap();
    let inputs: Vec<Vec<u32>> = serde_json::from_value(json["embed_inputs"].clone()).unwrap();
    let want: Vec<Vec<f32>> = inputs.iter().map(|ids| m.encode_ids(ids).unwrap()).collect();
    let got: Vec<Vec<f32>> = std::thread::scope(|s| {
        let hs: Vec<_> = inputs.iter().map(|ids| { let m = m.clone(); s.spawn(move || m.encode_ids(ids).unwrap()) }).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(got, want);
}
