//! The chunked head's memory: on a model with a 32768-token vocabulary and 1020 loss positions
//! (f32 logits of the whole batch: 134 MB), MLX's peak memory during one gradient computation
//! with the chunked head (128 rows a chunk) stays below the size of those logits and below half
//! the peak of autodiff through the model's full logits.
mod common;

use common::*;
use mlx_models::ParameterTree;
use mlx_training::{Example, SftConfig, SftTrainer};

#[test]
fn chunked_head_peak_memory_is_below_full_logits() {
    let vocab = 32768usize;
    let dir = random_variant("qwen3", &[("vocab_size", vocab.into()), ("num_hidden_layers", 1.into())]);
    let tree = ParameterTree::load(dir.path(), &f32_options()).unwrap();
    let examples: Vec<Example> = (0..4u32).map(|r| Example::prompt_completion(&[1 + r], &(0..255u32).map(|i| (i * 131 + r * 7) % vocab as u32).collect::<Vec<_>>())).collect();
    let batch: Vec<&Example> = examples.iter().collect();
    let logits_bytes = 4 * 255 * vocab * 4;
    let peak_of = |chunked: bool| {
        let t = SftTrainer::new(tree.clone(), &f32_options(), examples.clone(), SftConfig { head_chunk: 128, chunked_head: chunked, ..Default::default() }).unwrap();
        assert_eq!(t.uses_chunked_head(), chunked);
        let ((loss, grads), peak) = peak_during(|| t.loss_and_gradients(&batch).unwrap());
        drop(grads);
        (loss, peak)
    };
    let (l_full, full) = peak_of(false);
    let (l_lean, lean) = peak_of(true);
    eprintln!("peak above baseline: full logits {:.1} MB, chunked head {:.1} MB (batch logits {:.1} MB)", full as f64 / 1e6, lean as f64 / 1e6, logits_bytes as f64 / 1e6);
    assert!(((l_full - l_lean) / l_full).abs() < 1e-5, "same loss: {l_full} vs {l_lean}");
    assert!(full > logits_bytes, "the full-logits path holds the batch's logits ({full} bytes)");
    assert!(lean < logits_bytes && lean * 2 < full, "chunked peak {lean} bytes vs full {full}");
}
