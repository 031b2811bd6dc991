//! Shared by the `sft` and `grpo` examples: the optimizer, LoRA and save-dtype flags, the
//! checkpoint a run starts from, the progress bar and the JSON lines.
#![allow(dead_code)] // each example uses a part
use clap::ValueEnum;
use indicatif::{ProgressBar, ProgressStyle};
use mlx_array::DType;
use mlx_training::lora::{self, LoraConfig};
use mlx_training::{AdamWConfig, OptimizerConfig, SgdConfig};
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};

pub type CliResult<T> = Result<T, Box<dyn std::error::Error>>;

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum Opt {
    Adamw,
    Sgd,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum SaveDtype {
    F32,
    Bf16,
    F16,
}

impl SaveDtype {
    pub fn dtype(self) -> DType {
        match self {
            SaveDtype::F32 => DType::F32,
            SaveDtype::Bf16 => DType::BF16,
            SaveDtype::F16 => DType::F16,
        }
    }
}

/// The optimizer flags.
#[derive(clap::Args, Debug)]
pub struct OptimizerArgs {
    #[arg(long, value_enum, default_value_t = Opt::Adamw)]
    pub optimizer: Opt,
    /// Weight decay (AdamW: decoupled, default 0.01; SGD: L2 on the gradient, default 0).
    #[arg(long)]
    pub weight_decay: Option<f64>,
    /// SGD momentum (0 = none).
    #[arg(long, default_value_t = 0.0)]
    pub momentum: f64,
    /// Clip the global gradient norm (0 = off).
    #[arg(long, default_value_t = 1.0)]
    pub max_grad_norm: f64,
    /// On the CPU, compile chains of elementwise ops (the AdamW update, SwiGLU) into one kernel
    /// each (`mlx_array::ops::CpuFusion`; needs g++ on the PATH); off runs the same ops one by one.
    #[arg(long, default_value = "off", value_parser = ["on", "off"])]
    pub cpu_fusion: String,
}

impl OptimizerArgs {
    /// Apply `--cpu-fusion` (process-wide).
    pub fn apply_cpu_fusion(&self) {
        mlx_array::ops::set_cpu_fusion(if self.cpu_fusion == "on" { mlx_array::ops::CpuFusion::On } else { mlx_array::ops::CpuFusion::Off });
    }

    pub fn config(&self) -> CliResult<OptimizerConfig> {
        Ok(match self.optimizer {
            Opt::Adamw => {
                if self.momentum != 0.0 {
                    return Err("--momentum applies to --optimizer sgd".into());
                }
                OptimizerConfig::AdamW(AdamWConfig {
                    weight_decay: self.weight_decay.unwrap_or(0.01),
                    ..Default::default()
                })
            }
            Opt::Sgd => OptimizerConfig::Sgd(SgdConfig {
                momentum: self.momentum,
                weight_decay: self.weight_decay.unwrap_or(0.0),
                ..Default::default()
            }),
        })
    }

    /// `--max-grad-norm` as the clipping norm (`None`: off).
    pub fn max_norm(&self) -> Option<f64> {
        (self.max_grad_norm > 0.0).then_some(self.max_grad_norm)
    }
}

/// The LoRA flags: adapters of rank `--lora-rank` instead of the model's weights.
#[derive(clap::Args, Debug)]
pub struct LoraArgs {
    /// Train LoRA adapters of this rank instead of the model's weights.
    #[arg(long)]
    pub lora_rank: Option<usize>,
    /// Multiplier of the adapters' product (mlx-lm's scale; default 20).
    #[arg(long, requires = "lora_rank", conflicts_with = "lora_alpha")]
    pub lora_scale: Option<f32>,
    /// PEFT's alpha: the scale is alpha / rank.
    #[arg(long, requires = "lora_rank")]
    pub lora_alpha: Option<f32>,
    #[arg(long, requires = "lora_rank")]
    pub lora_dropout: Option<f32>,
    /// Adapt the last N decoder layers (-1: all; default 16, as mlx-lm).
    #[arg(long, requires = "lora_rank", allow_hyphen_values = true)]
    pub lora_layers: Option<i64>,
    /// Projections to adapt, by path inside a layer (self_attn.q_proj,mlp.down_proj) or full
    /// name (lm_head); default: every linear projection of the layer.
    #[arg(long, requires = "lora_rank", value_delimiter = ',')]
    pub lora_targets: Vec<String>,
}

impl LoraArgs {
    /// The LoRA config the flags ask for (`None` without `--lora-rank`); `seed` seeds the
    /// adapters' initial draws.
    pub fn config(&self, seed: u64) -> Option<LoraConfig> {
        let rank = self.lora_rank?;
        let d = LoraConfig::default();
        let scale = match (self.lora_scale, self.lora_alpha) {
            (Some(s), _) => s,
            (None, Some(a)) => a / rank as f32,
            (None, None) => d.scale,
        };
        Some(LoraConfig {
            rank,
            scale,
            dropout: self.lora_dropout.unwrap_or(d.dropout),
            num_layers: self.lora_layers.unwrap_or(d.num_layers),
            keys: (!self.lora_targets.is_empty()).then(|| self.lora_targets.clone()),
            seed,
        })
    }
}

/// Where a run starts.
pub struct Start {
    /// `--resume`'s checkpoint, resolved.
    pub resumed: Option<PathBuf>,
    /// The checkpoint holds LoRA adapters (no model).
    pub lora_checkpoint: bool,
    /// The model directory: `--model`; when resuming, the checkpoint, or for a LoRA checkpoint
    /// its base model (`--model`, else adapter_config.json's "model").
    pub model: PathBuf,
}

pub fn start(resume: Option<&Path>, model: Option<&Path>, lora: &LoraArgs) -> CliResult<Start> {
    let resumed = resume
        .map(mlx_training::state::resolve_checkpoint)
        .transpose()?;
    let lora_checkpoint = resumed
        .as_ref()
        .is_some_and(|r| r.join(lora::ADAPTERS_FILE).is_file());
    let model = match (&resumed, model) {
        (Some(_), Some(m)) if lora_checkpoint => m.to_path_buf(),
        (Some(r), None) if lora_checkpoint => {
            let cfg: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(r.join(lora::ADAPTER_CONFIG_FILE))?)?;
            cfg.get("model")
                .and_then(|m| m.as_str())
                .map(PathBuf::from)
                .ok_or("the LoRA checkpoint names no base model: pass --model")?
        }
        (Some(_), Some(_)) => {
            return Err(
                "--model applies with --resume only to a LoRA checkpoint (its base model)".into(),
            )
        }
        (Some(r), None) => r.clone(),
        (None, Some(m)) => m.to_path_buf(),
        (None, None) => return Err("--model or --resume is required".into()),
    };
    if resumed.is_some() && lora.lora_rank.is_some() {
        return Err("--lora-* settings are taken from the checkpoint when resuming".into());
    }
    Ok(Start {
        resumed,
        lora_checkpoint,
        model,
    })
}

/// A progress bar of `len` steps at `pos` on a terminal (stderr), unless `quiet`.
pub fn progress_bar(quiet: bool, len: u64, pos: u64) -> Option<ProgressBar> {
    (!quiet && std::io::stderr().is_terminal()).then(|| {
        let b = ProgressBar::new(len);
        b.set_style(
            ProgressStyle::with_template("{bar:30} {pos}/{len} {msg} ETA {eta}")
                .expect("valid template"),
        );
        b.set_position(pos);
        b
    })
}

/// One JSON object on its own line, flushed.
pub fn json_line(out: &mut impl Write, value: &impl serde::Serialize) -> CliResult<()> {
    serde_json::to_writer(&mut *out, value)?;
    writeln!(out)?;
    out.flush()?;
    Ok(())
}
