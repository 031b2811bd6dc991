//! Generate from a checkpoint.
//!
//! ```text
//! cargo run --release -p mlx-models --example generate -- --model DIR --prompt-ids 1,2,3 \
//!     --max-new-tokens 16 --temperature 0 --json
//! cargo run --release -p mlx-models --example generate -- --model DIR --prompt "Hello" [--chat]
//! ```
//! With `--json` the last stdout line is one JSON object; `token_ids` lists the new token ids.
#[path = "common/args.rs"]
mod args;
use mlx_models::chat::{ChatFormat, ChatMessage, RenderOptions};
use mlx_models::{generate, load_model, GenerateConfig, LoadOptions};
use sampling::SamplingConfig;
use std::io::Write;

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let a = args::Args::parse(&["json", "chat"])?;
    let dir = a.get("model").ok_or("--model DIR is required")?;
    let model = load_model(dir, &LoadOptions::default())?.into_lm()?;
    let format = if a.get("prompt").is_some() { Some(ChatFormat::from_dir(dir)?) } else { None };
    let prompt: Vec<u32> = match (a.ids("prompt-ids")?, a.get("prompt"), &format) {
        (Some(ids), _, _) => ids,
        (None, Some(text), Some(f)) if a.flag("chat") => f.render(&[ChatMessage::user(text)], &RenderOptions::default())?.ids,
        (None, Some(text), Some(f)) => f.tokenizer().encode(text, true)?,
        _ => return Err("give --prompt-ids or --prompt".into()),
    };
    let mut sampling = SamplingConfig::default().with_seed(a.num("seed", 0u64)?);
    sampling.temperature = a.num("temperature", 0.0f32)?;
    sampling.top_p = a.num("top-p", 1.0f32)?;
    sampling.top_k = a.num("top-k", 0u32)?;
    let mut cfg = GenerateConfig { max_new_tokens: a.num("max-new-tokens", 64usize)?, sampling, ..Default::default() };
    if let Some(f) = &format {
        let mut stop = model.info().eos_token_ids.clone();
        stop.extend(f.stop_token_ids());
        cfg.stop_tokens = Some(stop);
    }
    let mut cache = model.new_cache();
    let mut gen = generate(&model, &mut cache, &prompt, &[], cfg)?;
    let mut ids = Vec::new();
    let mut decoder = format.as_ref().map(|f| f.tokenizer().stream_decoder(true));
    let out = std::io::stdout();
    for t in gen.by_ref() {
        let t = t?;
        ids.push(t.id);
        if let (Some(d), false) = (decoder.as_mut(), a.flag("json")) {
            if let Some(s) = d.step(t.id)? {
                print!("{s}");
                out.lock().flush()?;
            }
        }
    }
    let reason = gen.finish_reason().map(|r| r.as_str()).unwrap_or("stop");
    let perf = gen.performance();
    if a.flag("json") {
        let text = match &format {
            Some(f) => Some(f.tokenizer().decode(&ids, true)?),
            None => None,
        };
        println!("{}", serde_json::json!({ "token_ids": ids, "finish_reason": reason, "text": text, "performance": perf }));
    } else if decoder.is_none() {
        println!("{}", ids.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(","));
    } else {
        println!();
    }
    if !a.flag("json") {
        eprintln!("[{reason}] {} tokens, prefill {:.1} tok/s, decode {:.1} tok/s", ids.len(), perf.prefill_tokens_per_sec, perf.decode_tokens_per_sec);
    }
    Ok(())
}

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
