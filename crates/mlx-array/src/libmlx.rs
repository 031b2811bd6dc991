//! Facts about the loaded libmlx that change results: on CUDA, whether its JIT-compiled
//! `qmm_sm80` kernel still has the epilogue race that `scripts/gpu/patch_libmlx.py` fixes.
//!
//! libmlx 0.32.2 computes quantized products of 8 or more bf16/f16 rows (prefill, 8-row verify
//! steps, `gather_qmm` of 8 or more expert rows) with `qmm_sm80`, compiled by NVRTC from a source
//! it embeds. Unpatched, that kernel's epilogue stages its output in shared memory that copies of
//! its main loop may still be writing, and some launches return garbage. [`loaded_qmm_sm80`]
//! reads the embedded source of the libmlx this process loaded, so a caller can warn or refuse.
use std::path::{Path, PathBuf};

/// The `qmm_sm80` kernel source a libmlx embeds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QmmSm80 {
    /// No such source: a CPU or Metal build, or a version without the kernel.
    Absent,
    /// The source with the epilogue race.
    Racy,
    /// The source as `scripts/gpu/patch_libmlx.py` leaves it.
    Patched,
}

/// The kernel's name in its source.
const KERNEL: &[u8] = b"qmm_sm80_kernel";
/// The epilogue's first lines in the unpatched source (right after the main loop).
const RACY: &[u8] = b"  // Epilogue.\n  CUTE_UNROLL\n  for (int i = 0; i < size(tCrC_accu); i++) {";
/// The lines the patch puts in their place.
const PATCHED: &[u8] = b"  cp_async_wait<0>();\n  __syncthreads();\n  CUTE_UNROLL\n  for (int i = 0; i < size(tCrC_accu); i++) {";

/// What `lib` (the bytes of a libmlx) embeds: racy if any copy of the source is unpatched.
pub fn qmm_sm80_in(lib: &[u8]) -> QmmSm80 {
    if memchr::memmem::find(lib, KERNEL).is_none() {
        return QmmSm80::Absent;
    }
    if memchr::memmem::find(lib, RACY).is_some() {
        QmmSm80::Racy
    } else if memchr::memmem::find(lib, PATCHED).is_some() {
        QmmSm80::Patched
    } else {
        QmmSm80::Absent
    }
}

/// [`qmm_sm80_in`] of the file at `path` (memory-mapped, read once).
pub fn qmm_sm80_of(path: &Path) -> std::io::Result<QmmSm80> {
    let file = std::fs::File::open(path)?;
    // SAFETY: the map is read while this function holds it; a library being rewritten under a
    // running process is outside what this check can promise.
    let map = unsafe { memmap2::Mmap::map(&file)? };
    Ok(qmm_sm80_in(&map))
}

/// The path of the libmlx this process has loaded (from `/proc/self/maps`; `None` where that
/// file does not exist or names no libmlx).
pub fn loaded_libmlx() -> Option<PathBuf> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    libmlx_in_maps(&maps)
}

fn libmlx_in_maps(maps: &str) -> Option<PathBuf> {
    maps.lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .find(|p| Path::new(p).file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("libmlx.so")))
        .map(PathBuf::from)
}

/// [`qmm_sm80_of`] the loaded libmlx; [`QmmSm80::Absent`] when none can be found.
pub fn loaded_qmm_sm80() -> std::io::Result<QmmSm80> {
    match loaded_libmlx() {
        Some(p) => qmm_sm80_of(&p),
        None => Ok(QmmSm80::Absent),
    }
}

/// With the GPU as the default device and the loaded libmlx's kernel [`QmmSm80::Racy`]: a
/// one-line warning for a command line to show (`None` otherwise, or when the check cannot run).
pub fn gpu_warning() -> Option<&'static str> {
    let gpu = matches!(crate::default_device(), Ok(crate::Device::Gpu));
    (gpu && matches!(loaded_qmm_sm80(), Ok(QmmSm80::Racy))).then_some(
        "warning: this libmlx's qmm_sm80 kernel has an epilogue race (quantized products of 8 or more \
         bf16/f16 rows can come out wrong); patch it with scripts/gpu/patch_libmlx.py",
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lib(body: &[u8]) -> Vec<u8> {
        [b"\x7fELF...\0__global__ void qmm_sm80_kernel(...) {\n".as_slice(), body, b"\n}\0tail"].concat()
    }

    #[test]
    fn tells_racy_patched_and_absent_apart() {
        let racy = lib(b"    }\n  }\n\n  // Epilogue.\n  CUTE_UNROLL\n  for (int i = 0; i < size(tCrC_accu); i++) {\n    tCrC(i) = x;\n  }");
        let patched = lib(b"    }\n  }\n  // sC aliases sA/sB\n  cp_async_wait<0>();\n  __syncthreads();\n  CUTE_UNROLL\n  for (int i = 0; i < size(tCrC_accu); i++) {\n    tCrC(i) = x;\n  }");
        assert_eq!(qmm_sm80_in(&racy), QmmSm80::Racy);
        assert_eq!(qmm_sm80_in(&patched), QmmSm80::Patched);
        // one unpatched copy among patched ones is still racy
        assert_eq!(qmm_sm80_in(&[patched.clone(), racy.clone()].concat()), QmmSm80::Racy);
        assert_eq!(qmm_sm80_in(b"a CPU libmlx"), QmmSm80::Absent);
        // the kernel without either epilogue (another version): not claimed patched
        assert_eq!(qmm_sm80_in(&lib(b"  copy(r2s);")), QmmSm80::Absent);
    }

    /// The patterns are those `scripts/gpu/patch_libmlx.py` replaces and writes (its `LOOP` and
    /// `FIXED` sources hold them verbatim), so a change to the script cannot leave them behind.
    #[test]
    fn patterns_are_those_of_the_patch_script() {
        let script = std::fs::read(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/gpu/patch_libmlx.py")).unwrap();
        // the bytes between `NAME = b"""` and the closing `"""`
        let part = |name: &str| {
            let open = format!("\n{name} = b\"\"\"");
            let start = memchr::memmem::find(&script, open.as_bytes()).unwrap_or_else(|| panic!("{name} not in the script")) + open.len();
            let body = &script[start..];
            body[..memchr::memmem::find(body, b"\"\"\"").unwrap()].to_vec()
        };
        let (lp, fixed) = (part("LOOP"), part("FIXED"));
        assert!(memchr::memmem::find(&lp, RACY).is_some(), "the racy epilogue is not in LOOP");
        assert!(memchr::memmem::find(&fixed, PATCHED).is_some(), "the patched epilogue is not in FIXED");
        assert!(memchr::memmem::find(&fixed, RACY).is_none());
    }

    #[test]
    fn finds_libmlx_in_maps() {
        let maps = "7f00-7f01 r-xp 00000000 08:01 123 /usr/lib/libc.so.6\n\
                    7f02-7f03 r--p 00000000 08:01 456 /tmp/rt/mlx/lib/libmlx.so\n\
                    7f04-7f05 rw-p 00000000 00:00 0 \n";
        assert_eq!(libmlx_in_maps(maps), Some(PathBuf::from("/tmp/rt/mlx/lib/libmlx.so")));
        assert_eq!(libmlx_in_maps("7f00-7f01 r-xp 0 08:01 1 /usr/lib/libmlxsomething.so\n"), None);
        assert_eq!(libmlx_in_maps(""), None);
    }

    #[test]
    fn no_warning_on_the_cpu() {
        if crate::default_device().unwrap() == crate::Device::Cpu {
            assert_eq!(gpu_warning(), None);
        }
    }

    #[test]
    fn this_process_libmlx_is_read() {
        // the CPU libmlx of mlx-sys: found, and without the CUDA kernel source
        let p = loaded_libmlx().expect("a libmlx is loaded");
        assert_eq!(qmm_sm80_of(&p).unwrap(), QmmSm80::Absent);
    }
}
