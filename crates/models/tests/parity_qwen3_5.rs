//! Qwen3.5 dense and MoE parity against transformers 5.23 (f32 eager reference) on the tiny
//! fixtures (text-only and ConditionalGeneration layouts; per-expert and fused experts): full
//! prefill logits within 1e-3 relative, 16 greedy tokens identical, cached decode equal to a full
//! recompute. The 72-token prompt spans more than one 64-position GatedDeltaNet chunk.
mod common;
use common::*;
use mlx_array::Array;
use mlx_models::families::gated_delta;

/// Dense and MoE, text-only and ConditionalGeneration layouts, per-expert and fused experts.
#[test]
fn every_layout_matches_transformers() {
    for (name, model_type) in [("qwen3_5", "qwen3_5"), ("qwen3_5_vl", "qwen3_5_vl"), ("qwen3_5_moe", "qwen3_5_moe"), ("qwen3_5_moe_vl", "qwen3_5_vl")] {
        check_transformers_parity(name, model_type);
    }
}

/// Prefill in pieces of 20 (the recurrent state and conv state carry across calls), then
/// single-token steps, equals one prefill.
#[test]
fn piecewise_prefill_equals_single_prefill() {
    for name in ["qwen3_5", "qwen3_5_moe"] {
        check_chunked_prefill(name, &[20], 8);
    }
}

/// The chunked delta rule equals the token-by-token recurrence, across chunk boundaries and with a
/// nonzero initial state.
#[test]
fn chunked_delta_rule_equals_recurrent() {
    use mlx_array::random::{normal_with, uniform, Key};
    use mlx_array::DType;
    let (b, l, h, dk, dv) = (1usize, 150usize, 3usize, 8usize, 5usize);
    let ks = Key::new(7).unwrap().split_n(6).unwrap();
    let unit = |a: Array| a.mul(&a.square().unwrap().sum(&[-1], true).unwrap().rsqrt().unwrap()).unwrap();
    let q = unit(normal_with(&[b, l, h, dk], 0.0, 1.0, DType::F32, &ks[0]).unwrap()).mul_scalar(0.3).unwrap();
    let k = unit(normal_with(&[b, l, h, dk], 0.0, 1.0, DType::F32, &ks[1]).unwrap());
    let v = normal_with(&[b, l, h, dv], 0.0, 1.0, DType::F32, &ks[2]).unwrap();
    let g = uniform(&[b, l, h], -0.5, 0.0, DType::F32, &ks[3]).unwrap();
    let beta = uniform(&[b, l, h], 0.0, 1.0, DType::F32, &ks[4]).unwrap();
    let s0 = normal_with(&[b, h, dv, dk], 0.0, 0.5, DType::F32, &ks[5]).unwrap(); // Sᵀ
    let (y1, s1) = gated_delta::recurrent(&q, &k, &v, &g, &beta, s0.clone()).unwrap();
    let (y2, s2) = gated_delta::chunked(&q, &k, &v, &g, &beta, s0).unwrap();
    let e = rel_err(&y2.to_vec::<f32>().unwrap(), &y1.to_vec::<f32>().unwrap());
    assert!(e < 1e-4, "outputs rel err {e}");
    let e = rel_err(&s2.to_vec::<f32>().unwrap(), &s1.to_vec::<f32>().unwrap());
    assert!(e < 1e-4, "state rel err {e}");
}

mod sessions {
    use super::common::*;
    use mlx_models::chat::ChatMessage;
    use mlx_models::load_session;

    /// Chat start matches the reference's chat greedy ids; a continue appends to the recurrent
    /// state (exact-prefix reuse) and equals a recompute; a diverging restart re-prefills.
    fn chat_start_and_continue(name: &str) {
        let r = reference(name);
        let mut s = load_session(fixture(name), &test_load_options()).unwrap();
        let res = s.start(vec![ChatMessage::user("Hello! What is 2+2?")], &greedy_chat(16)).unwrap();
        let prompt = ids(&r["chat_input_ids"]);
        assert_eq!(res.prompt_tokens, prompt.len());
        assert_eq!(s.cached_ids(), &ids(&r["chat_greedy_ids"])[..], "{name}: first turn equals the reference");

        let turn1 = s.cached_ids().len();
        let res = s.continue_with("And then?", &greedy_chat(8)).unwrap();
        assert_eq!(res.cached_tokens, turn1, "{name}: the whole first turn is reused");
        check_reply_equals_fresh_generation(name, &s, &res);

        // A different conversation diverges inside the cache: the recurrent cache is reset.
        let res = s.start(vec![ChatMessage::user("Something else")], &greedy_chat(4)).unwrap();
        assert_eq!(res.cached_tokens, 0, "{name}: recurrent caches cannot be trimmed, so the prompt is re-prefilled");
        let again = s.continue_with("ok", &greedy_chat(4)).unwrap();
        assert!(again.cached_tokens > 0);
    }

    #[test]
    fn dense_and_moe_chat_sessions() {
        for name in ["qwen3_5", "qwen3_5_moe_vl"] {
            chat_start_and_continue(name);
        }
    }
}

mod random_and_mtp {
    use super::common::*;
    use mlx_array::{Array, DType};
    use mlx_models::families::qwen3_5::{Qwen35Config, Qwen35Model};
    use mlx_models::weights::Weights;
    use mlx_models::{create_random_checkpoint, create_random_preset, load_model, preset_config, Logits, ModelRuntime};
    use std::path::Path;

    fn load_concrete(dir: &Path, family: &str) -> Qwen35Model {
        let raw = mlx_models::config::read_config_json(dir).unwrap();
        let text = mlx_models::config::text_config(&raw);
        let cfg: Qwen35Config = mlx_models::config::parse(dir, &text).unwrap();
        let w = Weights::load(dir, Some(DType::F32)).unwrap();
        Qwen35Model::new(&w, cfg, &text, vec![], family).unwrap()
    }

    #[test]
    fn random_checkpoints_load_and_run() {
        let tmp = tempfile::tempdir().unwrap();
        for (moe, sub) in [(false, "dense"), (true, "moe")] {
            let dir = tmp.path().join(sub);
            create_random_preset(if moe { "qwen3_5_moe" } else { "qwen3_5" }, "tiny", &dir, DType::BF16, 3).unwrap();
            let m = load_model(&dir, &test_load_options()).unwrap().into_lm().unwrap();
            assert_eq!(m.info().model_type, if moe { "qwen3_5_moe" } else { "qwen3_5" });
            let prompt: Vec<u32> = (1..40).collect();
            let mut c = m.new_cache();
            let (toks, _) = greedy_cached(&m, &mut c, &prompt, 4);
            assert_eq!(toks.len(), 4);
            let full = full_logits(&m, &prompt);
            assert!(full.iter().flatten().all(|x| x.is_finite()));
            assert!(!load_concrete(&dir, if moe { "qwen3_5_moe" } else { "qwen3_5" }).has_mtp_weights());
        }
        // An MoE config without num_experts is refused.
        let mut bad = preset_config("qwen3_5_moe", "tiny").unwrap();
        bad.as_object_mut().unwrap().remove("num_experts");
        bad["intermediate_size"] = 0.into();
        assert!(create_random_checkpoint(&bad, &tmp.path().join("bad"), DType::F32, 0).is_err());
    }

    #[test]
    fn mtp_weights_in_checkpoint_and_sidecars() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("m");
        create_random_preset("qwen3_5", "tiny", &dir, DType::F32, 1).unwrap();
        let fc = Array::zeros(&[64, 128], DType::F32).unwrap();
        let norm = Array::zeros(&[64], DType::F32).unwrap();
        // Nested dense sidecar (bare keys are read as mtp.*).
        std::fs::create_dir_all(dir.join("mtp")).unwrap();
        mlx_array::io::save_safetensors(dir.join("mtp/weights.safetensors"), &[("fc.weight", &fc)], None).unwrap();
        let m = load_concrete(&dir, "qwen3_5");
        assert!(m.has_mtp_weights());
        assert_eq!(m.mtp_weights()["mtp.fc.weight"].shape(), vec![64, 128]);
        // In-checkpoint mtp.* tensors (here in a second model*.safetensors shard).
        std::fs::remove_dir_all(dir.join("mtp")).unwrap();
        mlx_array::io::save_safetensors(dir.join("model-mtp.safetensors"), &[("mtp.norm.weight", &norm)], None).unwrap();
        let m = load_concrete(&dir, "qwen3_5");
        assert!(m.has_mtp_weights() && m.mtp_weights().contains_key("mtp.norm.weight"));
        // Reachable through the loaded `Model` handle too (for the speculative crate).
        assert!(load_model(&dir, &test_load_options()).unwrap().into_lm().unwrap().has_mtp_weights());
        assert!(!load_model(fixture("qwen3"), &test_load_options()).unwrap().into_lm().unwrap().has_mtp_weights());
        // The forward pass does not depend on them.
        let mut c = m.new_cache_for_test();
        let out = m.forward(&Array::from_slice(&[1u32, 2, 3], &[1, 3]).unwrap(), &mut c, Logits::Last, false).unwrap();
        assert_eq!(out.logits.unwrap().shape(), vec![1, 1, 512]);
    }

    trait NewCache {
        fn new_cache_for_test(&self) -> mlx_models::Cache;
    }
    impl NewCache for Qwen35Model {
        fn new_cache_for_test(&self) -> mlx_models::Cache {
            mlx_models::Cache::new(&self.cache_spec())
        }
    }
}

/// The last layer is gated full attention in both fixtures: a last-position prefill queries only
/// that position there (query and gate of one row) and matches all positions' last row.
#[test]
fn last_position_prefill_equals_all_positions() {
    check_last_position_prefill("qwen3_5");
    check_last_position_prefill("qwen3_5_moe");
}
