//! State-machine test of `BlockAllocator` against a plain model (Vec refcounts, VecDeque LRU,
//! HashMap cache): refcounts, free/in-use partition, LRU eviction order, verified lookups.
use std::collections::{HashMap, VecDeque};

use kv_paged::{BlockAllocator, BlockId, BlockKey, Error};
use proptest::prelude::*;

const N: usize = 8;
const BS: usize = 2;

#[derive(Debug, Clone)]
enum Op {
    Allocate,
    Release(usize),
    Retain(usize),
    Register(usize, [u32; BS], u8),
    Unregister(usize),
    Lookup([u32; BS], u8),
}

fn op() -> impl Strategy<Value = Op> {
    let toks = prop::array::uniform2(0u32..2);
    prop_oneof![
        3 => Just(Op::Allocate),
        3 => any::<usize>().prop_map(Op::Release),
        1 => any::<usize>().prop_map(Op::Retain),
        3 => (any::<usize>(), toks.clone(), 0u8..2).prop_map(|(i, t, p)| Op::Register(i, t, p)),
        1 => any::<usize>().prop_map(Op::Unregister),
        2 => (toks, 0u8..2).prop_map(|(t, p)| Op::Lookup(t, p)),
    ]
}

/// The key of a block of `t` whose parent is one of two fixed "prefixes" `p`.
fn key(t: &[u32; BS], p: u8) -> BlockKey {
    BlockKey::new(Some(kv_paged::BlockHash(p as u128 + 1)), 0, t)
}

#[derive(Default)]
struct Model {
    refs: Vec<u32>,
    free: VecDeque<u32>,
    /// hash -> (block, tokens, key)
    cache: HashMap<u128, (u32, [u32; BS], BlockKey)>,
    key_of: Vec<Option<u128>>,
}

impl Model {
    fn new() -> Self {
        Model { refs: vec![0; N], free: (0..N as u32).collect(), key_of: vec![None; N], ..Default::default() }
    }
    fn allocate(&mut self) -> Option<u32> {
        let b = self.free.pop_front()?;
        if let Some(h) = self.key_of[b as usize].take() {
            self.cache.remove(&h);
        }
        self.refs[b as usize] = 1;
        Some(b)
    }
    fn release(&mut self, b: u32) {
        self.refs[b as usize] -= 1;
        if self.refs[b as usize] == 0 {
            if self.key_of[b as usize].is_some() {
                self.free.push_back(b);
            } else {
                self.free.push_front(b);
            }
        }
    }
    fn retain(&mut self, b: u32) {
        if self.refs[b as usize] == 0 {
            self.free.retain(|&x| x != b);
        }
        self.refs[b as usize] += 1;
    }
}

fn check(a: &BlockAllocator, m: &Model) -> Result<(), TestCaseError> {
    let s = a.stats();
    prop_assert_eq!(s.total, N);
    prop_assert_eq!(s.free + s.in_use, s.total);
    prop_assert_eq!(a.free_order(), m.free.iter().map(|&b| BlockId(b)).collect::<Vec<_>>(), "LRU order");
    for b in 0..N as u32 {
        let r = a.refcount(BlockId(b)).unwrap();
        prop_assert_eq!(r, m.refs[b as usize]);
        prop_assert_eq!(a.is_free(BlockId(b)), r == 0, "block {} free iff refcount 0", b);
        prop_assert_eq!(a.key(BlockId(b)).unwrap().map(|k| k.hash.0), m.key_of[b as usize]);
    }
    prop_assert_eq!(s.cached, m.cache.len());
    prop_assert_eq!(s.cached_free, m.free.iter().filter(|&&b| m.key_of[b as usize].is_some()).count());
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    #[test]
    fn allocator_matches_model(ops in prop::collection::vec(op(), 1..80)) {
        let mut a = BlockAllocator::new(N, BS, 10).unwrap();
        let mut m = Model::new();
        for op in ops {
            let in_use: Vec<u32> = (0..N as u32).filter(|&b| m.refs[b as usize] > 0).collect();
            match op {
                Op::Allocate => match (a.allocate(), m.allocate()) {
                    (Ok(b), Some(e)) => prop_assert_eq!(b.0, e, "LRU eviction order"),
                    (Err(Error::OutOfBlocks { needed: 1, free: 0, total, .. }), None) => prop_assert_eq!(total, N),
                    (r, e) => prop_assert!(false, "allocate {:?} vs model {:?}", r, e),
                },
                Op::Release(i) => {
                    if in_use.is_empty() {
                        let b = BlockId((i % N) as u32);
                        prop_assert!(a.release(b).is_err(), "release of a free block must fail");
                    } else {
                        let b = in_use[i % in_use.len()];
                        a.release(BlockId(b)).unwrap();
                        m.release(b);
                    }
                }
                Op::Retain(i) => {
                    let b = (i % N) as u32; // in use or free (a cache hit taken back)
                    a.retain(BlockId(b)).unwrap();
                    m.retain(b);
                }
                Op::Register(i, t, p) => {
                    if in_use.is_empty() { continue; }
                    let b = in_use[i % in_use.len()];
                    let k = key(&t, p);
                    let r = a.register(BlockId(b), k, &t);
                    if m.key_of[b as usize].is_some() {
                        prop_assert!(r.is_err());
                    } else if let std::collections::hash_map::Entry::Vacant(e) = m.cache.entry(k.hash.0) {
                        prop_assert_eq!(r.unwrap(), true);
                        e.insert((b, t, k));
                        m.key_of[b as usize] = Some(k.hash.0);
                    } else {
                        prop_assert_eq!(r.unwrap(), false);
                    }
                }
                Op::Unregister(i) => {
                    let b = (i % N) as u32;
                    a.unregister(BlockId(b)).unwrap();
                    if let Some(h) = m.key_of[b as usize].take() {
                        m.cache.remove(&h);
                        if m.refs[b as usize] == 0 {
                            m.free.retain(|&x| x != b);
                            m.free.push_front(b);
                        }
                    }
                }
                Op::Lookup(t, p) => {
                    let k = key(&t, p);
                    let want = m.cache.get(&k.hash.0).filter(|(_, tt, kk)| *tt == t && *kk == k).map(|e| BlockId(e.0));
                    prop_assert_eq!(a.lookup(&k, &t), want);
                    // Same hash, different tokens: never a hit.
                    let other = [t[0] ^ 7, t[1]];
                    prop_assert_eq!(a.find(&k, &other), None);
                }
            }
            check(&a, &m)?;
        }
    }
}
