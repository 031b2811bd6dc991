//! Greedy speculative decoding equals plain greedy decoding of the target, token for token, with
//! a draft that always agrees (the target itself: every proposal accepted), one that never does
//! (another random Qwen3 with the same vocabulary), an 8-bit quantization of the target (mostly
//! agrees) and a drafter that is wrong at known places, at several depths, flat and paged caches.
use mlx_models::{generate, load_model, GenerateConfig, KvCacheMode, LoadOptions, Model, PagedConfig};
use mlx_speculative::{generate_greedy, DraftModel};
use std::path::PathBuf;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/tests/fixtures/tiny").join(name)
}

fn load(name: &str, kv: KvCacheMode) -> Model {
    load_model(fixture(name), &LoadOptions { kv_cache: kv, ..Default::default() }).unwrap().into_lm().unwrap()
}

fn plain(m: &Model, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut cache = m.new_cache();
    let cfg = GenerateConfig { max_new_tokens: n, sampling: sampling::SamplingConfig::greedy(), stop_tokens: Some(vec![]), ..Default::default() };
    generate(m, &mut cache, prompt, cfg).unwrap().map(|t| t.unwrap().id).collect()
}

#[test]
fn speculative_greedy_equals_plain_greedy() {
    let prompt: Vec<u32> = (0..40).map(|i| (i * 37 + 11) % 500 + 3).collect();
    for kv in [KvCacheMode::Flat, KvCacheMode::Paged(PagedConfig { block_size: 4, ..Default::default() })] {
        let target = load("qwen3", kv.clone());
        let want = plain(&target, &prompt, 24);
        for (draft, k) in [("qwen3", 1), ("qwen3", 4), ("qwen3_untied", 2), ("qwen3_untied", 5)] {
            let mut d = DraftModel::new(load(draft, KvCacheMode::Flat)).unwrap();
            let out = generate_greedy(&target, &mut d, &prompt, 24, k, &[]).unwrap();
            assert_eq!(out.tokens, want, "draft {draft}, k {k}, {kv:?}");
            if draft == "qwen3" {
                assert_eq!(out.accepted, out.proposed, "the target as its own draft agrees always");
                assert!(out.rounds <= 24usize.div_ceil(k + 1) + 1, "{} rounds for k {k}", out.rounds);
            }
            eprintln!("draft {draft} k {k} {kv:?}: acceptance {:.2}, {} rounds", out.acceptance(), out.rounds);
        }
    }
}

/// The realistic draft: an 8-bit quantization of the target (mostly agrees, not always), and a
/// drafter that proposes the target's own tokens with every third one wrong, so rounds end
/// part-way and both caches roll back.
#[test]
fn partial_acceptance_rolls_back_exactly() {
    use mlx_speculative::Drafter;
    let prompt: Vec<u32> = (0..40).map(|i| (i * 29 + 5) % 500 + 3).collect();
    let target = load("qwen3_untied", KvCacheMode::Flat);
    let want = plain(&target, &prompt, 32);
    for k in [2, 3, 6] {
        let mut d = DraftModel::new(load("qwen3_untied_q8g32", KvCacheMode::Flat)).unwrap();
        let out = generate_greedy(&target, &mut d, &prompt, 32, k, &[]).unwrap();
        assert_eq!(out.tokens, want, "8-bit draft, k {k}");
        eprintln!("8-bit draft k {k}: acceptance {:.2}, {} rounds", out.acceptance(), out.rounds);
    }

    struct Oracle {
        seq: Vec<u32>,
        pos: usize,
    }
    impl Drafter for Oracle {
        fn prefill(&mut self, _: &[u32]) -> mlx_speculative::Result<()> {
            Ok(())
        }
        fn propose(&mut self, _last: u32, k: usize) -> mlx_speculative::Result<Vec<u32>> {
            Ok((self.pos..self.pos + k).map(|i| if i % 3 == 0 && i > 0 { (self.seq.get(i).copied().unwrap_or(0) + 1) % 512 } else { self.seq.get(i).copied().unwrap_or(0) }).collect())
        }
        fn accept(&mut self, _: &[u32], accepted: usize) -> mlx_speculative::Result<()> {
            self.pos += accepted + 1;
            Ok(())
        }
    }
    for kv in [KvCacheMode::Flat, KvCacheMode::Paged(PagedConfig { block_size: 4, ..Default::default() })] {
        let target = load("qwen3_untied", kv.clone());
        for k in [1, 2, 4] {
            let mut d = Oracle { seq: want.clone(), pos: 0 };
            let out = generate_greedy(&target, &mut d, &prompt, 32, k, &[]).unwrap();
            assert_eq!(out.tokens, want, "oracle with errors, k {k}, {kv:?}");
            assert!(out.accepted > 0 && out.accepted < out.proposed, "k {k}: {} of {}", out.accepted, out.proposed);
        }
    }
}

#[test]
fn stop_tokens_and_bad_input() {
    let target = load("qwen3", KvCacheMode::Flat);
    let prompt: Vec<u32> = (3..30).collect();
    let want = plain(&target, &prompt, 16);
    let stop = want[5];
    let first = want.iter().position(|&t| t == stop).unwrap();
    let mut d = DraftModel::new(load("qwen3_untied", KvCacheMode::Flat)).unwrap();
    let out = generate_greedy(&target, &mut d, &prompt, 16, 3, &[stop]).unwrap();
    assert_eq!(out.tokens, want[..first], "ends before the first stop token");
    let mut d = DraftModel::new(load("qwen3_untied", KvCacheMode::Flat)).unwrap();
    assert!(generate_greedy(&target, &mut d, &[], 4, 2, &[]).is_err());
    assert!(generate_greedy(&target, &mut d, &[1, 2], 4, 0, &[]).is_err());
    assert!(generate_greedy(&target, &mut d, &[100_000], 4, 2, &[]).is_err());
    // hybrid models' recurrent state cannot roll back: refused before any work
    let hybrid = load_model(fixture("lfm2"), &LoadOptions::default()).unwrap().into_lm().unwrap();
    assert!(DraftModel::new(hybrid.clone()).is_err());
    let mut d = DraftModel::new(load("qwen3", KvCacheMode::Flat)).unwrap();
    assert!(generate_greedy(&hybrid, &mut d, &[1, 2, 3], 4, 2, &[]).is_err());
}
