//! Checkpoint conversion from the command line.
//!
//! ```text
//! cargo run --release -p mlx-convert --example convert -- gguf IN.gguf OUT_DIR [--dtype f32|bf16|f16] [--config-from HF_DIR] [--json]
//! ```
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use mlx_convert::{gguf_to_hf, GgufToHfOptions, OutDtype};

#[derive(Parser)]
#[command(about = "Convert checkpoints for mlx-models")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// GGUF file -> Hugging Face directory (config.json, tokenizer files, model.safetensors).
    Gguf {
        input: PathBuf,
        output: PathBuf,
        /// Element type of the written tensors.
        #[arg(long, default_value = "bf16")]
        dtype: OutDtype,
        /// Take config.json, tokenizer and chat template from this Hugging Face directory.
        #[arg(long)]
        config_from: Option<PathBuf>,
        /// Print a JSON summary instead of the summary line.
        #[arg(long)]
        json: bool,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Gguf { input, output, dtype, config_from, json } => {
            let bar = ProgressBar::new(0);
            bar.set_style(
                ProgressStyle::with_template("{bar:40} {pos}/{len} tensors {bytes_per_sec} {msg}")
                    .expect("valid template"),
            );
            let opts = GgufToHfOptions { dtype, config_from };
            let result = gguf_to_hf(&input, &output, &opts, |p| {
                bar.set_length(p.total as u64);
                bar.set_position(p.index as u64 + 1);
                bar.set_message(p.tensor.to_string());
            });
            bar.finish_and_clear();
            match result {
                Ok(s) => {
                    if json {
                        println!("{}", serde_json::to_string(&s).expect("summary serializes"));
                    } else {
                        println!(
                            "{} ({}) -> {}: {} tensors, {:.1} MB {}, {:.1} s",
                            input.display(),
                            s.architecture,
                            s.output.display(),
                            s.tensors,
                            s.bytes_written as f64 / 1e6,
                            s.dtype.torch_name(),
                            s.seconds
                        );
                        if s.chat_template == Some(mlx_convert::gguf::ChatTemplateSource::Builtin) {
                            println!("the GGUF has no chat template: wrote the built-in {} turn format", s.architecture);
                        }
                    }
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("error: {e}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}
