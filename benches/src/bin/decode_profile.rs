//! Where the host's time goes in one decode step (run it next to `benches/gpu_profile.sh`'s
//! device-side kernel times):
//!
//! ```text
//! decode_profile --model DIR [--dtype bf16] [--prompt 128] [--gen 128] [--kv flat|paged]
//! ```
//!
//! It runs the same pipelined greedy loop as `mlx_models::generate` (step n + 1 is built and
//! queued on the still-lazy token n before token n is read back), and times per token:
//! - `build`: the forward graph and the sampler graph (Rust + mlx-c op calls, no evaluation);
//! - `queue`: `async_eval` of the token, its log-prob and the cache (MLX's scheduler walks the
//!   graph, allocates buffers and encodes/launches the kernels on this thread);
//! - `wait`: reading token n back (the device finishing step n);
//! - and then the same loop without the wait overlap (`sync`: build, eval, read), whose
//!   `eval` is the device time plus launch costs.
use mlx_array::{Array, DType};
use mlx_models::Logits;
use sampling::{Sampler, SamplingConfig};
use std::time::{Duration, Instant};

#[path = "../shared.rs"]
mod shared;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// Where the host's time goes in one decode step.
#[derive(clap::Parser)]
struct Cli {
    #[command(flatten)]
    m: shared::ModelArgs,
    /// Generated tokens a round.
    #[arg(long, default_value_t = 128)]
    gen: usize,
}

fn main() -> Res<()> {
    let Cli { m, gen } = <Cli as clap::Parser>::parse();
    let (model, dt) = m.load_lm()?;
    let shared::ModelArgs { prompt, kv, .. } = m;
    let vocab = model.info().vocab_size as u32;
    let ids: Vec<u32> = (0..prompt as u32).map(|i| (i * 7919 + 13) % vocab).collect();
    eprintln!("device {:?}, {} layers, prompt {prompt}, gen {gen}, kv {kv}", mlx_array::default_device(), model.info().num_layers);

    // The fused SwiGLU kernel (compiled on the GPU) against the three plain ops.
    let g = mlx_array::random::normal(&[4, 3000], dt, &mlx_array::random::Key::new(1)?)?;
    let u = mlx_array::random::normal(&[4, 3000], dt, &mlx_array::random::Key::new(2)?)?;
    let fused = g.swiglu(&u)?.astype(DType::F32)?;
    let plain = g.silu()?.mul(&u)?.astype(DType::F32)?;
    let diff = fused.sub(&plain)?.abs()?.max(&[], false)?.item::<f32>()?;
    let scale = plain.abs()?.max(&[], false)?.item::<f32>()?;
    println!("swiglu fused vs plain: max abs diff {diff:.3e} (max |value| {scale:.3})");

    for round in 0..3 {
        let mut cache = model.new_cache();
        cache.set_queue_with_outputs(true); // as the generator: one queueing call a step
        let mut sampler = Sampler::new(SamplingConfig::greedy())?;
        // The graph of one step: forward, then the greedy sample (token and its log-prob).
        let build_step = |cache: &mut mlx_models::Cache, sampler: &mut Sampler, input: &Array| -> Res<sampling::Sample> {
            let out = model.with_runtime(|rt| rt.forward(input, cache, Logits::Last, false))?;
            let logits = out.logits.ok_or("no logits")?.reshape(&[1, -1])?;
            Ok(sampler.sample(&logits, &[])?)
        };
        // Build and queue one step (as the generator's pipelined loop does).
        let step = |cache: &mut mlx_models::Cache, sampler: &mut Sampler, input: &Array| -> Res<(Array, Duration, Duration)> {
            let t0 = Instant::now();
            let s = build_step(cache, sampler, input)?;
            let t1 = Instant::now();
            cache.async_eval_with(&[&s.tokens, &s.logprobs])?;
            Ok((s.tokens, t1 - t0, t1.elapsed()))
        };
        // prefill (one chunk): graph build, queueing call, then the wait for the first token
        let tp = Instant::now();
        let (mut tok, pb, pq) = step(&mut cache, &mut sampler, &Array::from_slice(&ids, &[1, prompt])?)?;
        tok.eval()?;
        let pw = tp.elapsed();
        // pipelined decode
        let (mut build, mut queue, mut wait) = (Duration::ZERO, Duration::ZERO, Duration::ZERO);
        let t = Instant::now();
        for _ in 0..gen {
            let (next, b, q) = step(&mut cache, &mut sampler, &tok.reshape(&[1, 1])?)?;
            let tw = Instant::now();
            let _id = tok.to_vec::<u32>()?[0];
            wait += tw.elapsed();
            build += b;
            queue += q;
            tok = next;
        }
        tok.eval()?;
        let wall = t.elapsed();
        // synchronous decode on the same cache
        let (mut sbuild, mut seval) = (Duration::ZERO, Duration::ZERO);
        let ts = Instant::now();
        for _ in 0..gen {
            let t0 = Instant::now();
            let s = build_step(&mut cache, &mut sampler, &tok.reshape(&[1, 1])?)?;
            let t1 = Instant::now();
            cache.eval_with(&[&s.tokens, &s.logprobs])?;
            let _id = s.tokens.to_vec::<u32>()?[0];
            sbuild += t1 - t0;
            seval += t1.elapsed();
            tok = s.tokens;
        }
        let swall = ts.elapsed();
        let ms = |d: Duration| d.as_secs_f64() * 1e3 / gen as f64;
        let msd = |d: Duration| d.as_secs_f64() * 1e3;
        println!("round {round}: prefill {:.2} ms (build {:.2}, queue {:.2}, then the wait)", msd(pw), msd(pb), msd(pq));
        println!(
            "round {round}: pipelined {:.3} ms/token (build {:.3}, queue {:.3}, wait {:.3}) | sync {:.3} ms/token (build {:.3}, eval+read {:.3})",
            ms(wall), ms(build), ms(queue), ms(wait), ms(swall), ms(sbuild), ms(seval)
        );
    }
    Ok(())
}
