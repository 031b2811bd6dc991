//! Last-position logits of one prompt, for checking reduced-precision runs against f32:
//!
//! ```text
//! logits_probe --model DIR [--dtype bf16|f16|f32] [--prompt 128] --out FILE [--time N] [--kv flat|paged]
//! ```
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
    #[arg(long)]
    out: String,
    /// Also time this many forward passes of the prompt (median printed).
    #[arg(long, default_value_t = 0)]
    time: usize,
}

fn main() -> Res<()> {
    let Cli { m, out, time } = <Cli as clap::Parser>::parse();
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
