//! The paged KV cache (kv-paged block pool) against the flat cache: byte-identical greedy tokens,
//! matching logits, prefix sharing across sequences, sessions and rollback.
mod common;
use common::*;
use mlx_models::chat::ChatMessage;
use mlx_models::{generate, load_model, ChatConfig, ChatSession, GenerateConfig, KvCacheMode, LoadOptions, Model, PagedConfig};
use sampling::{SamplingConfig, SamplingOverrides};

fn model(paged: Option<usize>) -> Model {
    model_with(paged, true)
}

/// `contiguous`: [`PagedConfig::contiguous_reads`] (attention reads a per-sequence mirror of the
/// pool) or not (it gathers the sequence's blocks out of the pool).
fn model_with(paged: Option<usize>, contiguous: bool) -> Model {
    let kv_cache = match paged {
        Some(bs) => KvCacheMode::Paged(PagedConfig { block_size: bs, memory_mb: Some(8.0), contiguous_reads: contiguous, ..Default::default() }),
        None => KvCacheMode::Flat,
    };
    load_model(fixture("qwen3"), &LoadOptions { kv_cache, ..Default::default() }).unwrap().into_lm().unwrap()
}

fn greedy_tokens(m: &Model, prompt: &[u32], n: usize, step: usize) -> Vec<u32> {
    greedy_tokens_in(m, &mut m.new_cache(), prompt, &[], n, step)
}

/// `n` greedy tokens after `prompt` on `cache` (`context`: the tokens already in it), prefilled
/// in chunks of `step`. The generator feeds every token it yields: after it the cache holds
/// `prompt` and the `n` tokens.
fn greedy_tokens_in(m: &Model, cache: &mut mlx_models::Cache, prompt: &[u32], context: &[u32], n: usize, step: usize) -> Vec<u32> {
    let cfg = GenerateConfig { max_new_tokens: n, sampling: SamplingConfig::greedy(), stop_tokens: Some(vec![]), prefill_step_size: step, context: context.to_vec() };
    generate(m, cache, prompt, cfg).unwrap().map(|t| t.unwrap().id).collect()
}

/// How many leading positions of `prompt` a new sequence finds in the pool (and does not compute).
fn cached_prefix(m: &Model, prompt: &[u32]) -> usize {
    let mut cache = m.new_cache();
    let t = mlx_array::Array::from_slice(prompt, &[1, prompt.len()]).unwrap();
    m.forward(&t, &mut cache, mlx_models::Logits::Last, false).unwrap();
    cache.last_skipped()
}

/// Greedy tokens of `m` after `prompt`, with `prompt[..split]` prefilled first in chunks of
/// `step` (as a cold run computes them) and the rest of the prompt as the generator's prefill.
fn flat_tokens_after(m: &Model, prompt: &[u32], split: usize, n: usize, step: usize) -> Vec<u32> {
    let mut cache = m.new_cache();
    for c in prompt[..split].chunks(step) {
        let t = mlx_array::Array::from_slice(c, &[1, c.len()]).unwrap();
        m.forward(&t, &mut cache, mlx_models::Logits::None, false).unwrap();
    }
    greedy_tokens_in(m, &mut cache, &prompt[split..], &prompt[..split], n, step)
}

#[test]
fn paged_equals_flat() {
    let r = reference("qwen3");
    let prompt = ids(&r["input_ids"]);
    let flat = model(None);
    let want = greedy_tokens(&flat, &prompt, 16, 2048);
    assert_eq!(want, ids(&r["greedy_ids"])[72..]);
    let a = full_logits(&flat, &prompt);
    for (bs, contiguous) in [(1, true), (5, true), (16, true), (1, false), (5, false), (16, false)] {
        let p = model_with(Some(bs), contiguous);
        assert!(p.new_cache().is_paged());
        // On a fresh pool nothing is cached: all 72 positions are computed.
        let b = full_logits(&p, &prompt);
        let e = rel_err(&b.concat(), &a.concat());
        assert!(e < 1e-6, "block size {bs}, contiguous reads {contiguous}: paged vs flat logits rel err {e}");
        // Chunked prefill of 20 (not a multiple of any block size) plus decode. The all-logits
        // call above used a private sequence, so the first run is cold.
        assert_eq!(greedy_tokens(&p, &prompt, 16, 20), want, "block size {bs}, contiguous reads {contiguous}, cold pool");
        // The second run finds the first run's full blocks in the pool (a prefix hit) and
        // computes only the positions after them, in one chunk. Its reference is a flat run
        // computed the same way: the cached positions in the cold run's chunks of 20, the rest
        // in one chunk. Other chunkings round differently in bf16: on the H200 (bf16 fixture)
        // a flat cache that computes the last prompt token alone gives the prefix hit's tokens
        // at block size 1, and both differ from the one-chunk prefill's from the 4th token on.
        let skipped = cached_prefix(&p, &prompt);
        assert_eq!(skipped, (prompt.len() - 1) / bs * bs, "block size {bs}: the full blocks before the last token are reused");
        let hit = greedy_tokens(&p, &prompt, 16, 20);
        let same_schedule = flat_tokens_after(&flat, &prompt, skipped, 16, 20);
        assert_eq!(hit, same_schedule, "block size {bs}, contiguous reads {contiguous}, prefix hit ({skipped} reused)");
        assert!(p.paged_stats().unwrap().prefix_hit_rate > 0.0);
    }
}

#[test]
fn qwen3_defaults_to_paged_and_config_opts_out() {
    let m = load_model(fixture("qwen3"), &LoadOptions::default()).unwrap().into_lm().unwrap();
    assert!(m.new_cache().is_paged(), "paged is the Qwen3 default, as in mlx-node");
    let t = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(fixture("qwen3")).unwrap() {
        let p = e.unwrap().path();
        if p.is_file() {
            std::fs::copy(&p, t.path().join(p.file_name().unwrap())).unwrap();
        }
    }
    let cfg = std::fs::read_to_string(t.path().join("config.json")).unwrap();
    std::fs::write(t.path().join("config.json"), cfg.replacen('{', "{\n  \"use_block_paged_cache\": false,", 1)).unwrap();
    let m = load_model(t.path(), &LoadOptions::default()).unwrap().into_lm().unwrap();
    assert!(!m.new_cache().is_paged());
}

#[test]
fn all_logits_never_skip_cached_prefixes() {
    let p = model(Some(4));
    let prompt: Vec<u32> = (1..30).collect();
    let _ = greedy_tokens(&p, &prompt, 2, 2048);
    let a = full_logits(&p, &prompt);
    assert_eq!(a.len(), prompt.len(), "one row per position even though the prefix is cached");
}

#[test]
fn prefix_blocks_are_shared_between_sequences() {
    let r = reference("qwen3");
    let prompt = ids(&r["input_ids"]);
    let p = model(Some(16));
    let first = greedy_tokens(&p, &prompt, 8, 2048);
    // The first sequence finished (its cache dropped): its full blocks stay cached.
    let mut cache = p.new_cache();
    let t = mlx_array::Array::from_slice(&prompt, &[1, prompt.len()]).unwrap();
    let out = p.forward(&t, &mut cache, mlx_models::Logits::Last, false).unwrap();
    assert_eq!(cache.last_skipped(), 64, "4 full blocks of 16 reused");
    let next = argmax(&out.logits.unwrap().to_vec::<f32>().unwrap());
    assert_eq!(next, first[0]);
    let stats = p.paged_stats().unwrap();
    assert!(stats.prefix_hit_rate > 0.0, "{stats:?}");
    drop(cache);
    assert_eq!(greedy_tokens(&p, &prompt, 8, 2048), first);
}

#[test]
fn sessions_on_paged_equal_flat() {
    let greedy = ChatConfig { max_new_tokens: 8, sampling: SamplingOverrides { temperature: Some(0.0), ..Default::default() }, ..Default::default() };
    let run = |m: Model| {
        let mut s = ChatSession::new(m).unwrap();
        let a = s.start(vec![ChatMessage::user("Hello there")], &greedy).unwrap();
        let b = s.continue_with("And then?", &greedy).unwrap();
        // Restart from the first message only: the session rewinds (trims) its cache.
        let c = s.start(vec![ChatMessage::user("Hello there")], &greedy).unwrap();
        (a.raw_text, b.raw_text, b.cached_tokens, c.raw_text, c.cached_tokens, s.cached_ids().to_vec())
    };
    let f = run(model(None));
    for contiguous in [true, false] {
        assert_eq!(run(model_with(Some(4), contiguous)), f, "contiguous reads {contiguous}");
    }
    assert!(f.2 > 0 && f.4 > 0);
}

/// Hybrid families (recurrent + attention layers): paged attention layers, opt-in, give the
/// same tokens and logits as flat caches, and never skip a prefix (the recurrent state must see
/// every token).
#[test]
fn hybrid_families_paged_equal_flat() {
    for name in ["qwen3_5", "qwen3_5_moe", "lfm2", "lfm2_moe"] {
        let load = |kv_cache| load_model(fixture(name), &LoadOptions { kv_cache, ..Default::default() }).unwrap().into_lm().unwrap();
        let flat = load(KvCacheMode::Flat);
        assert!(!flat.new_cache().is_paged(), "{name}: flat by default");
        let paged = load(KvCacheMode::Paged(PagedConfig { block_size: 4, memory_mb: Some(4.0), ..Default::default() }));
        assert!(paged.new_cache().is_paged());
        let r = reference(name);
        let prompt = ids(&r["input_ids"]);
        let want = greedy_tokens(&flat, &prompt, 8, 20);
        assert_eq!(want, ids(&r["greedy_ids"])[72..80], "{name}: flat greedy vs transformers");
        assert_eq!(greedy_tokens(&paged, &prompt, 8, 20), want, "{name}: paged, cold");
        assert_eq!(greedy_tokens(&paged, &prompt, 8, 20), want, "{name}: paged again (no prefix skip)");
        let e = rel_err(&full_logits(&paged, &prompt).concat(), &full_logits(&flat, &prompt).concat());
        assert!(e < 1e-5, "{name}: paged vs flat logits rel err {e}");
    }
}

/// Decode inputs enter the pool as pending ids (the pipelined loop feeds step n + 1 the lazy
/// token n) and are read back later: once the sequence ends, every full block it computed,
/// generated tokens included, is findable by a new sequence with the right ids.
#[test]
fn generated_tokens_join_the_prefix_cache() {
    let r = reference("qwen3");
    let prompt = ids(&r["input_ids"]);
    assert_eq!(prompt.len(), 72);
    let p = model(Some(4));
    // 21 new tokens: the first sequence computes at least 72 + 20 = 92 positions (23 blocks).
    let gen = greedy_tokens(&p, &prompt, 21, 2048);
    let mut again = prompt.clone();
    again.extend(&gen);
    let t = mlx_array::Array::from_slice(&again, &[1, again.len()]).unwrap();
    let hit = p.forward(&t, &mut p.new_cache(), mlx_models::Logits::Last, false).unwrap();
    // The reused blocks hold the right K/V (decode steps write the pool a block at a time):
    // the logits equal a flat cache's that computed the same positions the same way (one
    // prefill chunk, 20 decode steps; the generator feeds each token it yields), then the
    // last token alone.
    let flat = model(None);
    let mut fc = flat.new_cache();
    assert_eq!(greedy_tokens_in(&flat, &mut fc, &prompt, &[], 20, 2048), gen[..20]);
    let want = flat.forward(&t.slice_axis(1, 92, 93).unwrap(), &mut fc, mlx_models::Logits::Last, false).unwrap();
    let (a, b) = (hit.logits.unwrap().to_vec::<f32>().unwrap(), want.logits.unwrap().to_vec::<f32>().unwrap());
    let e = rel_err(&a, &b);
    assert!(e < 1e-6, "logits after the prefix hit vs flat: rel err {e}");
}

/// The blocks a paged sequence leaves hold the K/V a flat cache computes on the same steps.
/// `run(model, end)` drives a new sequence of `model` to `end` positions and returns its cache,
/// the tokens it generated and its whole token history. The paged run goes to 98 positions and
/// ends (its six full blocks, 0..96, join the prefix cache); a new sequence reuses them and
/// computes positions 96 and 97 in one chunk, as the flat cache, run to 96, then does.
fn check_reused_blocks(what: &str, run: impl Fn(&Model, usize) -> (mlx_models::Cache, Vec<u32>, Vec<u32>)) {
    let p = model(Some(16));
    let (pc, got_toks, hist) = run(&p, 98);
    assert_eq!(hist.len(), 98);
    drop(pc);
    let flat = model(None);
    let (mut fc, want_toks, _) = run(&flat, 96);
    assert_eq!(got_toks[..want_toks.len()], want_toks[..], "paged vs flat tokens {what}");
    assert_eq!(cached_prefix(&p, &hist), 96);
    let t = mlx_array::Array::from_slice(&hist, &[1, hist.len()]).unwrap();
    let got = p.forward(&t, &mut p.new_cache(), mlx_models::Logits::Last, false).unwrap();
    let want = flat.forward(&t.slice_axis(1, 96, 98).unwrap(), &mut fc, mlx_models::Logits::Last, false).unwrap();
    let e = rel_err(&got.logits.unwrap().to_vec::<f32>().unwrap(), &want.logits.unwrap().to_vec::<f32>().unwrap());
    assert!(e < 1e-6, "{what}: logits on the reused blocks vs flat: rel err {e}");
}

/// A rollback inside a block whose decode rows are not in the pool yet: the rows that stay go in
/// before the trim, so the block, once full and cached, holds the right K/V for every position
/// (the kept, the rolled-back-and-recomputed and the later ones).
#[test]
fn rollback_inside_a_block_keeps_its_rows() {
    let prompt = ids(&reference("qwen3")["input_ids"]);
    check_reused_blocks("around the rollback", |m, end| {
        let mut c = m.new_cache();
        // 72 + 14 positions: the block 80..96 holds 6 decode rows (80..86) not in the pool yet
        let mut toks = greedy_tokens_in(m, &mut c, &prompt, &[], 14, 2048);
        c.trim(2).unwrap(); // keep 80..84
        let mut hist = prompt.clone();
        hist.extend(&toks[..12]);
        let b = greedy_tokens_in(m, &mut c, &[7], &hist, end - 85, 2048); // 7 at 84, then 85..end
        hist.push(7);
        hist.extend(&b);
        toks.extend(b);
        (c, toks, hist)
    });
}

/// A several-token step (a chat turn appended) after decode steps whose rows are not in the pool
/// yet: those rows go in first, so the block they share with the new tokens, once full and
/// cached, holds the right K/V.
#[test]
fn chunk_after_decode_rows_keeps_them() {
    let prompt = ids(&reference("qwen3")["input_ids"]);
    let turn = [7u32, 8, 9, 10, 11];
    check_reused_blocks("around the chunk", |m, end| {
        let mut c = m.new_cache();
        // 72 + 14 positions: the block 80..96 holds 6 decode rows (80..86) not in the pool yet
        let mut toks = greedy_tokens_in(m, &mut c, &prompt, &[], 14, 2048);
        let mut hist = prompt.clone();
        hist.extend(&toks);
        let b = greedy_tokens_in(m, &mut c, &turn, &hist, end - 91, 2048); // 86..91 in one step, then 91..end
        hist.extend(turn);
        hist.extend(&b);
        toks.extend(b);
        (c, toks, hist)
    });
}

/// A model loaded on one thread decodes on others, several at once (MLX binds lazy arrays to
/// the thread that made them: the load computes the weights). Sequences on a paged model share
/// its pool: each thread waits for the writes another queued before it builds on the pool. The
/// tokens equal those of the flat cache on the loading thread.
#[test]
fn sequences_on_threads_share_one_model() {
    let r = reference("qwen3");
    let prompt = ids(&r["input_ids"]);
    let prompts: Vec<Vec<u32>> = (0..3).map(|i| prompt[i * 8..].to_vec()).collect();
    let flat = model(None);
    let want: Vec<Vec<u32>> = prompts.iter().map(|q| greedy_tokens(&flat, q, 12, 16)).collect();
    for (paged, contiguous) in [(None, true), (Some(4), true), (Some(4), false)] {
        let p = model_with(paged, contiguous);
        let got: Vec<Vec<u32>> = std::thread::scope(|s| {
            let hs: Vec<_> = prompts.iter().map(|q| s.spawn(|| greedy_tokens(&p, q, 12, 16))).collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(got, want, "paged {paged:?}, contiguous reads {contiguous}");
    }
}

/// The pool starts at `initial_blocks` and grows with the blocks in use, up to the budget; the
/// tokens do not depend on where it started.
#[test]
fn pool_storage_grows_with_use() {
    let r = reference("qwen3");
    let prompt = ids(&r["input_ids"]);
    let load = |initial_blocks| {
        let cfg = PagedConfig { block_size: 4, memory_mb: Some(8.0), initial_blocks, ..Default::default() };
        load_model(fixture("qwen3"), &LoadOptions { kv_cache: KvCacheMode::Paged(cfg), ..Default::default() }).unwrap().into_lm().unwrap()
    };
    let small = load(Some(2));
    let before = small.paged_storage_bytes().unwrap();
    let full = load(None);
    let whole = full.paged_storage_bytes().unwrap();
    assert!(before * 100 < whole, "starts at 2 blocks: {before} bytes, the whole budget {whole}");
    let want = greedy_tokens(&full, &prompt, 16, 20);
    assert_eq!(greedy_tokens(&small, &prompt, 16, 20), want);
    let after = small.paged_storage_bytes().unwrap();
    // 88 positions in blocks of 4: at least 22 blocks, doubled from 2 (2 -> 4 -> ... -> 32).
    assert!(after > before * 10 && after <= whole, "grew to {after} bytes (from {before}, budget {whole})");
}
