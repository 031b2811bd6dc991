//! Gradient checkpointing per decoder layer (`SftConfig::gradient_checkpointing`,
//! `GrpoConfig::gradient_checkpointing`) computes the same loss and gradients as the plain
//! pass: for dense families with tied and untied heads (Qwen3, Llama, Qwen2, Gemma 3 with
//! sliding-window layers) through each of the three heads (full logits, the chunked head over
//! several chunks, the one-piece head); for the hybrid and Gemma 4 families (LFM2 and LFM2-MoE
//! short-conv and attention layers, Qwen3.5 dense and MoE GatedDeltaNet and attention layers,
//! Gemma 4 with per-layer inputs, KV-shared layers and a double-wide MLP, and Gemma 4 MoE with
//! K = V full layers) through the full logits and the one-piece head; for LoRA adapters
//! (Qwen3, Qwen3.5); and for a GRPO step (Qwen3.5 through both heads, Gemma 4). Loss within
//! 1e-6 relative and each gradient within 1e-5 (||a - b|| / ||b||, floored at 1e-3 of the
//! global norm). The batch holds a 70-token sequence, so GatedDeltaNet's chunked rule runs
//! over two chunks and Gemma's sliding layers (window 16) mask. What cannot be checkpointed (a
//! pass that does not start at position 0, or computes only some positions) is refused.
mod common;

use common::*;
use mlx_models::{Logits, ParameterTree};
use mlx_training::lora::{apply_lora, LoraConfig};
use mlx_training::{Example, GrpoBatch, GrpoConfig, GrpoTrainer, SftConfig, SftTrainer};

/// Token ids below 512 (every fixture's vocabulary).
fn ids(n: u32, seed: u32) -> Vec<u32> {
    (0..n).map(|i| (i * 37 + seed * 11 + 5) % 500).collect()
}

fn examples() -> Vec<Example> {
    vec![
        Example::prompt_completion(&[3, 17, 99, 4], &[250, 8, 61, 7, 12]),
        Example::prompt_completion(&[40, 41], &[30, 31, 7, 9]),
        Example::prompt_completion(&ids(6, 1), &ids(64, 2)),
    ]
}

/// Loss and gradients of one batch with and without checkpointing, compared.
fn compare(label: &str, tree: &ParameterTree, base: &SftConfig) {
    let ex = examples();
    let batch: Vec<&Example> = ex.iter().collect();
    let run = |gc: bool| {
        let t = SftTrainer::new(
            tree.clone(),
            &f32_options(),
            ex.clone(),
            SftConfig {
                gradient_checkpointing: gc,
                ..base.clone()
            },
        )
        .unwrap();
        t.loss_and_gradients(&batch).unwrap()
    };
    let ((l0, g0), (l1, g1)) = (run(false), run(true));
    assert!(
        ((l1 - l0) / l0).abs() < 1e-6,
        "{label}: loss {l1} checkpointed vs {l0}"
    );
    assert_grads_close(label, &tree.trainable_names(), &g1, &g0, 1e-5);
}

/// `name`'s fixture through the model's full logits, the chunked head over several chunks (with
/// label smoothing) when `chunked`, and the one-piece head.
fn compare_family(name: &str, chunked: bool) {
    let tree = ParameterTree::load(model_fixture(name), &f32_options()).unwrap();
    let mut heads = vec![(
        "full logits",
        SftConfig {
            chunked_head: false,
            ..Default::default()
        },
    )];
    if chunked {
        heads.push((
            "chunked head",
            SftConfig {
                head_chunk: 4,
                label_smoothing: 0.1,
                ..Default::default()
            },
        ));
    }
    heads.push(("one-piece head", SftConfig::default()));
    for (head, cfg) in heads {
        compare(&format!("{name}, {head}"), &tree, &cfg);
    }
}

#[test]
fn checkpointed_gradients_equal_plain_ones() {
    for name in ["qwen3", "qwen3_untied", "llama", "qwen2", "gemma3_text"] {
        compare_family(name, true);
    }
}

#[test]
fn lfm2_checkpointed_gradients_equal_plain_ones() {
    compare_family("lfm2", false);
    compare_family("lfm2_moe", false);
}

#[test]
fn qwen3_5_checkpointed_gradients_equal_plain_ones() {
    compare_family("qwen3_5", false);
    compare_family("qwen3_5_moe", false);
}

#[test]
fn gemma4_checkpointed_gradients_equal_plain_ones() {
    compare_family("gemma4_text", false);
    compare_family("gemma4_text_moe", false);
}

/// LoRA adapters on every linear projection of `name`, with nonzero B, compared.
fn compare_lora(name: &str) {
    let mut tree = ParameterTree::load(model_fixture(name), &f32_options()).unwrap();
    let lora = LoraConfig {
        rank: 4,
        ..Default::default()
    };
    apply_lora(&mut tree, &lora).unwrap();
    // lora_b starts at zero, which leaves lora_a without gradient: give B values
    let names: Vec<String> = tree
        .trainable_names()
        .iter()
        .map(|s| s.to_string())
        .collect();
    for n in names.iter().filter(|n| n.ends_with("lora_b")) {
        let shape = tree.get(n).unwrap().array.shape();
        let b = mlx_array::random::normal_with(
            &shape,
            0.0,
            0.05,
            mlx_array::DType::F32,
            &mlx_array::random::Key::new(7).unwrap(),
        )
        .unwrap();
        tree.set(n, b).unwrap();
    }
    compare(
        &format!("{name} LoRA"),
        &tree,
        &SftConfig {
            lora: Some(lora),
            ..Default::default()
        },
    );
}

#[test]
fn checkpointed_lora_gradients_equal_plain_ones() {
    compare_lora("qwen3");
    // adapters inside GatedDeltaNet's projections
    compare_lora("qwen3_5");
}

/// One GRPO step's loss and gradients with and without checkpointing, compared.
fn compare_grpo(name: &str, chunked_head: bool) {
    let tree = ParameterTree::load(model_fixture(name), &f32_options()).unwrap();
    let completions: Vec<(Vec<u32>, Vec<u32>)> = (0..4)
        .map(|k| (ids(5, 7), ids([3, 9, 40, 66][k as usize], k)))
        .collect();
    let batch = GrpoBatch::single_reward(completions, &[0.5, -1.0, 2.0, 0.25]).unwrap();
    let run = |gc: bool| {
        let cfg = GrpoConfig {
            chunked_head,
            max_completion_length: 128,
            gradient_checkpointing: gc,
            ..Default::default()
        };
        let t = GrpoTrainer::new(tree.clone(), None, &f32_options(), cfg).unwrap();
        t.loss_and_gradients(&batch).unwrap()
    };
    let ((l0, g0), (l1, g1)) = (run(false), run(true));
    let label = format!("GRPO {name}, chunked head {chunked_head}");
    assert!(
        l0.loss != 0.0 && ((l1.loss - l0.loss) / l0.loss).abs() < 1e-6,
        "{label}: loss {} checkpointed vs {}",
        l1.loss,
        l0.loss
    );
    assert_grads_close(&label, &tree.trainable_names(), &g1, &g0, 1e-5);
}

#[test]
fn checkpointed_grpo_step_equals_plain_one() {
    compare_grpo("qwen3_5", true);
    compare_grpo("qwen3_5", false);
    compare_grpo("gemma4_text", true);
}

/// A checkpointed layer keeps no cache state, so a pass that would continue a cache (K/V, or
/// only recurrent state: a Qwen3.5 variant without attention layers), or that computes only the
/// last position, is refused with the reason.
#[test]
fn what_cannot_be_checkpointed_is_refused() {
    let lin = "linear_attention";
    let recurrent_only = random_variant(
        "qwen3_5",
        &[("layer_types", serde_json::json!([lin, lin, lin, lin]))],
    );
    let dirs = ["lfm2", "qwen3_5", "gemma4_text"].map(model_fixture);
    for dir in dirs
        .iter()
        .map(|d| d.as_path())
        .chain([recurrent_only.path()])
    {
        let name = dir.display();
        let model = ParameterTree::load(dir, &f32_options())
            .unwrap()
            .build(&f32_options())
            .unwrap()
            .into_lm()
            .unwrap();
        let tokens = mlx_array::Array::from_slice(&[3u32, 17, 99, 4], &[1, 4]).unwrap();
        // (tokens already in the cache, logits asked for, the refusal's reason)
        for (prefilled, logits, why) in [
            (false, Logits::Last, "a pass computes every position"),
            (true, Logits::All, "a pass starts at position 0"),
        ] {
            let mut cache = model.new_cache();
            if prefilled {
                model
                    .forward(&tokens, &mut cache, Logits::Last, false)
                    .unwrap();
            }
            cache.set_gradient_checkpointing(true);
            let err = model
                .forward(&tokens, &mut cache, logits, false)
                .err()
                .unwrap()
                .to_string();
            assert!(
                err.contains(&format!("gradient checkpointing: {why}")),
                "{name}: {err}"
            );
        }
    }
}
