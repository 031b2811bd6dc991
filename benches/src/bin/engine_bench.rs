//! engine_bench: the continuous-batching engine ([`mlx_models::Engine`]) with streams that join
//! while others decode: `--streams` requests, of which `--late` are submitted once the first
//! early one has produced `--gen / 4` tokens. Prints the aggregate tok/s (every generated token
//! over the wall time from the first submission to the last token), TTFT p50 over all streams
//! and over the late ones, the longest gap between two tokens of an early stream (how long the
//! late prompts held the decoding rows up), and the engine's pass counters.
//!
//! ```sh
//! cargo run --release -p mlx-models-bench --bin engine_bench -- --model DIR [--streams 8] [--late 4] [--prompt 256] [--gen 64] [--kv flat|paged] [--chunk 512] [--mixed-chunk 64] [--prompt-passes auto|mixed|separate] [--runs 3]
//! ```
//! Greedy decoding, no stop tokens; distinct prompts (no shared prefix, no identical prompts).
use clap::{Parser, ValueEnum};
use mlx_models::{
    load_model, Engine, EngineConfig, EngineKv, Event, GenerateConfig, KvCacheMode, LoadOptions,
    PagedConfig, PromptPasses, RequestHandle,
};
use sampling::SamplingConfig;
use std::path::PathBuf;
use std::time::{Duration, Instant};

#[derive(Clone, Copy, ValueEnum)]
enum Kv {
    Flat,
    Paged,
}

#[derive(Clone, Copy, ValueEnum)]
enum Passes {
    Auto,
    Mixed,
    Separate,
}

#[derive(Parser)]
#[command(about = "Continuous batching with late joiners: aggregate tok/s, TTFT, decode stalls")]
struct Args {
    /// Checkpoint directory (e.g. from `llm_bench --create-random qwen3-small`).
    #[arg(long)]
    model: PathBuf,
    /// Concurrent requests.
    #[arg(long, default_value_t = 8)]
    streams: usize,
    /// Requests submitted late (after the first early one has `--gen / 4` tokens).
    #[arg(long, default_value_t = 4)]
    late: usize,
    /// Prompt length of every request, tokens.
    #[arg(long, default_value_t = 256)]
    prompt: usize,
    /// Tokens generated per request.
    #[arg(long, default_value_t = 64)]
    gen: usize,
    /// Where the K/V live.
    #[arg(long, value_enum, default_value = "flat")]
    kv: Kv,
    /// Prompt tokens a row computes per forward pass without decoding rows
    /// ([`EngineConfig::prefill_step_size`]).
    #[arg(long, default_value_t = EngineConfig::default().prefill_step_size)]
    chunk: usize,
    /// Prompt tokens a row computes per forward pass beside decoding rows
    /// ([`EngineConfig::mixed_step_size`]).
    #[arg(long, default_value_t = EngineConfig::default().mixed_step_size)]
    mixed_chunk: usize,
    /// Whether prompt chunks share passes with decoding rows ([`EngineConfig::prompt_passes`]).
    #[arg(long, value_enum, default_value = "auto")]
    prompt_passes: Passes,
    /// Repetitions (each printed).
    #[arg(long, default_value_t = 1)]
    runs: usize,
    /// Seed of the prompt ids.
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

type Res<T> = std::result::Result<T, Box<dyn std::error::Error>>;

/// What one request saw: time to first token, token times.
struct Seen {
    ttft: Duration,
    times: Vec<Instant>,
}

fn collect(h: RequestHandle, submitted: Instant) -> Res<Seen> {
    let mut times = Vec::new();
    loop {
        match h.events.recv()? {
            Event::Token(_) => times.push(Instant::now()),
            Event::Finished { .. } => break,
            Event::Error(e) => return Err(e.into()),
        }
    }
    let first = *times.first().ok_or("a request produced no token")?;
    Ok(Seen {
        ttft: first - submitted,
        times,
    })
}

fn p50(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

fn main() -> Res<()> {
    let a = Args::parse();
    if a.late > a.streams || a.streams == a.late {
        return Err(format!(
            "--late {} must leave at least one of --streams {} early",
            a.late, a.streams
        )
        .into());
    }
    let (kv_cache, kv) = match a.kv {
        Kv::Flat => (KvCacheMode::Flat, EngineKv::Flat),
        Kv::Paged => (
            KvCacheMode::Paged(PagedConfig {
                max_seqs: a.streams,
                ..Default::default()
            }),
            EngineKv::Paged,
        ),
    };
    let model = load_model(
        &a.model,
        &LoadOptions {
            kv_cache,
            ..Default::default()
        },
    )?
    .into_lm()?;
    let vocab = model.info().vocab_size as u64;
    let cfg = GenerateConfig {
        max_new_tokens: a.gen,
        sampling: SamplingConfig::greedy(),
        stop_tokens: Some(vec![]),
        ..Default::default()
    };
    let engine = Engine::start(
        model,
        EngineConfig {
            max_batch: a.streams,
            prefill_step_size: a.chunk,
            mixed_step_size: a.mixed_chunk,
            prompt_passes: match a.prompt_passes {
                Passes::Auto => PromptPasses::Auto,
                Passes::Mixed => PromptPasses::Mixed,
                Passes::Separate => PromptPasses::Separate,
            },
            max_queue: a.streams,
            kv,
        },
    )?;
    let h = engine.handle();
    // warm-up: one short request
    collect(
        h.submit(
            vec![1, 2, 3],
            &GenerateConfig {
                max_new_tokens: 4,
                ..cfg.clone()
            },
        )?,
        Instant::now(),
    )?;
    println!(
        "model {} streams {} late {} prompt {} gen {} chunk {} mixed chunk {}",
        a.model.display(),
        a.streams,
        a.late,
        a.prompt,
        a.gen,
        a.chunk,
        a.mixed_chunk
    );
    for run in 0..a.runs {
        let salt = a.seed + run as u64 * 1_000_003;
        let prompt = |r: usize| -> Vec<u32> {
            (0..a.prompt)
                .map(|i| ((i as u64 * 7919 + r as u64 * 104_729 + salt) % vocab) as u32)
                .collect()
        };
        let before = h.stats();
        let start = Instant::now();
        let early = a.streams - a.late;
        let mut threads = Vec::new();
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        for r in 0..early {
            let req = h.submit(prompt(r), &cfg)?;
            let tx = (r == 0).then(|| tx.clone());
            let quarter = (a.gen / 4).max(1);
            threads.push(std::thread::spawn(move || -> Result<Seen, String> {
                let submitted = Instant::now();
                let mut times = Vec::new();
                let mut tx = tx;
                loop {
                    match req.events.recv().map_err(|e| e.to_string())? {
                        Event::Token(_) => {
                            times.push(Instant::now());
                            if times.len() == quarter {
                                if let Some(t) = tx.take() {
                                    let _ = t.send(());
                                }
                            }
                        }
                        Event::Finished { .. } => break,
                        Event::Error(e) => return Err(e),
                    }
                }
                let first = *times.first().ok_or("no token")?;
                Ok(Seen {
                    ttft: first - submitted,
                    times,
                })
            }));
        }
        drop(tx);
        // the late ones join once the first early stream is a quarter through
        let _ = rx.recv();
        for r in early..a.streams {
            let req = h.submit(prompt(r), &cfg)?;
            let submitted = Instant::now();
            threads.push(std::thread::spawn(move || {
                collect(req, submitted).map_err(|e| e.to_string())
            }));
        }
        let seen: Vec<Seen> = threads
            .into_iter()
            .map(|t| {
                t.join()
                    .map_err(|_| "a stream thread panicked".to_string())
                    .and_then(|r| r)
            })
            .collect::<Result<_, _>>()?;
        let end = seen
            .iter()
            .filter_map(|s| s.times.last())
            .max()
            .copied()
            .unwrap_or(start);
        let tokens: usize = seen.iter().map(|s| s.times.len()).sum();
        let wall = (end - start).as_secs_f64();
        let ttft: Vec<f64> = seen.iter().map(|s| s.ttft.as_secs_f64() * 1e3).collect();
        let late_ttft = ttft[early..].to_vec();
        let stall = seen[..early]
            .iter()
            .flat_map(|s| {
                s.times
                    .windows(2)
                    .map(|w| (w[1] - w[0]).as_secs_f64() * 1e3)
            })
            .fold(0.0, f64::max);
        let st = h.stats();
        println!(
            "run {run}: {tokens} tokens in {wall:.2} s: {:.1} tok/s; TTFT p50 {:.0} ms (late p50 {:.0} ms); longest early-stream gap {stall:.0} ms; passes {} (mixed {}), mean rows {:.2}",
            tokens as f64 / wall,
            p50(ttft),
            p50(late_ttft),
            st.forwards - before.forwards,
            st.mixed_forwards - before.mixed_forwards,
            (st.rows - before.rows) as f64 / (st.forwards - before.forwards).max(1) as f64,
        );
    }
    Ok(())
}
