//! Soak: chat sessions driven for many turns on the paged cache (tiny Qwen3 fixture, a 4 MB pool
//! of 4-token blocks). One session: a new conversation every fifth turn, continued otherwise;
//! MLX's active memory and the pool's storage stay bounded (old conversations' blocks are
//! evicted), with no error. Threads: 8 threads x 4 sessions on one model give what the same
//! scripts give one after another. CI runs the reduced forms; `cargo test -p mlx-models --test
//! soak -- --ignored` the full ones (1,000 turns; 200 turns per session).
mod common;
use common::*;
use mlx_models::chat::ChatMessage;
use mlx_models::{load_model, ChatConfig, ChatSession, KvCacheMode, LoadOptions, Model, PagedConfig};
use sampling::SamplingOverrides;
use std::sync::Mutex;

/// The tests of this file measure memory: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn model() -> Model {
    let kv = KvCacheMode::Paged(PagedConfig { block_size: 4, memory_mb: Some(4.0), ..Default::default() });
    load_model(fixture("qwen3"), &LoadOptions { kv_cache: kv, ..test_load_options() }).unwrap().into_lm().unwrap()
}

fn cfg(seed: u64) -> ChatConfig {
    // sampled (seeded), so replies differ between turns and sessions
    ChatConfig { max_new_tokens: 6, sampling: SamplingOverrides { temperature: Some(0.8), seed: Some(seed), ..Default::default() }, ..Default::default() }
}

/// One session's script: `turns` turns, a new conversation every fifth. Returns every reply.
fn drive(s: &mut ChatSession, id: usize, turns: usize) -> Vec<String> {
    (0..turns)
        .map(|t| {
            let c = cfg((id * 100_000 + t) as u64);
            let r = if t % 5 == 0 {
                s.start(vec![ChatMessage::system("You are terse."), ChatMessage::user(format!("Conversation {id}.{t}: tell me about {}", t * 7 % 13))], &c)
            } else {
                s.continue_with(&format!("And then ({t})?"), &c)
            };
            r.unwrap_or_else(|e| panic!("session {id} turn {t}: {e}")).raw_text
        })
        .collect()
}

fn session_soak(turns: usize) {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let m = model();
    let budget = m.paged_storage_bytes();
    let mut s = ChatSession::new(m.clone()).unwrap();
    let mut active = Vec::with_capacity(turns / 5);
    let mut pool = Vec::new();
    for chunk in 0..turns / 5 {
        drive(&mut s, chunk, 5);
        active.push(mlx_array::memory::active().unwrap());
        pool.push(m.paged_storage_bytes().unwrap_or(0));
    }
    let warm = active.len() / 4;
    let early = *active[..=warm].iter().max().unwrap();
    let late = *active[warm..].iter().max().unwrap();
    assert!(late <= early + early / 4 + (2 << 20), "active memory grew: {early} bytes after {} turns, {late} later", 5 * (warm + 1));
    if let Some(b) = budget {
        assert!(pool.iter().all(|&p| p <= b.max(4 << 20)), "pool storage beyond its budget: {pool:?}");
    }
}

fn threads_soak(turns: usize) {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let m = model();
    let want: Vec<Vec<String>> = (0..32).map(|id| drive(&mut ChatSession::new(m.clone()).unwrap(), id, turns)).collect();
    let got: Vec<Vec<String>> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..8)
            .map(|th| {
                let m = m.clone();
                sc.spawn(move || {
                    let mut sessions: Vec<(usize, ChatSession)> = (0..4).map(|k| (th * 4 + k, ChatSession::new(m.clone()).unwrap())).collect();
                    let mut out: Vec<(usize, Vec<String>)> = sessions.iter().map(|(id, _)| (*id, Vec::new())).collect();
                    // the thread's four sessions take turns, so their caches interleave in the pool
                    for t in 0..turns {
                        for (k, (id, s)) in sessions.iter_mut().enumerate() {
                            let c = cfg((*id * 100_000 + t) as u64);
                            let r = if t % 5 == 0 {
                                s.start(vec![ChatMessage::system("You are terse."), ChatMessage::user(format!("Conversation {id}.{t}: tell me about {}", t * 7 % 13))], &c)
                            } else {
                                s.continue_with(&format!("And then ({t})?"), &c)
                            };
                            out[k].1.push(r.unwrap_or_else(|e| panic!("session {id} turn {t}: {e}")).raw_text);
                        }
                    }
                    out
                })
            })
            .collect();
        let mut all: Vec<(usize, Vec<String>)> = hs.into_iter().flat_map(|h| h.join().unwrap()).collect();
        all.sort_by_key(|(id, _)| *id);
        all.into_iter().map(|(_, r)| r).collect()
    });
    assert_eq!(got, want, "threaded sessions differ from the sequential run");
}

#[test]
fn session_soak_reduced() {
    session_soak(100);
}

#[test]
fn threads_soak_reduced() {
    threads_soak(5);
}

#[test]
#[ignore]
fn session_soak_1000_turns() {
    session_soak(1000);
}

#[test]
#[ignore]
fn threads_soak_200_turns() {
    threads_soak(200);
}
