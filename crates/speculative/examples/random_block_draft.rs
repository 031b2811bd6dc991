//! Write a random DSpark or DFlash draft checkpoint for the config.json in a directory: every
//! tensor the loader reads (`BlockNet::expected_tensors`), drawn as its layout says.
//!
//! `cargo run -p mlx-speculative --example random_block_draft -- DIR [--seed N] [--dtype f32|bf16]`
use clap::{Parser, ValueEnum};
use std::path::PathBuf;

#[derive(Clone, Copy, ValueEnum)]
enum Dtype {
    F32,
    Bf16,
}

#[derive(Parser)]
struct Cli {
    /// Directory holding the draft's config.json; model.safetensors is written next to it.
    dir: PathBuf,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    #[arg(long, value_enum, default_value = "f32")]
    dtype: Dtype,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let cli = Cli::parse();
    let dtype = match cli.dtype {
        Dtype::F32 => mlx_array::DType::F32,
        Dtype::Bf16 => mlx_array::DType::BF16,
    };
    let path = mlx_speculative::create_random_block_draft(&cli.dir, cli.seed, dtype)?;
    println!("{}", path.display());
    Ok(())
}
