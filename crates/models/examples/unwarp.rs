//! Unwarp a photographed document page with a UVDoc checkpoint (config.json + model.safetensors,
//! mlx-node's `UVDoc-mlx` layout).
//!
//! ```text
//! cargo run --release -p mlx-models --example unwarp -- --model DIR --image IN.png --out OUT.png
//! ```
use clap::Parser;
use mlx_models::docunwarp::DocUnwarpModel;
use mlx_models::media::ImageInput;
use std::path::PathBuf;
use std::time::Instant;

#[derive(Parser)]
#[command(about = "Unwarp a document photo (PNG or JPEG) with a UVDoc checkpoint; writes a PNG")]
struct Cli {
    /// Checkpoint directory (config.json, model.safetensors).
    #[arg(long)]
    model: PathBuf,
    /// The photo to unwarp (PNG or JPEG).
    #[arg(long)]
    image: PathBuf,
    /// Where to write the unwarped page (PNG, replaced atomically).
    #[arg(long)]
    out: PathBuf,
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let cli = Cli::parse();
    let model = DocUnwarpModel::load(&cli.model)?;
    let t = Instant::now();
    let out = model.unwarp(&ImageInput::path(&cli.image))?;
    let secs = t.elapsed().as_secs_f64();
    out.save(&cli.out)?;
    let (gh, gw) = (out.displacement.height, out.displacement.width);
    println!(
        "{}: {}x{} page, {gh}x{gw} grid, {secs:.3} s -> {} ({} bytes)",
        cli.image.display(),
        out.image.width,
        out.image.height,
        cli.out.display(),
        out.png.len()
    );
    Ok(())
}

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
