//! Print the text of an image, read by a vision-language model (any registry family of kind
//! `vlm`: InternVL / Qianfan-OCR, Qwen3.5 VL, Gemma 4 with vision).
//!
//! ```text
//! cargo run --release -p mlx-models --example ocr -- --model DIR --image PATH [--prompt TEXT] [--max-tokens N]
//! ```
//! The image goes in one user message with the prompt (by default the family's OCR instruction,
//! [`mlx_models::ocr::default_prompt`]: "Parse this document to Markdown." for InternVL); the
//! reply is decoded greedily and printed to stdout. A chat template that writes no image
//! placeholder gets the InternVL-Chat prompt (`<IMG_CONTEXT>`, a newline, the instruction) instead
//! ([`mlx_models::ocr`]).
use clap::Parser;
use mlx_models::media::ImageInput;
use mlx_models::ocr::Ocr;
use mlx_models::LoadOptions;
use std::path::PathBuf;

#[derive(Parser)]
#[command(about = "Print the text of an image, read by a vision-language model")]
struct Cli {
    /// Checkpoint directory (config.json, safetensors, tokenizer files).
    #[arg(long)]
    model: PathBuf,
    /// Image file (PNG or JPEG).
    #[arg(long)]
    image: PathBuf,
    /// Instruction sent with the image (default: the family's OCR instruction).
    #[arg(long)]
    prompt: Option<String>,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 1024)]
    max_tokens: usize,
}

fn main() {
    let cli = Cli::parse();
    let run = || -> Result<String, mlx_models::ModelError> {
        let mut ocr = Ocr::load(&cli.model, &LoadOptions::default())?;
        Ok(ocr
            .read(
                ImageInput::path(&cli.image),
                cli.prompt.as_deref(),
                cli.max_tokens,
            )?
            .text)
    };
    match run() {
        Ok(text) => println!("{text}"),
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    }
}
