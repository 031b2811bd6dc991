//! Batched generation ([`mlx_models::generate_batch`]) against each sequence run alone, for
//! every LM family: greedy tokens identical wherever the lone run's top-1/top-2 logit gap
//! exceeds 1e-4 (f32), forward passes that carry several rows, rows that leave the batch
//! early, and per-row sampling streams.
mod common;
use common::*;
use mlx_models::{generate_batch, load_model, FinishReason, GenerateConfig};
use sampling::SamplingConfig;

/// `got` equals `want` up to the first step where the lone run was a near tie (then anything
/// may follow); `want` may be cut at a stop token.
fn assert_same(name: &str, seq: usize, got: &[u32], want: &[u32], gaps: &[f32]) {
    for (i, w) in want.iter().enumerate() {
        if gaps[i] <= TIE {
            return;
        }
        assert_eq!(
            got.get(i),
            Some(w),
            "{name}, sequence {seq}: step {i} (lone gap {}): batched {got:?}, alone {want:?}",
            gaps[i]
        );
    }
    assert_eq!(
        got.len(),
        want.len(),
        "{name}, sequence {seq}: batched {got:?}, alone {want:?}"
    );
}

fn prompts(vocab: usize) -> Vec<Vec<u32>> {
    // Three lengths: left padding of 8 and 3 columns, pads across prefill chunks of 4.
    let mk = |n: usize, seed: u32| {
        (0..n as u32)
            .map(|i| (i * 37 + seed * 101 + 7) % vocab as u32)
            .collect::<Vec<u32>>()
    };
    vec![mk(5, 1), mk(13, 2), mk(10, 3)]
}

fn check_family(name: &str) {
    let model = load_model(fixture(name), &test_load_options())
        .unwrap()
        .into_lm()
        .unwrap();
    let ps = prompts(model.info().vocab_size);
    let steps = 10;
    let lone: Vec<(Vec<u32>, Vec<f32>)> = ps.iter().map(|p| greedy_alone(&model, p, steps)).collect();
    let cfg = GenerateConfig {
        max_new_tokens: steps,
        sampling: SamplingConfig::greedy(),
        prefill_step_size: 4,
        stop_tokens: Some(vec![]),
        ..Default::default()
    };
    let group = 2;
    let r = generate_batch(&model, &ps, group, &cfg).unwrap();
    assert_eq!(r.sequences.len(), ps.len() * group);
    for (s, seq) in r.sequences.iter().enumerate() {
        let (want, gaps) = &lone[s / group];
        assert_eq!(seq.prompt_index, s / group);
        assert_same(name, s, &seq.tokens, want, gaps);
        assert_eq!(seq.finish_reason, FinishReason::Length);
        assert_eq!(seq.logprobs.len(), seq.tokens.len());
        assert!(
            seq.logprobs.iter().all(|lp| lp.is_finite() && *lp <= 1e-6),
            "{name}: log-probs {:?}",
            seq.logprobs
        );
    }
    // prompts of 5, 13 and 10 tokens in chunks of 4, each at its own pace: a prompt that ends
    // gives its two sequences a row each, which decode beside the prompts still computed (3, 3,
    // 4, 5 rows), then 6 rows until the first sequences have their 10 tokens
    assert_eq!(
        r.rows_per_forward[..9],
        [3, 3, 4, 5, 6, 6, 6, 6, 6],
        "{name}: {:?}",
        r.rows_per_forward
    );

    // A stop token that ends prompt 0's sequences after 3 tokens: those rows leave the batch,
    // the others go on (their lone runs cut at their own first stop token, if any).
    let stop = lone[0].0[3];
    let cfg = GenerateConfig {
        stop_tokens: Some(vec![stop]),
        prefill_step_size: 0,
        ..cfg
    };
    let r = generate_batch(&model, &ps, group, &cfg).unwrap();
    for (s, seq) in r.sequences.iter().enumerate() {
        let (want, gaps) = &lone[s / group];
        let cut = want.iter().position(|&t| t == stop);
        let want = &want[..cut.unwrap_or(want.len())];
        assert_same(name, s, &seq.tokens, want, gaps);
        if gaps.iter().take(want.len() + 1).all(|&g| g > TIE) {
            let reason = if cut.is_some() {
                FinishReason::Stop
            } else {
                FinishReason::Length
            };
            assert_eq!(seq.finish_reason, reason, "{name}, sequence {s}");
        }
    }
    assert_eq!(r.rows_per_forward[0], 3);
    // decode steps carry the rows still going: never more than 6, fewer once rows stopped
    assert!(r.rows_per_forward[1..].windows(2).all(|w| w[1] <= w[0]) && r.rows_per_forward[1] <= 6, "{name}: {:?}", r.rows_per_forward);
    assert!(
        r.rows_per_forward[1..].iter().any(|&n| n < 6),
        "{name}: rows that stopped must leave the batch: {:?}",
        r.rows_per_forward
    );
}

#[test]
fn batched_greedy_equals_alone_qwen3_llama_qwen2() {
    for name in ["qwen3", "llama", "qwen2", "llama_dynamic", "qwen3_yarn"] {
        check_family(name);
    }
}

#[test]
fn batched_greedy_equals_alone_gemma() {
    for name in ["gemma3_text", "gemma3", "gemma4_text", "gemma4_text_moe"] {
        check_family(name);
    }
}

#[test]
fn batched_greedy_equals_alone_hybrid() {
    for name in ["qwen3_5", "qwen3_5_moe", "qwen3_5_vl", "lfm2", "lfm2_moe"] {
        check_family(name);
    }
}

/// With temperature > 0 every row draws from its own stream, seeded from the config's seed and
/// the row's index: the same seed gives the same sequences, a row's tokens do not depend on the
/// rows beside it, and the two samples of a group differ.
#[test]
fn sampled_rows_have_their_own_streams() {
    let model = load_model(fixture("qwen3"), &test_load_options())
        .unwrap()
        .into_lm()
        .unwrap();
    let ps = prompts(model.info().vocab_size);
    let cfg = GenerateConfig {
        max_new_tokens: 12,
        sampling: SamplingConfig {
            temperature: 1.0,
            seed: Some(7),
            ..SamplingConfig::default()
        },
        stop_tokens: Some(vec![]),
        ..Default::default()
    };
    let a = generate_batch(&model, &ps, 2, &cfg).unwrap();
    let b = generate_batch(&model, &ps, 2, &cfg).unwrap();
    let toks = |r: &mlx_models::BatchGenerationResult| {
        r.sequences
            .iter()
            .map(|s| s.tokens.clone())
            .collect::<Vec<_>>()
    };
    assert_eq!(toks(&a), toks(&b), "same seed, same sequences");
    assert_ne!(
        a.sequences[0].tokens, a.sequences[1].tokens,
        "two samples of one prompt"
    );
    let alone = generate_batch(&model, &ps[..1], 1, &cfg).unwrap();
    assert_eq!(
        alone.sequences[0].tokens, a.sequences[0].tokens,
        "row 0's stream does not depend on the other rows"
    );
    let other = generate_batch(
        &model,
        &ps,
        2,
        &GenerateConfig {
            sampling: SamplingConfig {
                seed: Some(8),
                ..cfg.sampling.clone()
            },
            ..cfg.clone()
        },
    )
    .unwrap();
    assert_ne!(toks(&other), toks(&a), "another seed, other sequences");
}

#[test]
fn bad_inputs_are_errors() {
    let model = load_model(fixture("qwen3"), &test_load_options())
        .unwrap()
        .into_lm()
        .unwrap();
    let cfg = GenerateConfig {
        max_new_tokens: 2,
        sampling: SamplingConfig::greedy(),
        ..Default::default()
    };
    for (ps, group) in [
        (vec![], 1),
        (vec![vec![1u32]], 0),
        (vec![vec![1], vec![]], 1),
        (vec![vec![1, 999_999]], 1),
    ] {
        assert!(
            generate_batch(&model, &ps, group, &cfg).is_err(),
            "{ps:?} x {group}"
        );
    }
    let ctx = GenerateConfig {
        context: vec![1],
        ..cfg.clone()
    };
    assert!(
        generate_batch(&model, &[vec![1]], 1, &ctx).is_err(),
        "context is refused, not ignored"
    );
    let zero = generate_batch(
        &model,
        &[vec![1, 2]],
        2,
        &GenerateConfig {
            max_new_tokens: 0,
            ..cfg
        },
    )
    .unwrap();
    assert!(zero
        .sequences
        .iter()
        .all(|s| s.tokens.is_empty() && s.finish_reason == FinishReason::Length));
}
