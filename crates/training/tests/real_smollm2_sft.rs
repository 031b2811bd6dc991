//! SFT on the real SmolLM2-135M-Instruct (~/.cache/mlx-models/SmolLM2-135M-Instruct, which the
//! chat example fetches and converts) lowers the held-out loss, with LoRA and with a full
//! fine-tune. Ignored by default (a 135M-parameter model, minutes on a CPU):
//! `cargo test --release -p mlx-training --test real_smollm2_sft -- --ignored --nocapture`.
//!
//! Task: chat-formatted `{"messages"}` examples "Spell backwards: <word>" -> the reversed word,
//! loss on the assistant turn; 64 training words, 16 held-out words (none shared), seed,
//! steps and learning rates fixed below.
use mlx_array::DType;
use mlx_models::{KvCacheMode, LoadOptions, ParameterTree};
use mlx_training::lora::{self, LoraConfig};
use mlx_training::{data::parse_line, Example, Schedule, SftConfig, SftTrainer, TextEncoder};
use std::path::PathBuf;

fn words(n: usize, seed: u64) -> Vec<String> {
    let letters = b"abcdefghilmnoprstu";
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let len = 4 + (s >> 60) as usize % 4;
            (0..len)
                .map(|k| {
                    let x = s.rotate_left(7 * k as u32 + 3);
                    letters[(x % letters.len() as u64) as usize] as char
                })
                .collect()
        })
        .collect()
}

fn examples(ws: &[String], enc: &TextEncoder) -> Vec<Example> {
    ws.iter()
        .map(|w| {
            let rev: String = w.chars().rev().collect();
            let line = serde_json::json!({"messages": [{"role": "user", "content": format!("Spell backwards: {w}")}, {"role": "assistant", "content": rev}]}).to_string();
            parse_line(&line, enc, None).unwrap()
        })
        .collect()
}

fn held_out_loss(t: &SftTrainer, held: &[Example]) -> f32 {
    let refs: Vec<&Example> = held.iter().collect();
    t.loss_and_gradients(&refs).unwrap().0
}

#[test]
#[ignore = "needs ~/.cache/mlx-models/SmolLM2-135M-Instruct; minutes on a CPU"]
fn sft_lowers_held_out_loss_on_smollm2() {
    let dir = PathBuf::from(std::env::var_os("HOME").unwrap()).join(".cache/mlx-models/SmolLM2-135M-Instruct");
    let enc = TextEncoder::from_dir(&dir);
    let all = words(80, 21);
    let (train, held) = (examples(&all[..64], &enc), examples(&all[64..], &enc));
    assert!(all[64..].iter().all(|w| !all[..64].contains(w)), "held-out words are unseen");
    let opts = LoadOptions { dtype: Some(DType::F32), kv_cache: KvCacheMode::Flat, ..Default::default() };
    for (name, use_lora, lr) in [("LoRA rank 8 (mlx-lm defaults)", true, 2e-4), ("full fine-tune", false, 2e-5)] {
        let mut tree = ParameterTree::load(&dir, &opts).unwrap();
        let lora_cfg = use_lora.then(|| LoraConfig { seed: 1, ..Default::default() });
        if let Some(c) = &lora_cfg {
            lora::apply_lora(&mut tree, c).unwrap();
        }
        let cfg = SftConfig { batch_size: 8, max_steps: Some(40), seed: 1, schedule: Schedule { lr, ..Default::default() }, lora: lora_cfg, ..Default::default() };
        let mut t = SftTrainer::new(tree, &opts, train.clone(), cfg).unwrap();
        let before = held_out_loss(&t, &held);
        let started = std::time::Instant::now();
        let mut tokens = 0;
        while let Some(m) = t.step().unwrap() {
            tokens += m.tokens;
            if m.step % 10 == 0 {
                eprintln!("  {name}: step {} train loss {:.4}", m.step, m.loss);
            }
        }
        let secs = started.elapsed().as_secs_f64();
        let after = held_out_loss(&t, &held);
        eprintln!("{name}: held-out loss {before:.4} -> {after:.4} after 40 steps of 8 ({:.0} tokens/s, {secs:.1} s)", tokens as f64 / secs);
        assert!(after < 0.8 * before, "{name}: held-out loss {before} -> {after}");
    }
}
