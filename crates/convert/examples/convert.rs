//! Checkpoint conversion from the command line.
//!
//! ```text
//! cargo run --release -p mlx-convert --example convert -- gguf IN.gguf OUT_DIR [--dtype f32|bf16|f16] [--config-from HF_DIR] [--json]
//! cargo run --release -p mlx-convert --example convert -- quantize IN_DIR OUT_DIR [--bits 4] [--group-size 64] [--mode affine|mxfp4|mxfp8|nvfp4] [--recipe mixed_4_6] [--dtype f32|bf16|f16] [--max-shard-size 5G] [--json]
//! cargo run --release -p mlx-convert --example convert -- random FAMILY OUT_DIR [--preset tiny] [--dtype bf16] [--seed 0]
//! cargo run --release -p mlx-convert --example convert -- calibrate DIR --texts FILE [--seq-len 512] [--json]
//! ```
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use mlx_array::QuantMode;
use mlx_convert::{gguf_to_hf, quantize_dir, GgufToHfOptions, OutDtype, QuantizeOptions, Recipe};

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
    /// A random-weight checkpoint of any registered family (`qwen3`, `llama`, `gemma3`, `lfm2_moe`,
    /// ...) in one of its presets; the tensor list is what the loader reads for that config.
    Random {
        family: String,
        output: PathBuf,
        /// The family's preset: tiny, small, or a named size (qwen3: 0.6b, 8b).
        #[arg(long, default_value = "tiny")]
        preset: String,
        /// Element type of the written tensors.
        #[arg(long, default_value = "bf16")]
        dtype: OutDtype,
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
    /// Static activation-amax calibration (modelopt's MaxCalibrator) of a checkpoint with
    /// activation-quantised projections (mxfp8 attention projections, nvfp4 linear layers):
    /// prefill of each text, max |x| at each projection's input, written into DIR/config.json as
    /// `input_amax` (atomically; unchanged on any error).
    Calibrate {
        dir: PathBuf,
        /// Calibration texts: a UTF-8 file, one text per line (empty lines are skipped).
        #[arg(long)]
        texts: PathBuf,
        /// Tokens kept from the start of each text.
        #[arg(long, default_value_t = 512)]
        seq_len: usize,
        /// Print a JSON summary instead of the summary line.
        #[arg(long)]
        json: bool,
    },
    /// Hugging Face directory -> MLX-quantized directory in mlx-lm's layout.
    Quantize {
        input: PathBuf,
        output: PathBuf,
        /// affine, mxfp4, mxfp8 or nvfp4.
        #[arg(long, default_value = "affine")]
        mode: String,
        /// Bits per weight (affine: 2, 3, 4, 5, 6, 8; default 4; fixed for the other modes).
        #[arg(long)]
        bits: Option<u32>,
        /// Elements per scale (affine: 32, 64, 128; default 64; fixed for the other modes).
        #[arg(long)]
        group_size: Option<u32>,
        /// Mixed precision as mlx-lm's recipes (affine only): mixed_2_6, mixed_3_4, mixed_3_6, mixed_4_6.
        #[arg(long)]
        recipe: Option<Recipe>,
        /// dtype of the unquantized tensors (default: as stored).
        #[arg(long)]
        dtype: Option<OutDtype>,
        /// Largest weight shard: bytes, or a number with K, M, G (powers of 1024; mlx-lm's default 5G).
        #[arg(long, default_value = "5G", value_parser = parse_size)]
        max_shard_size: u64,
        /// Print a JSON summary instead of the summary line.
        #[arg(long)]
        json: bool,
    },
}

/// `123`, `64K`, `500M`, `5G` (powers of 1024, as mlx-lm's `5 << 30`); zero is refused.
fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let (num, shift) = match t.char_indices().last() {
        Some((i, 'K' | 'k')) => (&t[..i], 10),
        Some((i, 'M' | 'm')) => (&t[..i], 20),
        Some((i, 'G' | 'g')) => (&t[..i], 30),
        _ => (t, 0),
    };
    let n: u64 = num.trim().parse().map_err(|_| format!("{s:?} is not a size (bytes, or a number with K, M or G)"))?;
    let v = n.checked_mul(1u64 << shift).ok_or_else(|| format!("{s:?} is too large"))?;
    if v == 0 {
        return Err("the shard size must be positive".into());
    }
    Ok(v)
}

/// A bar over the tensors of a conversion (hidden when stderr is not a terminal).
fn tensor_bar() -> ProgressBar {
    let bar = ProgressBar::new(0);
    bar.set_style(ProgressStyle::with_template("{bar:40} {pos}/{len} tensors {msg}").expect("valid template"));
    bar
}

/// Tensor `index` of `total` is done.
fn show(bar: &ProgressBar, index: usize, total: usize, tensor: &str) {
    bar.set_length(total as u64);
    bar.set_position(index as u64 + 1);
    bar.set_message(tensor.to_string());
}

/// The mode the flags describe: each mode's defaults (affine 4/64, mxfp4 4/32, mxfp8 8/32,
/// nvfp4 4/16); a size the mode cannot take is an error.
fn quant_mode(mode: &str, bits: Option<u32>, group_size: Option<u32>, recipe: Option<Recipe>) -> Result<QuantMode, String> {
    let (db, dg) = match mode {
        "affine" => (4, 64),
        "mxfp4" => (4, 32),
        "mxfp8" => (8, 32),
        "nvfp4" => (4, 16),
        other => return Err(format!("unknown --mode {other:?} (affine, mxfp4, mxfp8, nvfp4)")),
    };
    if recipe.is_some() && bits.is_some() {
        return Err("--recipe sets the bits of every layer: leave out --bits".into());
    }
    QuantMode::from_parts(mode, bits.unwrap_or(db), group_size.unwrap_or(dg)).map_err(|e| e.to_string())
}

/// Print a verb's outcome: its summary as one JSON line with `--json`, else the `human` line;
/// an error on stderr.
fn report<S: serde::Serialize, E: std::fmt::Display>(result: Result<S, E>, json: bool, human: impl FnOnce(&S) -> String) -> ExitCode {
    match result {
        Ok(s) => {
            println!("{}", if json { serde_json::to_string(&s).expect("summary serializes") } else { human(&s) });
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Random { family, output, preset, dtype, seed } => {
            let dt = match dtype {
                OutDtype::F32 => mlx_array::DType::F32,
                OutDtype::F16 => mlx_array::DType::F16,
                OutDtype::Bf16 => mlx_array::DType::BF16,
            };
            match mlx_models::create_random_preset(&family, &preset, &output, dt, seed) {
                Ok(()) => {
                    println!("{}: random {family} ({preset}, {dtype:?})", output.display());
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("error: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        Command::Calibrate { dir, texts, seq_len, json } => {
            let texts: Vec<String> = match std::fs::read_to_string(&texts) {
                Ok(t) => t.lines().filter(|l| !l.trim().is_empty()).map(String::from).collect(),
                Err(e) => {
                    eprintln!("error: {}: {e}", texts.display());
                    return ExitCode::FAILURE;
                }
            };
            let bar = ProgressBar::new(0);
            bar.set_style(ProgressStyle::with_template("{bar:40} {pos}/{len} texts {msg}").expect("valid template"));
            let result = mlx_models::calibrate::calibrate_activation_amax_with(&dir, &texts, seq_len, |p| {
                bar.set_length(p.rows as u64);
                bar.set_position(p.row as u64 + 1);
                bar.set_message(format!("{} tokens", p.tokens));
            });
            bar.finish_and_clear();
            report(result, json, |s| {
                format!(
                    "{}: {} projections calibrated over {} texts ({} tokens, at most {seq_len} each), input_amax written to config.json, {:.1} s",
                    dir.display(),
                    s.projections,
                    s.rows,
                    s.tokens,
                    s.seconds
                )
            })
        }
        Command::Quantize { input, output, mode, bits, group_size, recipe, dtype, max_shard_size, json } => {
            let mode = match quant_mode(&mode, bits, group_size, recipe) {
                Ok(m) => m,
                Err(e) => {
                    eprintln!("error: {e}");
                    return ExitCode::from(2);
                }
            };
            let bar = tensor_bar();
            let opts = QuantizeOptions { mode, recipe, dtype, max_shard_bytes: max_shard_size };
            let result = quantize_dir(&input, &output, &opts, |p| show(&bar, p.index, p.total, p.tensor));
            bar.finish_and_clear();
            report(result, json, |s| {
                let recipe = s.recipe.map(|r| format!(", recipe {r:?}")).unwrap_or_default();
                format!(
                    "{} -> {}: {} layers quantized ({} {} bits, groups of {}{recipe}), {} tensors kept, {:.3} bits per weight, {:.1} MB in {} shard(s), {:.1} s",
                    input.display(),
                    s.output.display(),
                    s.quantized,
                    s.mode,
                    s.bits,
                    s.group_size,
                    s.kept,
                    s.bits_per_weight,
                    s.bytes_written as f64 / 1e6,
                    s.shards.len(),
                    s.seconds
                )
            })
        }
        Command::Gguf { input, output, dtype, config_from, json } => {
            let bar = tensor_bar();
            let opts = GgufToHfOptions { dtype, config_from };
            let result = gguf_to_hf(&input, &output, &opts, |p| show(&bar, p.index, p.total, p.tensor));
            bar.finish_and_clear();
            report(result, json, |s| {
                let mut line = format!(
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
                    line.push_str(&format!("\nthe GGUF has no chat template: wrote the built-in {} turn format", s.architecture));
                }
                line
            })
        }
    }
}
