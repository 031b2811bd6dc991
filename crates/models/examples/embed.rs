//! Embed with a Harrier (Qwen3 embedding) checkpoint.
//!
//! ```text
//! cargo run --release -p mlx-models --example embed -- --model DIR --prompt-ids 1,2,3 --json
//! cargo run --release -p mlx-models --example embed -- --model DIR --text "hello" [--prompt-name query]
//! ```
use clap::Parser;
use mlx_models::chat::Tokenizer;
use mlx_models::{load_model, LoadOptions};
use std::path::PathBuf;

#[derive(Parser)]
#[command(about = "Embed text or token ids with a Harrier checkpoint")]
struct Cli {
    #[arg(long)]
    model: PathBuf,
    /// Comma-separated token ids.
    #[arg(long, value_delimiter = ',', conflicts_with = "text")]
    prompt_ids: Option<Vec<u32>>,
    #[arg(long)]
    text: Option<String>,
    /// A prompt of config_sentence_transformers.json to prefix the text with.
    #[arg(long)]
    prompt_name: Option<String>,
    #[arg(long)]
    json: bool,
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let cli = Cli::parse();
    let dir = &cli.model;
    let m = load_model(dir, &LoadOptions::default())?.into_embedding()?;
    let ids = match (cli.prompt_ids.clone(), cli.text.as_deref()) {
        (Some(ids), _) => ids,
        (None, Some(text)) => {
            let prefix = match cli.prompt_name.as_deref().or(m.default_prompt_name.as_deref()) {
                Some(name) => m.prompts.get(name).cloned().ok_or_else(|| format!("no prompt named {name:?} in config_sentence_transformers.json"))?,
                None => String::new(),
            };
            Tokenizer::from_dir(dir)?.encode(&format!("{prefix}{text}"), true)?
        }
        _ => return Err("give --prompt-ids or --text".into()),
    };
    let e = m.encode_ids(&ids)?;
    if cli.json {
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
