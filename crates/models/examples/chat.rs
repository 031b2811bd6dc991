//! Interactive streaming chat.
//!
//! ```text
//! cargo run --release -p mlx-models --example chat                 # embedded random default
//! cargo run --release -p mlx-models --example chat -- --model DIR [--system TEXT] [--temperature 0.7]
//! echo "Hello" | cargo run --release -p mlx-models --example chat  # one turn per input line
//! ```
//! Without `--model` it runs on a random-weight Qwen3 that it creates on first use (in
//! `$MLX_MODELS_CACHE` or `~/.cache/mlx-models`): everything works end to end, but its text is
//! random. Commands: `/reset` clears the conversation, `/quit` (or end of input) exits.
#[path = "common/args.rs"]
mod args;
use mlx_models::chat::ChatMessage;
use mlx_models::{create_random_qwen3_checkpoint, load_session, tiny_qwen3_config, ChatConfig, LoadOptions, StreamEvent};
use sampling::SamplingOverrides;
use std::io::{BufRead, Write};
use std::path::PathBuf;

fn default_model() -> Result<PathBuf, Box<dyn std::error::Error>> {
    let root = std::env::var_os("MLX_MODELS_CACHE")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/mlx-models")))
        .ok_or("set MLX_MODELS_CACHE or HOME")?;
    let dir = root.join("random-qwen3-tiny");
    if !dir.join("config.json").exists() {
        eprintln!("creating a random-weight Qwen3 checkpoint in {} ...", dir.display());
        create_random_qwen3_checkpoint(&tiny_qwen3_config(), &dir, mlx_array::DType::BF16, 0)?;
    }
    eprintln!("No --model given: chatting with a RANDOM-WEIGHT Qwen3 ({}). Its replies are random text;", dir.display());
    eprintln!("pass --model DIR with a real checkpoint for real answers.");
    Ok(dir)
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let a = args::Args::parse(&["no-think", "stats"])?;
    let dir = match a.get("model") {
        Some(d) => PathBuf::from(d),
        None => default_model()?,
    };
    let mut session = load_session(&dir, &LoadOptions::default())?;
    let cfg = ChatConfig {
        max_new_tokens: a.num("max-new-tokens", 256usize)?,
        sampling: SamplingOverrides {
            temperature: a.get("temperature").map(|t| t.parse()).transpose()?,
            top_p: a.get("top-p").map(|t| t.parse()).transpose()?,
            seed: a.get("seed").map(|t| t.parse()).transpose()?,
            ..Default::default()
        },
        enable_thinking: a.flag("no-think").then_some(false),
        report_performance: true,
        ..Default::default()
    };
    let system = a.get("system").map(String::from);
    let stdin = std::io::stdin();
    let mut out = std::io::stdout();
    let mut started = false;
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
                eprintln!("(conversation cleared)");
                continue;
            }
            _ => {}
        }
        let stream = if started {
            session.continue_stream(vec![ChatMessage::user(line)], &cfg)?
        } else {
            let mut msgs: Vec<ChatMessage> = system.iter().map(ChatMessage::system).collect();
            msgs.push(ChatMessage::user(line));
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
                            "[{} | {} tokens, {} cached prompt tokens, ttft {:.0} ms, prefill {:.0} tok/s, decode {:.1} tok/s]",
                            r.finish_reason.as_str(), r.num_tokens, r.cached_tokens, p.ttft_ms, p.prefill_tokens_per_sec, p.decode_tokens_per_sec
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
