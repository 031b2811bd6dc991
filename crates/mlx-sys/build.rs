//! Build of `mlx-sys` 0.7.0 for Linux (CPU, and CUDA by swapping libmlx at run time) and macOS.
//!
//! Nothing third-party lives in this repository. At build time this script
//! 1. finds MLX: `MLX_DIR` (a directory with `include/mlx/` and `lib/libmlx.*`, i.e. an unpacked MLX
//!    wheel's `mlx/` folder) or else downloads the PyPI wheel `mlx-cpu==0.32.2` (`mlx-metal` on macOS)
//!    with `python3 -m pip download` into `$MLX_CACHE` (default `~/.cache/mlx-sys`);
//! 2. obtains mlx-c from the crates.io package `mlx-sys` 0.7.0 (which carries `src/mlx-c`) with cargo
//!    itself (`cargo fetch` on a generated manifest, under its own `CARGO_HOME` in the cache so it never
//!    waits on the outer build's package lock), or from `MLXC_DIR` if set, and patches that cached copy
//!    so it builds with g++ 12 on x86_64 (see [`patch_mlxc`]);
//! 3. compiles mlx-c into a static `libmlxc.a` with the `cc` crate (cached by content key, so a clean
//!    checkout on the same machine does not recompile it) and links it with `-lmlx`;
//! 4. compiles our CPU kernels (`src/cpukern/`: an MLX primitive for products over bf16 and
//!    MLX-quantized weights, with AVX-512, AVX2 and portable copies chosen at run time) against
//!    the wheel's headers and mlx-c's private headers into `libmlxmkern.a`, cached the same way.
//!
//! `MLX_BLAS=openblas|openblas-plain|bundled` (Linux): the CPU wheel bundles netlib reference BLAS
//! (~7 GFLOP/s sgemm). When Debian's `libopenblas0-pthread` is installed (default `openblas` then)
//! the bundled names in the cached wheel are pointed at OpenBLAS (~100 GFLOP/s on 2 cores). With
//! `openblas` the BLAS name is our `src/blas_route.c` in front of OpenBLAS: single-row and
//! single-column float32 products (every decode-step projection) go to `cblas_sgemv` instead of
//! OpenBLAS's `cblas_sgemm`, which packs the whole weight for them (2x faster CPU decode, see
//! BENCHMARKS.md). `openblas-plain` is OpenBLAS alone (for A/B runs); `bundled` restores netlib.
use std::{
    env, fs,
    hash::Hasher,
    path::{Path, PathBuf},
    process::Command,
};

const MLX_VERSION: &str = "0.32.2"; // the MLX tag mlx-c 0.7.0 was written for
const MLXC_CRATE_VERSION: &str = "0.7.0";
const OPENBLAS_DIR: &str = "/usr/lib/x86_64-linux-gnu/openblas-pthread";

type Res<T> = Result<T, String>;

fn main() {
    for v in ["MLX_DIR", "MLX_CACHE", "MLX_BLAS", "MLXC_DIR", "CXX", "CXXFLAGS"] {
        println!("cargo:rerun-if-env-changed={v}");
    }
    println!("cargo:rerun-if-changed=build.rs");
    if let Err(e) = run() {
        // A build script's panic message is what the user sees: make it the whole story.
        panic!("\n\nmlx-sys build failed: {e}\n\n");
    }
}

fn run() -> Res<()> {
    let apple = env::var("CARGO_CFG_TARGET_VENDOR").as_deref() == Ok("apple");
    let cache = cache_root()?;
    let mut blas_kind = if apple { "accelerate" } else { "external" };
    let mlx_dir = match env::var_os("MLX_DIR") {
        Some(d) => PathBuf::from(d),
        None => {
            let wheel = if apple { "mlx-metal" } else { "mlx-cpu" };
            let root = cache.join(format!("{wheel}-{MLX_VERSION}"));
            let lib = if apple { "libmlx.dylib" } else { "libmlx.so" };
            if !root.join("mlx/lib").join(lib).exists() {
                fetch_wheel(wheel, &root)?;
            }
            if !apple {
                let have = Path::new(OPENBLAS_DIR).join("libblas.so.3").exists();
                let mode = match env::var("MLX_BLAS").as_deref() {
                    Ok("openblas") => Blas::Routed,
                    Ok("openblas-plain") => Blas::OpenBlas,
                    Ok("bundled") => Blas::Bundled,
                    Ok(other) => return Err(format!("MLX_BLAS={other:?}: expected openblas, openblas-plain or bundled")),
                    Err(_) if have => Blas::Routed,
                    Err(_) => Blas::Bundled,
                };
                if mode != Blas::Bundled && !have {
                    return Err(format!("MLX_BLAS asks for OpenBLAS but {OPENBLAS_DIR}/libblas.so.3 is missing (apt install libopenblas0-pthread)"));
                }
                select_blas(&root, mode)?;
                blas_kind = match mode {
                    Blas::Routed => "openblas-routed",
                    Blas::OpenBlas => "openblas",
                    Blas::Bundled => "bundled",
                };
            }
            root.join("mlx")
        }
    };
    let inc = mlx_dir.join("include");
    let lib = mlx_dir.join("lib");
    if !inc.join("mlx/mlx.h").exists() {
        return Err(format!("no include/mlx/mlx.h under MLX dir {}", mlx_dir.display()));
    }

    let mlxc = match env::var_os("MLXC_DIR") {
        Some(d) => PathBuf::from(d),
        None => mlxc_sources(&cache)?,
    };
    // Before mlx-c on the link line: the kernels' entry point reports errors through mlx-c.
    compile_kernels(&mlxc, &inc, &cache)?;
    compile_mlxc(&mlxc, &inc, &cache)?;

    // Link-search through a symlink inside OUT_DIR: cargo puts link-search dirs that lie inside
    // target/ on the dynamic loader path for `cargo run` / `cargo test`, so no rpath is needed there.
    let out = PathBuf::from(env::var("OUT_DIR").unwrap());
    let link = out.join("mlxdist");
    let _ = fs::remove_file(&link);
    std::os::unix::fs::symlink(&lib, &link).map_err(|e| format!("symlink {}: {e}", link.display()))?;
    println!("cargo:rustc-link-search=native={}", link.display());
    println!("cargo:rustc-link-lib=dylib=mlx");
    println!("cargo:rustc-env=MLX_SYS_BLAS={blas_kind}");
    // For dependents' build.rs (DEP_MLX_INCLUDE / DEP_MLX_LIBDIR), e.g. to give a binary an rpath.
    println!("cargo:include={}", inc.display());
    println!("cargo:libdir={}", lib.display());
    Ok(())
}

fn cache_root() -> Res<PathBuf> {
    let p = match env::var_os("MLX_CACHE") {
        Some(p) => PathBuf::from(p),
        None => match env::var_os("XDG_CACHE_HOME") {
            Some(x) => PathBuf::from(x).join("mlx-sys"),
            None => PathBuf::from(env::var_os("HOME").ok_or("neither MLX_CACHE nor HOME is set")?)
                .join(".cache/mlx-sys"),
        },
    };
    fs::create_dir_all(&p).map_err(|e| format!("create cache {}: {e}", p.display()))?;
    Ok(p)
}

fn sh(cmd: &mut Command) -> Res<()> {
    let dbg = format!("{cmd:?}");
    let st = cmd.status().map_err(|e| format!("cannot run {dbg}: {e}"))?;
    if st.success() { Ok(()) } else { Err(format!("{dbg} exited with {st}")) }
}

/// Fresh temporary sibling of `dest`, renamed onto `dest` once complete (a crash leaves no half copy).
fn tmp_for(dest: &Path) -> Res<PathBuf> {
    let mut name = dest.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".tmp{}", std::process::id()));
    let tmp = dest.with_file_name(name);
    let _ = fs::remove_dir_all(&tmp);
    fs::create_dir_all(&tmp).map_err(|e| format!("create {}: {e}", tmp.display()))?;
    Ok(tmp)
}

fn commit_dir(tmp: &Path, dest: &Path) -> Res<()> {
    match fs::rename(tmp, dest) {
        Ok(()) => Ok(()),
        // Another build won the race: its copy is as good as ours.
        Err(_) if dest.exists() => {
            let _ = fs::remove_dir_all(tmp);
            Ok(())
        }
        Err(e) => Err(format!("rename {} -> {}: {e}", tmp.display(), dest.display())),
    }
}

fn fetch_wheel(wheel: &str, dest: &Path) -> Res<()> {
    let tmp = tmp_for(dest)?;
    let spec = format!("{wheel}=={MLX_VERSION}");
    sh(Command::new("python3")
        .args(["-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d"])
        .arg(&tmp)
        .arg(&spec))
    .map_err(|e| format!("{e}\n(downloading {spec} needs python3 + pip and PyPI; or set MLX_DIR to an unpacked MLX wheel's mlx/ dir)"))?;
    let whl = fs::read_dir(&tmp)
        .map_err(|e| e.to_string())?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .ok_or_else(|| format!("pip download of {spec} produced no wheel"))?;
    sh(Command::new("python3").args(["-m", "zipfile", "-e"]).arg(&whl).arg(&tmp))?;
    fs::remove_file(&whl).map_err(|e| e.to_string())?;
    commit_dir(&tmp, dest)
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Blas {
    /// `src/blas_route.c` in front of OpenBLAS.
    Routed,
    /// OpenBLAS alone.
    OpenBlas,
    /// The wheel's netlib reference BLAS.
    Bundled,
}

const ROUTE_SRC: &str = "src/blas_route.c";

/// Compile `src/blas_route.c` into `libs` (once per source content); returns its path.
fn build_route(libs: &Path) -> Res<PathBuf> {
    println!("cargo:rerun-if-changed={ROUTE_SRC}");
    let src = Path::new(&env::var("CARGO_MANIFEST_DIR").unwrap()).join(ROUTE_SRC);
    let text = fs::read(&src).map_err(|e| format!("read {}: {e}", src.display()))?;
    let mut h = std::collections::hash_map::DefaultHasher::new();
    h.write(&text);
    h.write(OPENBLAS_DIR.as_bytes());
    let so = libs.join(format!("libmlx-models-blas-route-{:016x}.so", h.finish()));
    if so.exists() {
        return Ok(so);
    }
    let tmp = so.with_extension(format!("so.tmp{}", std::process::id()));
    let mut cmd = cc::Build::new().opt_level(2).pic(true).cargo_metadata(false).get_compiler().to_command();
    cmd.arg("-shared").arg("-o").arg(&tmp).arg(&src);
    cmd.arg(format!("-L{OPENBLAS_DIR}")).arg("-l:libblas.so.3").arg(format!("-Wl,-rpath,{OPENBLAS_DIR}")).arg("-ldl");
    sh(&mut cmd)?;
    fs::rename(&tmp, &so).map_err(|e| format!("rename {}: {e}", tmp.display()))?;
    Ok(so)
}

/// Point `link` at `target` atomically (a symlink made beside it, renamed over it).
fn relink(link: &Path, target: &Path) -> Res<()> {
    if fs::read_link(link).ok().as_deref() == Some(target) {
        return Ok(());
    }
    let tmp = link.with_extension(format!("link.tmp{}", std::process::id()));
    let _ = fs::remove_file(&tmp);
    std::os::unix::fs::symlink(target, &tmp).map_err(|e| format!("symlink {}: {e}", tmp.display()))?;
    fs::rename(&tmp, link).map_err(|e| format!("rename {} -> {}: {e}", tmp.display(), link.display()))
}

/// libmlx.so has DT_RPATH `$ORIGIN/../../mlx_cpu.libs`: point (or restore) its bundled blas/lapack.
/// The wheel's own netlib files are kept as `NAME.netlib`.
fn select_blas(root: &Path, mode: Blas) -> Res<()> {
    let libs = root.join("mlx_cpu.libs");
    let Ok(rd) = fs::read_dir(&libs) else { return Ok(()) };
    let names: Vec<PathBuf> = rd.filter_map(|e| e.ok().map(|e| e.path())).collect();
    for p in names {
        let name = p.file_name().unwrap().to_string_lossy().to_string();
        let blas = name.starts_with("libblas-") && name.ends_with(".so.3.10.0");
        let lapack = name.starts_with("liblapack-") && name.ends_with(".so.3.10.0");
        if !blas && !lapack {
            continue;
        }
        let netlib = libs.join(format!("{name}.netlib"));
        let is_link = fs::read_link(&p).is_ok();
        let err = |e: std::io::Error| format!("switching BLAS in {}: {e}", libs.display());
        if mode == Blas::Bundled {
            if is_link && netlib.exists() {
                fs::remove_file(&p).map_err(err)?;
                fs::rename(&netlib, &p).map_err(err)?;
            }
            continue;
        }
        if !is_link {
            fs::rename(&p, &netlib).map_err(err)?;
        }
        let target = match (blas, mode) {
            (true, Blas::Routed) => build_route(&libs)?,
            (true, _) => Path::new(OPENBLAS_DIR).join("libblas.so.3"),
            (false, _) => Path::new(OPENBLAS_DIR).join("liblapack.so.3"),
        };
        relink(&p, &target)?;
    }
    Ok(())
}

/// mlx-c sources from the crates.io `mlx-sys` package, fetched by cargo and patched, in the cache.
fn mlxc_sources(cache: &Path) -> Res<PathBuf> {
    let dest = cache.join(format!("mlx-c-{MLXC_CRATE_VERSION}-p{}", patch_key()));
    if dest.join("mlx/c/mlx.h").exists() {
        return Ok(dest);
    }
    let proj = cache.join("fetch-mlx-c");
    let home = cache.join("cargo-home");
    fs::create_dir_all(proj.join("src")).map_err(|e| e.to_string())?;
    fs::create_dir_all(&home).map_err(|e| e.to_string())?;
    fs::write(
        proj.join("Cargo.toml"),
        format!(
            "[package]\nname = \"fetch-mlx-c\"\nversion = \"0.0.0\"\nedition = \"2021\"\n\n\
             [dependencies]\nmlx-sys = {{ version = \"={MLXC_CRATE_VERSION}\", default-features = false }}\n\n\
             [workspace]\n"
        ),
    )
    .map_err(|e| e.to_string())?;
    fs::write(proj.join("src/lib.rs"), "").map_err(|e| e.to_string())?;
    // Registry settings (mirrors, source replacement) of the outer cargo apply to the inner one too.
    let outer_home = env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")));
    if let Some(o) = outer_home {
        for f in ["config.toml", "config", "credentials.toml"] {
            if o.join(f).exists() {
                let _ = fs::copy(o.join(f), home.join(f));
            }
        }
    }
    let cargo = env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.arg("fetch").arg("--manifest-path").arg(proj.join("Cargo.toml")).env("CARGO_HOME", &home);
    for (k, _) in env::vars_os() {
        let k = k.to_string_lossy().to_string();
        // Keep the outer build's target/profile settings from leaking into the fetch.
        if k.starts_with("CARGO_") && k != "CARGO_HOME" && !k.starts_with("CARGO_REGISTRIES") && !k.starts_with("CARGO_NET") && !k.starts_with("CARGO_HTTP") {
            cmd.env_remove(&k);
        }
    }
    sh(&mut cmd).map_err(|e| format!("{e}\n(fetching the mlx-sys {MLXC_CRATE_VERSION} package from crates.io for its mlx-c sources; or set MLXC_DIR)"))?;
    let src_root = home.join("registry/src");
    let pkg = fs::read_dir(&src_root)
        .map_err(|e| format!("{}: {e}", src_root.display()))?
        .filter_map(|e| e.ok())
        .map(|e| e.path().join(format!("mlx-sys-{MLXC_CRATE_VERSION}/src/mlx-c")))
        .find(|p| p.join("mlx/c").is_dir())
        .ok_or_else(|| format!("mlx-sys-{MLXC_CRATE_VERSION}/src/mlx-c not found under {}", src_root.display()))?;
    let tmp = tmp_for(&dest)?;
    copy_tree(&pkg.join("mlx/c"), &tmp.join("mlx/c"))?;
    patch_mlxc(&tmp)?;
    commit_dir(&tmp, &dest)?;
    Ok(dest)
}

fn copy_tree(from: &Path, to: &Path) -> Res<()> {
    fs::create_dir_all(to).map_err(|e| e.to_string())?;
    for e in fs::read_dir(from).map_err(|e| format!("{}: {e}", from.display()))? {
        let e = e.map_err(|e| e.to_string())?;
        let (s, d) = (e.path(), to.join(e.file_name()));
        if s.is_dir() {
            copy_tree(&s, &d)?;
        } else {
            fs::copy(&s, &d).map_err(|e| format!("copy {}: {e}", s.display()))?;
        }
    }
    Ok(())
}

/// Bump when [`patch_mlxc`] changes, so cached copies are redone.
fn patch_key() -> u32 {
    2
}

/// Two fixes so mlx-c 0.7.0 builds with g++ 12 on x86_64:
/// 1. `mlx/c/private/io.h` uses `std::format` (libstdc++ 13): string concatenation instead.
/// 2. `mlx/c/half.h` defines `float16_t`/`bfloat16_t` only on arm; define them (as storage types used
///    through pointers only) on x86_64 so mlx-rs's f16/bf16 accessors exist.
fn patch_mlxc(root: &Path) -> Res<()> {
    let edit = |rel: &str, f: &dyn Fn(String) -> Res<String>| -> Res<()> {
        let p = root.join(rel);
        let s = fs::read_to_string(&p).map_err(|e| format!("{}: {e}", p.display()))?;
        fs::write(&p, f(s)?).map_err(|e| format!("{}: {e}", p.display()))
    };
    edit("mlx/c/private/io.h", &|s| {
        let reps = [
            (
                r#"std::format("unable to read {} bytes (read {} instead)", n, read_n)"#,
                r#""unable to read " + std::to_string(n) + " bytes (read " + std::to_string(read_n) + " instead)""#,
            ),
            (
                r#"std::format("[mlx_io_reader] {} in {}", msg, label())"#,
                r#""[mlx_io_reader] " + msg + " in " + label()"#,
            ),
            (
                r#"std::format("[mlx_io_writer] {} in {}", msg, label())"#,
                r#""[mlx_io_writer] " + msg + " in " + label()"#,
            ),
        ];
        let mut s = s;
        for (a, b) in reps {
            s = s.replace(a, b);
        }
        // The write message is split over lines in the source: match it up to its last argument.
        while let Some(i) = s.find("std::format(") {
            let j = s[i..].find("wrote_n)").map(|j| i + j + "wrote_n)".len()).ok_or("unexpected std::format call in io.h")?;
            let call: String = s[i..j].split_whitespace().collect::<Vec<_>>().join(" ");
            if call.replace("( ", "(") != r#"std::format("unable to write {} bytes (wrote {} instead)", n, wrote_n)"# {
                return Err(format!("unexpected std::format call in io.h: {call}"));
            }
            s.replace_range(
                i..j,
                r#""unable to write " + std::to_string(n) + " bytes (wrote " + std::to_string(wrote_n) + " instead)""#,
            );
        }
        if !s.contains("#include <stdexcept>") {
            s = s.replacen("#include <streambuf>", "#include <streambuf>\n#include <string>\n#include <stdexcept>", 1);
        }
        Ok(s)
    })?;
    edit("mlx/c/half.h", &|s| {
        if s.contains("__x86_64__") {
            return Ok(s);
        }
        let marker = "#ifdef __cplusplus\n}\n#endif";
        if !s.contains(marker) {
            return Err("mlx/c/half.h: end-of-header marker not found".into());
        }
        let add = "\n#if !defined(HAS_FLOAT16) && (defined(__x86_64__) || defined(__i386__))\n\
                   #include <stdint.h>\n#define HAS_FLOAT16\n#define HAS_BFLOAT16\n\
                   #if defined(__clang__)\ntypedef __fp16 float16_t;\n#else\ntypedef uint16_t float16_t;\n#endif\n\
                   typedef uint16_t bfloat16_t;\n#endif\n\n";
        Ok(s.replacen(marker, &format!("{add}{marker}"), 1))
    })
}

/// Compile mlx-c to `libmlxc.a`, reusing a cached archive built from the same inputs.
fn compile_mlxc(mlxc: &Path, mlx_inc: &Path, cache: &Path) -> Res<()> {
    let out = PathBuf::from(env::var("OUT_DIR").unwrap());
    let mut files: Vec<PathBuf> = fs::read_dir(mlxc.join("mlx/c"))
        .map_err(|e| format!("{}: {e}", mlxc.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "cpp"))
        .collect();
    files.sort();

    // Key: this script, the sources, MLX's version header, target and compiler settings.
    let mut h = std::hash::DefaultHasher::new();
    h.write(include_bytes!("build.rs"));
    for f in files.iter().chain([mlx_inc.join("mlx/version.h")].iter()) {
        h.write(f.to_string_lossy().as_bytes());
        h.write(&fs::read(f).unwrap_or_default());
    }
    for v in ["TARGET", "CXX", "CXXFLAGS", "PROFILE"] {
        h.write(env::var(v).unwrap_or_default().as_bytes());
    }
    let key = format!("{:016x}", h.finish());
    let cached = cache.join(format!("mlxc-build-{key}/libmlxc.a"));
    let archive = out.join("libmlxc.a");

    if cached.exists() {
        fs::copy(&cached, &archive).map_err(|e| e.to_string())?;
        println!("cargo:rustc-link-search=native={}", out.display());
        println!("cargo:rustc-link-lib=static=mlxc");
        let stdlib = if env::var("CARGO_CFG_TARGET_VENDOR").as_deref() == Ok("apple") { "c++" } else { "stdc++" };
        println!("cargo:rustc-link-lib=dylib={stdlib}");
        return Ok(());
    }
    let mut b = cc::Build::new();
    b.cpp(true)
        .std("c++20")
        .include(mlxc)
        .include(mlx_inc)
        .opt_level(1)
        .debug(false)
        .warnings(false)
        .define("NDEBUG", None)
        .files(&files);
    b.try_compile("mlxc").map_err(|e| format!("compiling mlx-c: {e}"))?; // emits the link lines
    let dir = cached.parent().unwrap();
    let tmp = tmp_for(dir)?;
    fs::copy(&archive, tmp.join("libmlxc.a")).map_err(|e| e.to_string())?;
    commit_dir(&tmp, dir)
}

const KERNEL_SRC: [&str; 10] = [
    "src/cpukern/dispatch.h",
    "src/cpukern/guarded.h",
    "src/cpukern/kernels.h",
    "src/cpukern/kernels.cpp",
    "src/cpukern/primitive.cpp",
    "src/cpukern/strided.h",
    "src/cpukern/ops.cpp",
    "src/cudakern/cuda_ops.cpp",
    "src/cudakern/rows_matmul.cu",
    "src/cudakern/few_query_attention.cu",
];

/// `OUT_DIR/mlxm_cuda_src.h`: the CUDA kernel bodies of `src/cudakern/*.cu` as C++ string
/// literals, for `cuda_ops.cpp` (MLX compiles them with NVRTC at run time).
fn write_cuda_sources(dir: &Path, out: &Path) -> Res<()> {
    let mut h = String::from("// generated by build.rs from src/cudakern/*.cu\n#pragma once\n");
    for (name, file) in [("MLXM_ROWS_MATMUL_SRC", "rows_matmul.cu"), ("MLXM_FEW_QUERY_ATTENTION_SRC", "few_query_attention.cu")] {
        let src = fs::read_to_string(dir.join("src/cudakern").join(file)).map_err(|e| format!("read {file}: {e}"))?;
        if src.contains(")mlxm\"") {
            return Err(format!("{file} contains the raw-string delimiter"));
        }
        h.push_str(&format!("static const char* const {name} = R\"mlxm({src})mlxm\";\n"));
    }
    fs::write(out.join("mlxm_cuda_src.h"), h).map_err(|e| e.to_string())
}

/// Compile `src/cpukern` to `libmlxmkern.a`: `primitive.cpp` once, `kernels.cpp` once per
/// instruction set (AVX-512 with VNNI, AVX-512 and AVX2 copies on x86_64 only; the portable copy everywhere), reusing
/// a cached archive built from the same inputs.
fn compile_kernels(mlxc: &Path, mlx_inc: &Path, cache: &Path) -> Res<()> {
    let dir = Path::new(&env::var("CARGO_MANIFEST_DIR").unwrap()).to_path_buf();
    let out = PathBuf::from(env::var("OUT_DIR").unwrap());
    let x86 = env::var("CARGO_CFG_TARGET_ARCH").as_deref() == Ok("x86_64");
    let mut h = std::hash::DefaultHasher::new();
    for f in KERNEL_SRC {
        println!("cargo:rerun-if-changed={f}");
        h.write(&fs::read(dir.join(f)).map_err(|e| format!("read {f}: {e}"))?);
    }
    h.write(&fs::read(mlx_inc.join("mlx/version.h")).unwrap_or_default());
    h.write(mlxc.to_string_lossy().as_bytes());
    for v in ["TARGET", "CXX", "CXXFLAGS", "PROFILE"] {
        h.write(env::var(v).unwrap_or_default().as_bytes());
    }
    let key = format!("{:016x}", h.finish());
    let cached = cache.join(format!("mlxmkern-build-{key}/libmlxmkern.a"));
    write_cuda_sources(&dir, &out)?;
    let archive = out.join("libmlxmkern.a");
    if !cached.exists() {
        let base = || {
            let mut b = cc::Build::new();
            b.cpp(true)
                .std("c++20")
                .opt_level(2)
                .debug(false)
                .warnings(false)
                .pic(true)
                .define("NDEBUG", None)
                .cargo_metadata(false);
            b
        };
        let objs_dir = out.join("mlxmkern");
        fs::create_dir_all(&objs_dir).map_err(|e| e.to_string())?;
        let mut objs = Vec::new();
        let mut sets: Vec<(&str, &[&str])> = vec![("portable", &[])];
        if x86 {
            sets.push(("avx2", &["-mavx2", "-mfma", "-mf16c"]));
            sets.push((
                "avx512",
                &[
                    "-mavx512f",
                    "-mavx512bw",
                    "-mavx512vl",
                    "-mavx512dq",
                    "-mfma",
                    "-mf16c",
                ],
            ));
            sets.push((
                "avx512vnni",
                &[
                    "-mavx512f",
                    "-mavx512bw",
                    "-mavx512vl",
                    "-mavx512dq",
                    "-mavx512vnni",
                    "-mavx512vbmi",
                    "-mfma",
                    "-mf16c",
                ],
            ));
        }
        for (ns, flags) in sets {
            let mut b = base();
            b.define("KERN_NS", ns)
                .file(dir.join("src/cpukern/kernels.cpp"));
            for f in flags {
                b.flag(f);
            }
            // one object per copy: same source file, distinct output names
            let o = b
                .out_dir(objs_dir.join(ns))
                .try_compile_intermediates()
                .map_err(|e| format!("compiling the {ns} CPU kernels: {e}"))?;
            objs.extend(o);
        }
        let mut b = base();
        b.include(mlxc)
            .include(mlx_inc)
            .include(&out)
            // cpu_dequantize rounds scale * q and + bias separately, as MLX's dequantize does
            .flag_if_supported("-ffp-contract=off")
            .file(dir.join("src/cpukern/primitive.cpp"))
            .file(dir.join("src/cpukern/ops.cpp"))
            .file(dir.join("src/cudakern/cuda_ops.cpp"));
        objs.extend(
            b.out_dir(objs_dir.join("primitive"))
                .try_compile_intermediates()
                .map_err(|e| format!("compiling the CPU kernels' primitive: {e}"))?,
        );
        let _ = fs::remove_file(&archive);
        let ar = base().get_archiver();
        let mut cmd = ar;
        cmd.arg("crs").arg(&archive).args(&objs);
        sh(&mut cmd)?;
        let cdir = cached.parent().unwrap();
        let tmp = tmp_for(cdir)?;
        fs::copy(&archive, tmp.join("libmlxmkern.a")).map_err(|e| e.to_string())?;
        commit_dir(&tmp, cdir)?;
    } else {
        fs::copy(&cached, &archive).map_err(|e| e.to_string())?;
    }
    println!("cargo:rustc-link-search=native={}", out.display());
    println!("cargo:rustc-link-lib=static=mlxmkern");
    Ok(())
}
