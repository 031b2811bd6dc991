//! Last-position logits of one prompt, for checking reduced-precision runs against f32:
//!
//! ```text
//! logits_probe --model DIR [--dtype bf16|f16|f32] [--prompt 128] --out FILE [--time N] [--kv flat|paged]
//! logits_probe --model DIR [--dtype bf16] [--prompt 33] --against-cpu
//! ```
//!
//! `--against-cpu` (instead of FILE) runs the prompt on the default device (a GPU) in `--dtype`
//! and again with a copy of the model loaded on the CPU in f32 (MLX's CPU has no bf16 `gather_mm`),
//! and prints, for the residual stream after each decoder
//! layer (families with `forward_taps`) and for the logits of every position, the largest
//! |device - cpu|, the largest |cpu| and the non-finite values on each side: the first layer
//! that departs is where a device kernel goes wrong.
//!
//! `--time N` also times N more forward passes of the prompt that evaluate only the caches (a
//! fresh cache each; no logits), as mlx-lm's prefill of a prompt's leading tokens does, and prints
//! their median: the prefill without the generation loop around it. With `--kv paged` each timed
//! pass changes the first id (so no pass is a prefix-cache hit of an earlier one).
//!
//! The prompt is llm_bench's (`(i * 7919 + 13) % min(vocab - 100, 30000) + 10`); FILE gets the
//! f32 logits, little-endian, and the top 5 ids are printed. `mlx_lm_bench.py --logits FILE`
//! writes mlx-lm's, and `compare_logits.py` compares any of them against an f32 run.
use mlx_array::DType;
use mlx_models::Logits;

#[path = "../shared.rs"]
mod shared;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// Last-position logits of one prompt.
#[derive(clap::Parser)]
struct Cli {
    #[command(flatten)]
    m: shared::ModelArgs,
    /// Where the f32 logits are written (little-endian).
    #[arg(long, required_unless_present = "against_cpu")]
    out: Option<String>,
    /// Compare every layer's output and every position's logits with the CPU instead.
    #[arg(long, conflicts_with_all = ["out", "time"])]
    against_cpu: bool,
    /// Also time this many forward passes of the prompt (median printed).
    #[arg(long, default_value_t = 0)]
    time: usize,
}

fn main() -> Res<()> {
    let Cli { m, out, time, against_cpu } = <Cli as clap::Parser>::parse();
    if against_cpu {
        return against_cpu_run(&m);
    }
    let out = out.ok_or("--out FILE")?;
    let (model, _) = m.load_lm()?;
    let shared::ModelArgs { dtype, prompt, .. } = m;
    let vocab = model.info().vocab_size;
    let ids = shared::prompt_ids(prompt, vocab);
    let t = mlx_array::Array::from_slice(&ids, &[1, prompt])?;
    let mut cache = model.new_cache();
    let out_arr = model.forward(&t, &mut cache, Logits::Last, false)?.logits.ok_or("no logits")?;
    let logits = out_arr.astype(DType::F32)?.to_vec::<f32>()?;
    let mut idx: Vec<usize> = (0..logits.len()).collect();
    idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
    let top: Vec<String> = idx[..5].iter().map(|&i| format!("{i}:{:.4}", logits[i])).collect();
    println!("{dtype} top5 {}", top.join(" "));
    if time > 0 {
        let mut ms = Vec::with_capacity(time);
        for run in 0..time {
            let mut ids = ids.clone();
            ids[0] = 1 + run as u32 % 9; // prompt ids start at 10: never a prefix hit
            let t = mlx_array::Array::from_slice(&ids, &[1, prompt])?;
            let t0 = std::time::Instant::now();
            let mut cache = model.new_cache();
            model.forward(&t, &mut cache, Logits::None, false)?;
            cache.eval_with(&[])?;
            ms.push(t0.elapsed().as_secs_f64() * 1e3);
        }
        ms.sort_by(f64::total_cmp);
        println!("forward of {prompt} tokens: median {:.1} ms (min {:.1}, max {:.1}, {time} runs)", ms[time / 2], ms[0], ms[time - 1]);
    }
    let bytes: Vec<u8> = logits.iter().flat_map(|x| x.to_le_bytes()).collect();
    std::fs::write(&out, bytes)?;
    Ok(())
}

/// The residual stream after each layer (where the family exposes it; the last layer's is the
/// head's input and has no tap) and every position's f32 logits, for `ids`.
fn layers_and_logits(model: &mlx_models::Model, ids: &[u32]) -> Res<(Vec<mlx_array::Array>, mlx_array::Array)> {
    let t = mlx_array::Array::from_slice(ids, &[1, ids.len()])?;
    let taps: Vec<usize> = (0..model.info().num_layers.saturating_sub(1)).collect();
    let mut cache = model.new_cache();
    let (out, layers) = match model.with_runtime(|rt| rt.forward_taps(&t, &mut cache, Logits::All, false, &taps)) {
        Ok(r) => r,
        Err(mlx_models::ModelError::UnsupportedOption(why)) => {
            eprintln!("no layer taps: {why}");
            let mut cache = model.new_cache();
            (model.forward(&t, &mut cache, Logits::All, false)?, Vec::new())
        }
        Err(e) => return Err(e.into()),
    };
    let logits = out.logits.ok_or("no logits")?.astype(DType::F32)?;
    let layers = layers.iter().map(|a| a.astype(DType::F32)).collect::<Result<Vec<_>, _>>()?;
    mlx_array::eval(&layers.iter().chain([&logits]).collect::<Vec<_>>())?;
    Ok((layers, logits))
}

/// `--against-cpu`: the model on the default device against a copy on the CPU.
fn against_cpu_run(m: &shared::ModelArgs) -> Res<()> {
    let device = mlx_array::default_device()?;
    let (model, _) = m.load_lm()?;
    let ids = shared::prompt_ids(m.prompt, model.info().vocab_size);
    let (dev_layers, dev_logits) = layers_and_logits(&model, &ids)?;
    mlx_array::set_default_device(mlx_array::Device::Cpu);
    let (opts, _) = m.load_options()?;
    let cpu_opts = mlx_models::LoadOptions { dtype: Some(DType::F32), ..opts };
    let cpu_model = mlx_models::load_model(&m.model, &cpu_opts)?.into_lm()?;
    let (cpu_layers, cpu_logits) = layers_and_logits(&cpu_model, &ids)?;
    let host = |a: &mlx_array::Array| a.to_vec::<f32>();
    let stats = |a: &[f32], b: &[f32]| {
        let err = a.iter().zip(b).filter(|(x, y)| x.is_finite() && y.is_finite()).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
        let scale = b.iter().filter(|y| y.is_finite()).map(|y| y.abs()).fold(0f32, f32::max);
        format!("max |{device:?} - cpu| {err:.3e} (largest |cpu| {scale:.3e}), non-finite {device:?} {} cpu {}", shared::non_finite(a), shared::non_finite(b))
    };
    println!("{} positions, {device:?} in {}, cpu in f32", ids.len(), m.dtype);
    for (i, (d, c)) in dev_layers.iter().zip(&cpu_layers).enumerate() {
        println!("layer {i}: {}", stats(&host(d)?, &host(c)?));
    }
    let (d, c) = (host(&dev_logits)?, host(&cpu_logits)?);
    println!("logits: {}", stats(&d, &c));
    // the positions whose argmax differs
    let vocab = model.info().vocab_size;
    let flips: Vec<usize> = (0..ids.len()).filter(|&p| shared::argmax(&d[p * vocab..(p + 1) * vocab]) != shared::argmax(&c[p * vocab..(p + 1) * vocab])).collect();
    println!("argmax differs at positions {flips:?}");
    Ok(())
}
