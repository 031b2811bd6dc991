//! Generate from a checkpoint.
//!
//! ```text
//! cargo run --release -p mlx-models --example generate -- --model DIR --prompt-ids 1,2,3 \
//!     --max-new-tokens 16 --temperature 0 --json
//! cargo run --release -p mlx-models --example generate -- --model DIR --prompt "Hello" [--chat]
//! cargo run --release -p mlx-models --example generate -- --model VLM_DIR --chat --prompt "Describe it." --image PATH
//! ```
//! With `--json` the last stdout line is one JSON object; `token_ids` lists the new token ids.
//! `--draft-model DIR [--draft-tokens K]` decodes speculatively (mlx-speculative; the draft's
//! kind is read from its config.json), `--mtp [--mtp-depth D]` with the model's own MTP head
//! (Qwen3.5; a fixed depth when given, else adaptive up to 5), and the JSON object gains `"speculative": {"cycles",
//! "accepted_mean", "tokens_per_cycle", "acceptance_by_position", "depth_mean"}` (`accepted_mean`:
//! accepted draft tokens per cycle, the target's own token not counted; `tokens_per_cycle`: with
//! it). On a GPU the decoder first warms up
//! (`--speculative-warm-up`).
//!
//! `--distributed ring` (what the `launch` example passes) runs it as one rank of a
//! tensor-parallel group: the model is sharded over the ranks, and only rank 0 prints (the same
//! output as one process, then a stderr line with the KiB each rank holds after the load).
use clap::Parser;
use mlx_models::chat::{ChatFormat, ChatMessage, RenderOptions, Tokenizer};
use mlx_models::media::ImageInput;
use mlx_models::{generate, load_model, GenerateConfig, KvCacheMode, LoadOptions, PagedConfig, QuantizedWeights};
use mlx_array::distributed::{Backend, Group};
use mlx_array::ops::CudaFewRowKernels;
use mlx_array::{memory, Array};
use sampling::SamplingConfig;
use std::io::Write;
use std::path::PathBuf;

#[derive(Clone, Copy, clap::ValueEnum)]
enum DraftDepth {
    Fixed,
    Adaptive,
}

/// When a speculative decoder warms up before the generation (`SpeculativeDecoder::warm_up`).
#[derive(Clone, Copy, PartialEq, clap::ValueEnum)]
enum WarmUp {
    /// On a GPU, where the first use of each verify shape costs (cuBLAS algorithm selection,
    /// CUDA graphs, kernel compilation); not on the CPU, where it costs only the cycles.
    Auto,
    On,
    Off,
}

#[derive(Parser)]
#[command(about = "Generate from a checkpoint")]
#[command(group(clap::ArgGroup::new("speculation").args(["draft_model", "mtp"])))]
struct Cli {
    #[arg(long)]
    model: PathBuf,
    /// Comma-separated prompt token ids.
    #[arg(long, value_delimiter = ',', conflicts_with = "prompt")]
    prompt_ids: Option<Vec<u32>>,
    /// Prompt text (tokenized with the checkpoint's tokenizer).
    #[arg(long)]
    prompt: Option<String>,
    /// Wrap --prompt as a user message in the chat template.
    #[arg(long, requires = "prompt")]
    chat: bool,
    /// An image file attached to the --chat message (repeatable; vision-language models). The
    /// prompt is prefilled in one call with the tower's output at the image tokens.
    #[arg(long, requires = "chat")]
    image: Vec<PathBuf>,
    #[arg(long, default_value_t = 64)]
    max_new_tokens: usize,
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    #[arg(long, default_value_t = 0)]
    top_k: u32,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Print one JSON object as the last stdout line.
    #[arg(long)]
    json: bool,
    /// Quantized checkpoints: keep the packed weights, dequantize them at load, or auto (the
    /// library's default: keep them on the GPU, and on the CPU where its packed kernels take every
    /// quantized layer; else dequantize; a --draft-model on a GPU is dequantized).
    #[arg(long, value_enum, default_value = "auto")]
    quantized: Quantized,
    /// KV cache: the family's default (auto), flat, or the paged block pool.
    #[arg(long, value_enum, default_value = "auto")]
    kv: Kv,
    /// Decode speculatively with this draft checkpoint (a causal LM sharing the vocabulary, a
    /// `gemma4_assistant` draft for a Gemma 4 model, or a DSpark / DFlash block draft).
    #[arg(long)]
    draft_model: Option<PathBuf>,
    /// Draft tokens per cycle (default: the drafter's; 3 for a draft model and an assistant,
    /// whose depth is clamped to 1..=8; a DSpark block's size, 7 in v1; a DFlash block's size
    /// less its anchor, 15 for `block_size` 16; block drafts are clamped to their block).
    #[arg(long, requires = "draft_model", value_parser = clap::value_parser!(u64).range(1..=64))]
    draft_tokens: Option<u64>,
    /// How the draft-model depth is chosen: every cycle the same (`fixed`), or each cycle by
    /// the adaptive policy up to that many, down to plain decoding (`adaptive`).
    #[arg(long, value_enum, requires = "draft_model", default_value = "fixed")]
    draft_depth: DraftDepth,
    /// Decode speculatively with the model's multi-token-prediction head (Qwen3.5 checkpoints
    /// with MTP weights).
    #[arg(long, conflicts_with = "draft_model")]
    mtp: bool,
    /// Run a speculative cycle at every depth the decoder may draft on a throwaway cache
    /// before the generation (its time goes to stderr), so that one-time costs of new shapes
    /// fall outside it: auto (on a GPU), on or off.
    #[arg(long, value_enum, default_value = "auto", requires = "speculation")]
    speculative_warm_up: WarmUp,
    /// Cycles the warm-up runs at the deepest depth after a short prompt, one after another as
    /// in a generation (`SpeculativeDecoder::with_warm_up_cycles`; default the library's,
    /// `SpeculativeDecoder::WARM_UP_CYCLES`).
    #[arg(long, requires = "speculation", value_parser = clap::value_parser!(u32).range(1..))]
    speculative_warm_up_cycles: Option<u32>,
    /// Draft-model forwards run ahead while the target verifies, at temperature 0
    /// (`SpeculativeDecoder::with_draft_ahead`): a number, `until-verified` (until the
    /// verify's result is ready, at most the depth + 1) or `background` (the draft model on a
    /// thread of its own, drafting from each proposal until the next, at most the depth + 1,
    /// while this thread builds the verify forward); default: background on a GPU, 0 on the
    /// CPU.
    /// Anything but 0 is refused for other draft kinds. At temperature > 0 nothing is drafted
    /// ahead: `background` still moves the draft model to its own thread (its catch-ups during
    /// adaptive depth's plain stretches, and their agreement, run there, as on a GPU by
    /// default), and a number or `until-verified` is refused.
    #[arg(long, requires = "draft_model")]
    draft_ahead: Option<mlx_speculative::DraftAhead>,
    /// MTP drafts per cycle (default: adaptive, up to 5).
    #[arg(long, requires = "mtp", value_parser = clap::value_parser!(u64).range(1..=5))]
    mtp_depth: Option<u64>,
    /// On a CUDA GPU, which of products of 2-8 rows and attention of 2-16 queries (verify
    /// steps, short prompts) run our kernels instead of MLX's ops
    /// (`mlx_array::ops::CudaFewRowKernels`): off, products, attention or on.
    #[arg(long, default_value = "off")]
    cuda_few_row_kernels: CudaFewRowKernels,
    /// Projections of one input (q/k/v, gate/up) as one product over joined weights
    /// (`LoadOptions::fuse_projections`), for the model and a plain --draft-model (assistant
    /// and block drafts load their own layers, joined on a GPU): auto (on a GPU only), on or off.
    #[arg(long, value_enum, default_value = "auto")]
    fuse_projections: Fuse,
    /// On a GPU, pad the keys of attention over 2-64 queries (verify steps, a draft's catching
    /// up) to a multiple of this many, the padding masked out, so that a growing cache changes
    /// the products' shapes once a bucket (`mlx_array::ops::set_gpu_attention_key_bucket`; 0: no
    /// padding). Attention that --cuda-few-row-kernels gives our kernel is not padded.
    #[arg(long, default_value_t = 0)]
    key_bucket: usize,
    /// Join an MLX distributed group over this backend (started by the `launch` example, or
    /// by `mlx.launch`) and run tensor parallel over its ranks.
    #[arg(long, value_enum)]
    distributed: Option<Distributed>,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum Distributed {
    Ring,
    Mpi,
    Nccl,
    Any,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum Kv {
    Auto,
    Flat,
    Paged,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum Fuse {
    Auto,
    On,
    Off,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum Quantized {
    Auto,
    Keep,
    Dequantize,
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let cli = Cli::parse();
    mlx_array::ops::set_cuda_few_row_kernels(cli.cuda_few_row_kernels);
    mlx_array::ops::set_gpu_attention_key_bucket(cli.key_bucket);
    if let Some(w) = mlx_array::libmlx::gpu_warning() {
        eprintln!("{w}");
    }
    let dir = &cli.model;
    let quantized = match cli.quantized {
        Quantized::Auto => QuantizedWeights::Auto,
        Quantized::Keep => QuantizedWeights::Keep,
        Quantized::Dequantize => QuantizedWeights::Dequantize,
    };
    let kv_cache = match cli.kv {
        Kv::Auto => KvCacheMode::Auto,
        Kv::Flat => KvCacheMode::Flat,
        Kv::Paged => KvCacheMode::Paged(PagedConfig::default()),
    };
    let group = match cli.distributed {
        Some(d) => Some(Group::init(match d {
            Distributed::Ring => Backend::Ring,
            Distributed::Mpi => Backend::Mpi,
            Distributed::Nccl => Backend::Nccl,
            Distributed::Any => Backend::Any,
        })?),
        None => None,
    };
    let before = memory::active()?;
    let fuse_projections = match cli.fuse_projections {
        Fuse::Auto => None,
        Fuse::On => Some(true),
        Fuse::Off => Some(false),
    };
    let opts = LoadOptions { quantized, kv_cache, fuse_projections, tensor_parallel: group.clone(), ..Default::default() };
    let model = load_model(dir, &opts)?.into_lm()?;
    // What each rank holds after the load (MLX's active memory: the weights, and a paged
    // cache's first pool blocks), in KiB.
    let kib = ((memory::active()?.saturating_sub(before)) / 1024) as u32;
    let per_rank = match &group {
        Some(g) => g.all_gather(&Array::from_slice(&[kib], &[1])?)?.to_vec::<u32>()?,
        None => vec![kib],
    };
    // Only rank 0 prints.
    let quiet = group.as_ref().is_some_and(|g| g.rank() != 0);
    if group.is_some() && (cli.draft_model.is_some() || cli.mtp) {
        return Err("speculative decoding (--draft-model, --mtp) does not run tensor parallel (--distributed)".into());
    }
    let mut spec = match (&cli.draft_model, cli.mtp) {
        (Some(d), _) => {
            let ahead = cli.draft_ahead.is_some_and(|a| !matches!(a, mlx_speculative::DraftAhead::Steps(0) | mlx_speculative::DraftAhead::Background));
            if ahead && cli.temperature > 0.0 {
                return Err("--draft-ahead drafts ahead at --temperature 0 only (`background` is taken at any temperature)".into());
            }
            let drafter = mlx_speculative::load_drafter_for(d, &opts, &model)?;
            let k = cli.draft_tokens.map(|k| k as usize);
            let s = match cli.draft_depth {
                DraftDepth::Fixed => mlx_speculative::SpeculativeDecoder::new(drafter, k),
                DraftDepth::Adaptive => mlx_speculative::SpeculativeDecoder::adaptive(drafter, k),
            };
            Some(match cli.draft_ahead {
                Some(n) => s.with_draft_ahead(n)?,
                None => s,
            })
        }
        (None, true) => {
            let d = Box::new(mlx_speculative::MtpDrafter::new(model.clone())?);
            Some(match cli.mtp_depth {
                Some(k) => mlx_speculative::SpeculativeDecoder::new(d, Some(k as usize)),
                None => mlx_speculative::SpeculativeDecoder::adaptive(d, Some(5)),
            })
        }
        (None, false) => None,
    };
    if let Some(n) = cli.speculative_warm_up_cycles {
        spec = spec.map(|s| s.with_warm_up_cycles(n as usize));
    }
    if let Some(s) = spec.as_mut() {
        let gpu = mlx_array::default_device()? != mlx_array::Device::Cpu;
        let warm = cli.speculative_warm_up == WarmUp::On || (cli.speculative_warm_up == WarmUp::Auto && gpu);
        if !warm && cli.speculative_warm_up_cycles.is_some() {
            return Err("--speculative-warm-up-cycles needs a warm-up (--speculative-warm-up on, or auto on a GPU)".into());
        }
        if warm {
            let t = std::time::Instant::now();
            s.warm_up(&model)?;
            if !quiet {
                eprintln!("speculative warm-up: {:.0} ms", t.elapsed().as_secs_f64() * 1e3);
            }
        }
    }
    // The chat template only for --chat; a plain --prompt needs just the tokenizer.
    let format = if cli.chat { Some(ChatFormat::from_dir(dir)?) } else { None };
    let tokenizer = match (&format, cli.prompt.is_some()) {
        (Some(f), _) => Some(f.tokenizer().clone()),
        (None, true) => Some(Tokenizer::from_dir(dir)?),
        (None, false) => None,
    };
    let mut media = Vec::new();
    let prompt: Vec<u32> = match (cli.prompt_ids.clone(), cli.prompt.as_deref(), &format, &tokenizer) {
        (Some(ids), _, _, _) => ids,
        (None, Some(text), Some(f), _) if !cli.image.is_empty() => {
            if spec.is_some() {
                return Err("speculative decoding (--draft-model, --mtp) is off for prompts with images".into());
            }
            let msg = cli.image.iter().fold(ChatMessage::user(text), |m, p| m.with_image(ImageInput::path(p)));
            let rendered = f.render(std::slice::from_ref(&msg), &RenderOptions::default())?.ids;
            let (ids, prepared) = model.with_runtime(|rt| -> Result<_, Box<dyn std::error::Error>> {
                let m = rt.media().ok_or_else(|| format!("{} takes no images", rt.info().model_type))?;
                let prepared = msg.media().map(|i| m.prepare(&i)).collect::<Result<Vec<_>, _>>()?;
                Ok((m.expand(&rendered, &prepared)?, prepared))
            })?;
            media = prepared;
            ids
        }
        (None, Some(text), Some(f), _) => f.render(&[ChatMessage::user(text)], &RenderOptions::default())?.ids,
        (None, Some(text), None, Some(t)) => t.encode(text, true)?,
        _ => return Err("give --prompt-ids or --prompt (--chat needs --prompt)".into()),
    };
    let mut sampling = SamplingConfig::default().with_seed(cli.seed);
    sampling.temperature = cli.temperature;
    sampling.top_p = cli.top_p;
    sampling.top_k = cli.top_k;
    let mut cfg = GenerateConfig { max_new_tokens: cli.max_new_tokens, sampling, ..Default::default() };
    let mut stop = model.info().eos_token_ids.clone();
    match (&format, &tokenizer) {
        (Some(f), _) => stop.extend(f.stop_token_ids()),
        (None, Some(t)) => stop.extend(t.eos_token_ids()),
        (None, None) => {}
    }
    if format.is_some() || tokenizer.is_some() {
        cfg.stop_tokens = Some(stop);
    }
    let mut cache = model.new_cache();
    let mut gen = generate(&model, &mut cache, &prompt, cfg)?.with_media(media);
    if let Some(s) = spec.as_mut() {
        gen = gen.with_speculator(s);
    }
    let mut ids = Vec::new();
    let mut decoder = tokenizer.as_ref().map(|t| t.stream_decoder(true));
    let out = std::io::stdout();
    for t in gen.by_ref() {
        let t = t?;
        ids.push(t.id);
        if let (Some(d), false, false) = (decoder.as_mut(), cli.json, quiet) {
            if let Some(s) = d.step(t.id)? {
                print!("{s}");
                out.lock().flush()?;
            }
        }
    }
    let reason = gen.finish_reason().map(|r| r.as_str()).unwrap_or("stop");
    let perf = gen.performance();
    if quiet {
        return Ok(());
    }
    if let Some(g) = &group {
        let total: u64 = per_rank.iter().map(|&k| k as u64).sum();
        eprintln!("tensor parallel over {} ranks: KiB resident after load per rank {per_rank:?} (sum {total})", g.size());
    }
    if cli.json {
        let text = match &tokenizer {
            Some(t) => Some(t.decode(&ids, true)?),
            None => None,
        };
        let mut line = serde_json::json!({ "prompt_token_ids": prompt, "token_ids": ids, "finish_reason": reason, "text": text, "performance": perf });
        if let Some(s) = &perf.speculative {
            line["speculative"] = serde_json::to_value(s)?;
        }
        println!("{line}");
    } else if decoder.is_none() {
        println!("{}", ids.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(","));
    } else {
        println!();
    }
    if !cli.json {
        eprintln!("[{reason}] {} tokens, prefill {:.1} tok/s, decode {:.1} tok/s", ids.len(), perf.prefill_tokens_per_sec, perf.decode_tokens_per_sec);
        if let Some(s) = &perf.speculative {
            eprintln!("speculative: {} cycles, {:.2} drafts accepted per cycle of {:.2} ({:.2} tokens a cycle), by position {:?}", s.cycles, s.accepted_mean, s.depth_mean, s.tokens_per_cycle, s.acceptance_by_position);
        }
    }
    Ok(())
}

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
