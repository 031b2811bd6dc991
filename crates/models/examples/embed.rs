//! Embed with a Harrier (Qwen3 embedding) checkpoint.
//!
//! ```text
//! cargo run --release -p mlx-models --example embed -- --model DIR --prompt-ids 1,2,3 --json
//! cargo run --release -p mlx-models --example embed -- --model DIR --text "hello" [--prompt-name query]
//! ```
#[path = "common/args.rs"]
mod args;
use mlx_models::chat::Tokenizer;
use mlx_models::{load_model, LoadOptions};

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let a = args::Args::parse(&["json"])?;
    let dir = a.get("model").ok_or("--model DIR is required")?;
    let m = load_model(dir, &LoadOptions::default())?.into_embedding()?;
    let ids = match (a.ids("prompt-ids")?, a.get("text")) {
        (Some(ids), _) => ids,
        (None, Some(text)) => {
            let prefix = match a.get("prompt-name").or(m.default_prompt_name.as_deref()) {
                Some(name) => m.prompts.get(name).cloned().ok_or_else(|| format!("no prompt named {name:?} in config_sentence_transformers.json"))?,
                None => String::new(),
            };
            Tokenizer::from_dir(dir)?.encode(&format!("{prefix}{text}"), true)?
        }
        _ => return Err("give --prompt-ids or --text".into()),
    };
    let e = m.encode_ids(&ids)?;
    if a.flag("json") {
        println!("{}", serde_json::json!({ "embedding": e, "dim": e.len(), "tokens": ids.len() }));
    } else {
        println!("{} dims: [{}]", e.len(), e.iter().take(8).map(|x| format!("{x:.4}")).collect::<Vec<_>>().join(", ") + ", ...");
    }
    Ok(())
}

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
