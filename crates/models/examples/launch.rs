//! Start N local processes of a program as the ranks of an MLX `ring` group on 127.0.0.1.
//!
//! ```text
//! cargo run --release -p mlx-models --example launch -- -n 2 generate -- --model DIR --prompt-ids 1,2,3 --temperature 0 --json
//! cargo run --release -p mlx-models --example launch -- -n 2 sft -- --model DIR --data F.jsonl --out OUT --json
//! cargo run --release -p mlx-models --example launch -- -n 2 grpo -- --model DIR --rollouts R.jsonl --out OUT --json
//! cargo run --release -p mlx-models --example launch -- -n 2 path/to/program -- ARGS
//! ```
//!
//! With `--backend ring` (the default) it writes a hostfile with one free port per rank (the
//! JSON `mlx.launch` writes) and starts the program N times with `MLX_RANK` and `MLX_HOSTFILE`
//! in its environment and `--distributed ring` appended to ARGS (the examples `generate`, `sft`
//! and `grpo` take that flag and join the group with `mlx_array::distributed::Group::init`). With
//! `--backend nccl` (CUDA builds; one GPU per rank) each rank gets what `mlx.launch` gives an
//! NCCL rank instead: `MLX_RANK`, `MLX_WORLD_SIZE`, `NCCL_HOST_IP=127.0.0.1`, `NCCL_PORT` (a
//! free port), `CUDA_VISIBLE_DEVICES=<rank>`, and `--distributed nccl`. `generate` (package
//! mlx-models), `sft` and `grpo` (mlx-training) are built first with the launcher's own profile when it
//! runs under `cargo run`; another program (one that takes `--distributed`) is a path.
//!
//! Rank 0's stdout and stderr pass through; the other ranks' output is kept and shown only if
//! one of them fails. When a rank fails the others are stopped (they would wait for it in a
//! collective), its captured stderr is printed and the launcher exits with status 1 (2 when it
//! cannot start the ranks).
use clap::Parser;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;

#[derive(Parser)]
#[command(about = "Run N ranks of a program over MLX's ring backend on this machine")]
struct Cli {
    /// Number of ranks (processes).
    #[arg(short = 'n', long = "ranks", value_parser = clap::value_parser!(u16).range(1..))]
    n: u16,
    /// MLX distributed backend the ranks join.
    #[arg(long, value_enum, default_value = "ring")]
    backend: Backend,
    /// `generate`, `sft`, `grpo`, or a path to a program that takes `--distributed ring|nccl`.
    program: String,
    /// The program's own arguments (after `--`).
    #[arg(last = true)]
    args: Vec<String>,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Backend {
    Ring,
    Nccl,
}

/// The examples the launcher knows: name -> package.
const KNOWN: &[(&str, &str)] = &[("generate", "mlx-models"), ("sft", "mlx-training"), ("grpo", "mlx-training")];

fn resolve(program: &str) -> Result<PathBuf, String> {
    let Some(&(name, package)) = KNOWN.iter().find(|(n, _)| *n == program) else {
        let p = PathBuf::from(program);
        return if p.is_file() { Ok(p) } else { Err(format!("{program}: not generate, sft or grpo, and no such file")) };
    };
    let me = std::env::current_exe().map_err(|e| format!("cannot find the launcher's own path: {e}"))?;
    let examples = me.parent().ok_or("the launcher has no directory")?;
    let profile_dir = examples.parent().ok_or("the launcher is not in a cargo target directory")?;
    if let Some(cargo) = std::env::var_os("CARGO") {
        // Under `cargo run`: build the example with the launcher's profile (a no-op when fresh).
        let mut cmd = Command::new(cargo);
        cmd.args(["build", "-q", "-p", package, "--example", name]);
        match profile_dir.file_name().and_then(|n| n.to_str()) {
            Some("release") => {
                cmd.arg("--release");
            }
            Some("debug") => {}
            Some(other) => {
                cmd.args(["--profile", other]);
            }
            None => {}
        }
        let st = cmd.stdout(Stdio::null()).status().map_err(|e| format!("cargo build of {name}: {e}"))?;
        if !st.success() {
            return Err(format!("cargo build -p {package} --example {name} failed ({st})"));
        }
    }
    let exe = examples.join(name);
    if !exe.is_file() {
        return Err(format!("{} does not exist: build it with cargo build -p {package} --example {name}", exe.display()));
    }
    Ok(exe)
}

/// Read a child's pipe to the end on a thread.
fn collect(mut r: impl Read + Send + 'static) -> std::thread::JoinHandle<Vec<u8>> {
    std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = r.read_to_end(&mut v);
        v
    })
}

struct Rank {
    child: Child,
    stdout: Option<std::thread::JoinHandle<Vec<u8>>>,
    stderr: Option<std::thread::JoinHandle<Vec<u8>>>,
    status: Option<ExitStatus>,
}

/// How the ranks find each other.
enum Rendezvous {
    Ring { hostfile: PathBuf },
    Nccl { port: u16, world: usize },
}

fn spawn(exe: &Path, args: &[String], how: &Rendezvous, rank: usize) -> Result<Rank, String> {
    let mut cmd = Command::new(exe);
    cmd.args(args).env("MLX_RANK", rank.to_string());
    match how {
        Rendezvous::Ring { hostfile } => {
            cmd.args(["--distributed", "ring"]).env("MLX_HOSTFILE", hostfile);
        }
        Rendezvous::Nccl { port, world } => {
            cmd.args(["--distributed", "nccl"])
                .env("MLX_WORLD_SIZE", world.to_string())
                .env("NCCL_HOST_IP", "127.0.0.1")
                .env("NCCL_PORT", port.to_string())
                .env("CUDA_VISIBLE_DEVICES", rank.to_string());
        }
    }
    if rank != 0 {
        cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    }
    let mut child = cmd.spawn().map_err(|e| format!("cannot start {}: {e}", exe.display()))?;
    let stdout = child.stdout.take().map(collect);
    let stderr = child.stderr.take().map(collect);
    Ok(Rank { child, stdout, stderr, status: None })
}

fn run() -> Result<i32, String> {
    let cli = Cli::parse();
    let exe = resolve(&cli.program)?;
    let n = cli.n as usize;
    let dir = tempfile::tempdir().map_err(|e| format!("temporary directory: {e}"))?;
    let how = match cli.backend {
        Backend::Ring => {
            let hostfile = dir.path().join("hostfile.json");
            let hosts = mlx_array::distributed::local_ring_hostfile(n).map_err(|e| e.to_string())?;
            std::fs::write(&hostfile, hosts).map_err(|e| format!("{}: {e}", hostfile.display()))?;
            Rendezvous::Ring { hostfile }
        }
        Backend::Nccl => {
            let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| format!("a free port: {e}"))?;
            let port = l.local_addr().map_err(|e| format!("a free port: {e}"))?.port();
            Rendezvous::Nccl { port, world: n }
        }
    };
    let mut ranks = Vec::with_capacity(n);
    for r in 0..n {
        match spawn(&exe, &cli.args, &how, r) {
            Ok(rank) => ranks.push(rank),
            Err(e) => {
                for k in ranks.iter_mut() {
                    let _ = k.child.kill();
                }
                return Err(e);
            }
        }
    }
    let mut failed: Option<usize> = None;
    while ranks.iter().any(|k| k.status.is_none()) {
        for (r, k) in ranks.iter_mut().enumerate() {
            if k.status.is_none() {
                if let Some(st) = k.child.try_wait().map_err(|e| format!("rank {r}: {e}"))? {
                    k.status = Some(st);
                    if !st.success() && failed.is_none() {
                        failed = Some(r);
                    }
                }
            }
        }
        if failed.is_some() {
            // The others would wait for the failed rank in their next collective.
            for k in ranks.iter_mut().filter(|k| k.status.is_none()) {
                let _ = k.child.kill();
                k.status = k.child.wait().ok();
            }
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let Some(f) = failed else { return Ok(0) };
    let k = &mut ranks[f];
    let status = k.status.map(|s| s.to_string()).unwrap_or_default();
    eprintln!("launch: rank {f} of {n} failed ({status})");
    if let Some(h) = k.stderr.take() {
        let err = h.join().unwrap_or_default();
        eprint!("{}", String::from_utf8_lossy(&err));
    }
    if let Some(h) = k.stdout.take() {
        let out = h.join().unwrap_or_default();
        if !out.is_empty() {
            eprintln!("launch: rank {f}'s stdout:\n{}", String::from_utf8_lossy(&out));
        }
    }
    Ok(1)
}

fn main() {
    match run() {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("launch: {e}");
            std::process::exit(2);
        }
    }
}
