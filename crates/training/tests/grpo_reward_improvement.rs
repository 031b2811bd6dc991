//! GRPO raises the reward: the tiny random Qwen3 fixture, trained with the Length reward on
//! completions sampled in batches (temperature 0.8, top-p 0.95, repetition penalty 1.1), has a
//! higher mean reward over steps 41-50 than over steps 1-10, for each of three fixed seeds.
//!
//! Settings (fixed before the first run): 2 prompts x group of 8 a step, at most 16 new tokens,
//! Length reward 64..1000 characters (so a 16-token completion scores below 1), loss `dapo`,
//! beta 0, AdamW at learning rate 1e-3 (constant), global norm clipped to 1.0, 50 steps,
//! sampling seeds `1000 * seed + step`, seeds 0, 1, 2.
//!
//! Ignored in the default run: its 150 sampled steps took 55 s, 63 s and 93 s in three debug-build
//! runs on a shared 2-core machine (load average 12-15), about the 60 s a default test may take. Run with
//! `cargo test -p mlx-training --test grpo_reward_improvement -- --ignored --nocapture`.
mod common;

use common::*;
use mlx_models::chat::Tokenizer;
use mlx_training::rewards::{LengthReward, RewardSet};
use mlx_training::{default_rollout_sampling, GrpoConfig, GrpoPrompt, GrpoTrainer, Schedule};

const SEEDS: [u64; 3] = [0, 1, 2];
const STEPS: u64 = 50;
const LR: f64 = 1e-3;

#[test]
#[ignore]
fn length_reward_rises_for_three_seeds() {
    let dir = model_fixture("qwen3");
    let tok = Tokenizer::from_dir(&dir).unwrap();
    let decode = |ids: &[u32]| tok.decode(ids, true).map_err(|e| e.to_string());
    let prompts: Vec<GrpoPrompt> = [vec![3u32, 17, 99, 4], vec![40, 41, 42, 43]]
        .into_iter()
        .map(|ids| GrpoPrompt {
            text: decode(&ids).unwrap(),
            ids,
        })
        .collect();
    let started = std::time::Instant::now();
    for seed in SEEDS {
        let mut rewards = RewardSet::new();
        rewards
            .add(LengthReward::new(64, 1000, true).unwrap(), 1.0)
            .unwrap();
        let cfg = GrpoConfig {
            group_size: 8,
            max_completion_length: 16,
            schedule: Schedule {
                lr: LR,
                ..Default::default()
            },
            ..Default::default()
        };
        let mut t = GrpoTrainer::new(qwen3_tree(), None, &f32_options(), cfg).unwrap();
        let mut means = Vec::new();
        for step in 1..=STEPS {
            let sampling = default_rollout_sampling().with_seed(1000 * seed + step);
            let s = t
                .sample(&prompts, &rewards, &sampling, None, &decode)
                .unwrap();
            assert_eq!(s.batch.completions.len(), 16);
            let m = t.step(&s.batch).unwrap();
            assert!(!m.skipped && m.loss.is_finite());
            means.push(m.reward_mean);
        }
        let first = means[..10].iter().sum::<f64>() / 10.0;
        let last = means[40..].iter().sum::<f64>() / 10.0;
        eprintln!("seed {seed}: mean reward steps 1-10 {first:.4}, steps 41-50 {last:.4}");
        assert!(
            last > first,
            "seed {seed}: reward did not rise ({first:.4} -> {last:.4}): {means:?}"
        );
    }
    eprintln!(
        "{} runs of {STEPS} steps in {:.1} s",
        SEEDS.len(),
        started.elapsed().as_secs_f64()
    );
}
