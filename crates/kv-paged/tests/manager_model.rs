//! State-machine test of `KvCacheManager` over random begin/step/append/trim/fork/finish
//! sequences. A shadow "KV store" records, per slot, what a model would have written there
//! (the salt and the whole token prefix up to that position); every step checks that the keys
//! it hands out hold exactly the sequence's own prefix, which is what a prefix hit, a fork or a
//! trim must preserve. Refcounts must equal the references held by live block tables.
//! Appends may leave ids pending (`append_pending`, resolved later in random chunks): a block
//! with an unresolved id must never be found by a prefix lookup, as its placeholder ids (0)
//! would match the wrong content.
use std::collections::HashMap;

use kv_paged::{Attention, BlockCopy, Error, ExtraKeys, KvCacheManager, SeqId};
use proptest::prelude::*;

const BS: usize = 4;
type Content = Option<(Option<u128>, Vec<u32>)>;

#[derive(Debug, Clone)]
enum Op {
    Begin { base: usize, extra_len: usize, salt: bool },
    Step { seq: usize, max: usize },
    Append { seq: usize, tokens: Vec<u32> },
    AppendPending { seq: usize, tokens: Vec<u32> },
    Resolve { seq: usize, count: usize },
    Trim { seq: usize, back: usize },
    Fork { seq: usize },
    Finish { seq: usize },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0usize..3, 0usize..10, prop::bool::weighted(0.2)).prop_map(|(base, extra_len, salt)| Op::Begin { base, extra_len, salt }),
        6 => (any::<usize>(), 1usize..12).prop_map(|(seq, max)| Op::Step { seq, max }),
        3 => (any::<usize>(), prop::collection::vec(0u32..3, 1..4)).prop_map(|(seq, tokens)| Op::Append { seq, tokens }),
        2 => (any::<usize>(), prop::collection::vec(0u32..3, 1..4)).prop_map(|(seq, tokens)| Op::AppendPending { seq, tokens }),
        2 => (any::<usize>(), 1usize..5).prop_map(|(seq, count)| Op::Resolve { seq, count }),
        2 => (any::<usize>(), 0usize..6).prop_map(|(seq, back)| Op::Trim { seq, back }),
        1 => any::<usize>().prop_map(|seq| Op::Fork { seq }),
        2 => any::<usize>().prop_map(|seq| Op::Finish { seq }),
    ]
}

struct World {
    m: KvCacheManager,
    groups: Vec<(Attention, usize)>,
    /// Shadow KV store per group, indexed by slot.
    kv: Vec<Vec<Content>>,
    salts: HashMap<SeqId, Option<u128>>,
    /// Each live sequence's real tokens and how many of them the manager knows.
    truth: HashMap<SeqId, (Vec<u32>, usize)>,
    live: Vec<SeqId>,
}

impl World {
    fn apply_copies(&mut self, copies: &[BlockCopy]) {
        for c in copies {
            for o in 0..BS {
                let v = self.kv[c.group][c.src.0 as usize * BS + o].clone();
                self.kv[c.group][c.dst.0 as usize * BS + o] = v;
            }
        }
    }

    fn check(&self) -> Result<(), TestCaseError> {
        for (g, &(_, n)) in self.groups.iter().enumerate() {
            let a = self.m.allocator(g).unwrap();
            let mut held = vec![0u32; n];
            for &s in &self.live {
                for b in self.m.blocks(s, g).unwrap().into_iter().flatten() {
                    held[b.0 as usize] += 1;
                }
            }
            let st = a.stats();
            prop_assert_eq!(st.free + st.in_use, st.total);
            prop_assert_eq!(st.in_use, held.iter().filter(|&&h| h > 0).count());
            for (b, &h) in held.iter().enumerate() {
                let id = kv_paged::BlockId(b as u32);
                prop_assert_eq!(a.refcount(id).unwrap(), h, "group {} block {} refcount vs table references", g, b);
                prop_assert_eq!(a.is_free(id), h == 0, "block {} both free and in use (or neither)", b);
            }
        }
        prop_assert_eq!(self.m.stats().sequences, self.live.len());
        Ok(())
    }

    fn step(&mut self, s: SeqId, max: usize) -> Result<(), TestCaseError> {
        self.m.commit(s).unwrap();
        let before = self.m.stats();
        let step = match self.m.step(s, max) {
            Ok(st) => st,
            Err(Error::OutOfBlocks { needed, free, total, .. }) => {
                prop_assert!(needed > free && total > 0);
                prop_assert_eq!(self.m.stats().groups.iter().map(|g| g.free).collect::<Vec<_>>(),
                    before.groups.iter().map(|g| g.free).collect::<Vec<_>>(), "failed step changed nothing");
                return Ok(());
            }
            Err(Error::Tokens(_)) => {
                prop_assert_eq!(self.m.num_scheduled(s).unwrap(), self.m.tokens(s).unwrap().len());
                return Ok(());
            }
            Err(e) => return Err(TestCaseError::fail(format!("step: {e}"))),
        };
        let tokens = self.truth[&s].0.clone();
        prop_assert_eq!(tokens.len(), self.m.tokens(s).unwrap().len());
        let salt = self.salts[&s];
        let end = step.start + step.len;
        for (g, gs) in step.groups.iter().enumerate() {
            let a = self.m.allocator(g).unwrap();
            let want_start = match self.groups[g].0 {
                Attention::Full => 0,
                Attention::Sliding { window } => (step.start + 1).saturating_sub(window),
            };
            prop_assert_eq!(gs.kv_start, want_start);
            prop_assert_eq!(gs.kv_slots().len(), end - want_start);
            prop_assert_eq!(gs.slot_mapping.len(), step.len);
            prop_assert_eq!(&gs.kv_slots()[step.start - want_start..], &gs.slot_mapping[..]);
            // Keys already there hold exactly this sequence's prefix.
            for (p, &slot) in (want_start..step.start).zip(&gs.kv_slots()) {
                let want = Some((salt, tokens[..=p].to_vec()));
                prop_assert_eq!(&self.kv[g][slot as usize], &want, "group {} position {} slot {}", g, p, slot);
            }
            // The slots written belong to this sequence alone and are not in the prefix cache.
            for &slot in &gs.slot_mapping {
                let b = kv_paged::BlockId(slot / BS as u32);
                prop_assert_eq!(a.refcount(b).unwrap(), 1, "write into a shared block");
                prop_assert!(a.key(b).unwrap().is_none(), "write into a registered block");
            }
            // Block table agrees with the slots.
            for (p, &slot) in (want_start..end).zip(&gs.kv_slots()) {
                prop_assert_eq!(gs.block_table[p / BS - gs.first_block], slot / BS as u32);
                prop_assert_eq!(slot as usize % BS, p % BS);
            }
            for (p, &slot) in (step.start..end).zip(&gs.slot_mapping) {
                self.kv[g][slot as usize] = Some((salt, tokens[..=p].to_vec()));
            }
        }
        Ok(())
    }
}

fn bases() -> [Vec<u32>; 3] {
    [vec![1, 2, 3, 4, 5, 6, 7, 8, 9], vec![1, 2, 3, 4, 0, 0, 0, 0, 0, 0, 1], vec![2; 13]]
}

fn run(groups: Vec<(Attention, usize)>, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let m = KvCacheManager::with_groups(BS, 3, &groups).unwrap();
    let kv = groups.iter().map(|&(_, n)| vec![None; n * BS]).collect();
    let mut w = World { m, groups, kv, salts: HashMap::new(), truth: HashMap::new(), live: vec![] };
    for op in ops {
        let pick = |w: &World, i: usize| (!w.live.is_empty()).then(|| w.live[i % w.live.len()]);
        match op {
            Op::Begin { base, extra_len, salt } => {
                let mut p = bases()[base].clone();
                p.extend((0..extra_len as u32).map(|i| i % 3));
                let salt = salt.then_some(99u128);
                let b = w.m.begin(&p, ExtraKeys { salt, ..Default::default() }).unwrap();
                prop_assert!(b.cached_tokens.is_multiple_of(BS) && b.cached_tokens < p.len());
                w.salts.insert(b.seq, salt);
                w.truth.insert(b.seq, (p.clone(), p.len()));
                w.live.push(b.seq);
                // The cached part is checked by the next step's reads; do one now.
                w.step(b.seq, 1 + extra_len)?;
            }
            Op::Step { seq, max } => {
                if let Some(s) = pick(&w, seq) { w.step(s, max)?; }
            }
            Op::Append { seq, tokens } => {
                if let Some(s) = pick(&w, seq) {
                    let n = w.m.tokens(s).unwrap().len();
                    let (t, known) = w.truth.get_mut(&s).unwrap();
                    if *known < t.len() {
                        prop_assert!(matches!(w.m.append(s, &tokens), Err(Error::Tokens(_))), "append past unresolved ids");
                        prop_assert_eq!(w.m.tokens(s).unwrap().len(), n);
                    } else {
                        w.m.append(s, &tokens).unwrap();
                        t.extend(&tokens);
                        *known = t.len();
                        prop_assert_eq!(w.m.tokens(s).unwrap().len(), n + tokens.len());
                    }
                }
            }
            Op::AppendPending { seq, tokens } => {
                if let Some(s) = pick(&w, seq) {
                    w.m.append_pending(s, tokens.len()).unwrap();
                    w.truth.get_mut(&s).unwrap().0.extend(&tokens);
                }
            }
            Op::Resolve { seq, count } => {
                if let Some(s) = pick(&w, seq) {
                    let (t, known) = w.truth.get_mut(&s).unwrap();
                    let c = count.min(t.len() - *known);
                    w.m.resolve(s, &t[*known..*known + c]).unwrap();
                    *known += c;
                    prop_assert_eq!(w.m.num_known(s).unwrap(), *known);
                    if c < count {
                        prop_assert!(w.m.resolve(s, &vec![0; count - c]).is_err(), "resolve past the pending ids");
                    }
                }
            }
            Op::Trim { seq, back } => {
                if let Some(s) = pick(&w, seq) {
                    let n = w.m.tokens(s).unwrap().len();
                    let keep = n.saturating_sub(back).max(1);
                    match w.m.trim(s, keep) {
                        Ok(copies) => {
                            w.apply_copies(&copies);
                            prop_assert_eq!(w.m.tokens(s).unwrap().len(), keep);
                            let (t, known) = w.truth.get_mut(&s).unwrap();
                            t.truncate(keep);
                            *known = (*known).min(keep);
                        }
                        Err(Error::TrimBeyondWindow { .. }) | Err(Error::OutOfBlocks { .. }) => {
                            prop_assert_eq!(w.m.tokens(s).unwrap().len(), n, "failed trim changed the sequence");
                        }
                        Err(e) => return Err(TestCaseError::fail(format!("trim: {e}"))),
                    }
                }
            }
            Op::Fork { seq } => {
                if let Some(s) = pick(&w, seq) {
                    match w.m.fork(s) {
                        Ok((c, copies)) => {
                            w.apply_copies(&copies);
                            prop_assert_eq!(w.m.tokens(c).unwrap(), w.m.tokens(s).unwrap());
                            w.salts.insert(c, w.salts[&s]);
                            w.truth.insert(c, w.truth[&s].clone());
                            w.live.push(c);
                        }
                        Err(Error::OutOfBlocks { .. }) => {}
                        Err(e) => return Err(TestCaseError::fail(format!("fork: {e}"))),
                    }
                }
            }
            Op::Finish { seq } => {
                if let Some(s) = pick(&w, seq) {
                    w.m.finish(s).unwrap();
                    w.live.retain(|&x| x != s);
                    prop_assert!(w.m.tokens(s).is_err());
                }
            }
        }
        w.check()?;
    }
    for s in w.live.clone() {
        w.m.finish(s).unwrap();
        w.live.retain(|&x| x != s);
    }
    w.check()?;
    for g in 0..w.groups.len() {
        let st = w.m.allocator(g).unwrap().stats();
        prop_assert_eq!(st.free, st.total, "everything back after all sequences finished");
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(192))]
    #[test]
    fn full_attention(ops in prop::collection::vec(op(), 1..60)) {
        run(vec![(Attention::Full, 20)], ops)?;
    }

    #[test]
    fn full_and_sliding(ops in prop::collection::vec(op(), 1..60)) {
        run(vec![(Attention::Full, 24), (Attention::Sliding { window: 5 }, 12)], ops)?;
    }
}

#[test]
fn prefix_hit_exact_and_salted() {
    let mut m = KvCacheManager::with_groups(BS, 0, &[(Attention::Full, 16)]).unwrap();
    let p: Vec<u32> = (0..14).collect();
    let a = m.begin(&p, ExtraKeys::none()).unwrap();
    m.step(a.seq, 100).unwrap();
    let a_blocks = m.blocks(a.seq, 0).unwrap();
    m.finish(a.seq).unwrap();
    let b = m.begin(&p, ExtraKeys::none()).unwrap();
    assert_eq!(b.cached_tokens, 12);
    assert_eq!(m.blocks(b.seq, 0).unwrap()[..3], a_blocks[..3]);
    let salted = m.begin(&p, ExtraKeys { salt: Some(5), ..Default::default() }).unwrap();
    assert_eq!(salted.cached_tokens, 0, "different extra keys never share");
    let mut q = p.clone();
    q[5] = 77;
    let c = m.begin(&q, ExtraKeys::none()).unwrap();
    assert_eq!(c.cached_tokens, 4, "hit stops at the first differing block");
    assert!(m.stats().prefix_hit_rate > 0.0);
}

/// A step's new blocks come in id order: a prompt that reuses a finished sequence's evicted
/// blocks (freed tail first) still gets consecutive slots.
#[test]
fn new_blocks_of_a_step_come_in_id_order() {
    let mut m = KvCacheManager::with_groups(BS, 0, &[(Attention::Full, 16)]).unwrap();
    for first in [1u32, 2, 3] {
        let p: Vec<u32> = std::iter::once(first).chain(100..100 + 12 * BS as u32).collect();
        let s = m.begin(&p, ExtraKeys::none()).unwrap();
        assert_eq!(s.cached_tokens, 0);
        let st = m.step(s.seq, usize::MAX).unwrap();
        let runs = 1 + st.groups[0].slot_mapping.windows(2).filter(|w| w[1] != w[0] + 1).count();
        assert!(runs <= 2, "prompt {first}: {runs} runs of slots {:?}", st.groups[0].slot_mapping);
        m.finish(s.seq).unwrap();
    }
}

#[test]
fn out_of_blocks_carries_numbers() {
    let mut m = KvCacheManager::with_groups(BS, 0, &[(Attention::Full, 2)]).unwrap();
    let s = m.begin(&[1; 20], ExtraKeys::none()).unwrap();
    match m.step(s.seq, 100) {
        Err(Error::OutOfBlocks { group: 0, needed: 5, free: 2, total: 2 }) => {}
        other => panic!("{other:?}"),
    }
    assert_eq!(m.step(s.seq, 8).unwrap().len, 8);
}
