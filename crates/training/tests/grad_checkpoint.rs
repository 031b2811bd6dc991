//! Gradient checkpointing per decoder layer (`SftConfig::gradient_checkpointing`) computes the
//! same loss and gradients as the plain pass: for dense families with tied and untied heads
//! (Qwen3, Llama, Qwen2, Gemma 3 with sliding-window layers), through each of the three heads
//! (full logits, the chunked head over several chunks, the one-piece head), for a full
//! fine-tune and for LoRA adapters; loss within 1e-6 relative and each gradient within 1e-5
//! (||a - b|| / ||b||, floored at 1e-3 of the global norm). Families whose layers do not
//! support it say so instead of training without it.
mod common;

use common::*;
use mlx_models::ParameterTree;
use mlx_training::lora::{apply_lora, LoraConfig};
use mlx_training::{Example, SftConfig, SftTrainer};

fn examples() -> Vec<Example> {
    vec![
        Example::prompt_completion(&[3, 17, 99, 4], &[250, 8, 61, 7, 12]),
        Example::prompt_completion(&[40, 41], &[30, 31, 7, 9]),
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

#[test]
fn checkpointed_gradients_equal_plain_ones() {
    for name in ["qwen3", "qwen3_untied", "llama", "qwen2", "gemma3_text"] {
        let tree = ParameterTree::load(model_fixture(name), &f32_options()).unwrap();
        for (head, cfg) in [
            (
                "full logits",
                SftConfig {
                    chunked_head: false,
                    ..Default::default()
                },
            ),
            (
                "chunked head",
                SftConfig {
                    head_chunk: 4,
                    label_smoothing: 0.1,
                    ..Default::default()
                },
            ),
            ("one-piece head", SftConfig::default()),
        ] {
            compare(&format!("{name}, {head}"), &tree, &cfg);
        }
    }
}

#[test]
fn checkpointed_lora_gradients_equal_plain_ones() {
    let mut tree = qwen3_tree();
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
        "qwen3 LoRA",
        &tree,
        &SftConfig {
            lora: Some(lora),
            ..Default::default()
        },
    );
}

#[test]
fn families_without_support_say_so() {
    let ex = examples();
    let batch: Vec<&Example> = ex.iter().collect();
    let tree = ParameterTree::load(model_fixture("lfm2"), &f32_options()).unwrap();
    let t = SftTrainer::new(
        tree,
        &f32_options(),
        ex.clone(),
        SftConfig {
            gradient_checkpointing: true,
            ..Default::default()
        },
    )
    .unwrap();
    let err = t.loss_and_gradients(&batch).unwrap_err().to_string();
    assert!(err.contains("gradient checkpointing"), "{err}");
}
