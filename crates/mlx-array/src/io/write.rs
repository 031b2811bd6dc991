//! Writing safetensors files atomically.
use super::to_st_dtype;
use crate::error::{Error, OpExt, Result};
use crate::{Array, DType};
use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// An evaluated, row-major copy of an array, viewed as bytes.
struct Flat {
    dtype: safetensors::Dtype,
    shape: Vec<usize>,
    /// The copy's bytes (a `u8` view sharing its buffer).
    flat: mlx_rs::Array,
}

impl Flat {
    fn new(a: &Array) -> Result<Self> {
        let our = a.dtype();
        let dtype = to_st_dtype(our).ok_or_else(|| Error::DType { op: "save_safetensors", expected: "a safetensors dtype".into(), got: our.to_string() })?;
        if our == DType::F64 {
            return Err(Error::DType { op: "save_safetensors", expected: "a dtype mlx-rs can read back".into(), got: our.to_string() });
        }
        let flat = mlx_rs::ops::reshape(&a.inner, &[-1]).op("save_safetensors")?.contiguous().op("save_safetensors")?;
        let flat = flat.view::<u8>().op("save_safetensors")?;
        flat.eval().op("save_safetensors")?;
        let f = Flat { dtype, shape: a.shape(), flat };
        f.raw()?; // fail here, before any file is touched
        Ok(f)
    }
    fn raw(&self) -> Result<&[u8]> {
        if self.flat.size() == 0 {
            return Ok(&[]); // MLX has no buffer for an empty array
        }
        self.flat.try_as_slice::<u8>().map_err(|e| Error::Mlx { op: "save_safetensors", msg: e.to_string() })
    }
}

static COUNTER: AtomicU64 = AtomicU64::new(0);

/// The safetensors bytes of `flats` into `tmp`, deterministically: the header's keys sorted
/// (`__metadata__` included, so the same tensors and metadata always give the same bytes), the
/// data ordered by element size, largest first, then by name (every tensor aligned to its
/// element size), the header padded with spaces to a multiple of 8 bytes.
fn write_file(tmp: &Path, flats: &[(&str, Flat)], metadata: Option<&HashMap<String, String>>) -> Result<()> {
    let mut order: Vec<&(&str, Flat)> = flats.iter().collect();
    order.sort_by(|a, b| b.1.dtype.bitsize().cmp(&a.1.dtype.bitsize()).then(a.0.cmp(b.0)));
    let mut header = std::collections::BTreeMap::<String, serde_json::Value>::new();
    if let Some(m) = metadata {
        let sorted: std::collections::BTreeMap<&String, &String> = m.iter().collect();
        header.insert("__metadata__".into(), serde_json::json!(sorted));
    }
    let mut offset = 0usize;
    for (name, f) in &order {
        let end = offset + f.flat.nbytes();
        header.insert((*name).to_string(), serde_json::json!({"dtype": f.dtype, "shape": f.shape, "data_offsets": [offset, end]}));
        offset = end;
    }
    let mut json = serde_json::to_vec(&header).map_err(|e| Error::arg("save_safetensors", e.to_string()))?;
    json.resize(json.len().div_ceil(8) * 8, b' ');
    let io = |source| Error::Io { path: tmp.to_path_buf(), source };
    let mut out = std::io::BufWriter::new(std::fs::OpenOptions::new().write(true).truncate(true).open(tmp).map_err(io)?);
    out.write_all(&(json.len() as u64).to_le_bytes()).map_err(io)?;
    out.write_all(&json).map_err(io)?;
    for (_, f) in &order {
        out.write_all(f.raw()?).map_err(io)?;
    }
    out.flush().map_err(io)
}

/// Write `tensors` (and string `metadata`) to `path` atomically: the data goes to a temporary
/// file in the same directory, is fsynced, and is renamed over `path`. A crash or an error leaves
/// any previous file at `path` as it was.
pub fn save_safetensors(path: impl AsRef<Path>, tensors: &[(&str, &Array)], metadata: Option<&HashMap<String, String>>) -> Result<()> {
    let path = path.as_ref();
    let mut seen = HashSet::new();
    for (name, _) in tensors {
        if !seen.insert(*name) {
            return Err(Error::arg("save_safetensors", format!("tensor name {name:?} given twice")));
        }
        if *name == "__metadata__" {
            return Err(Error::arg("save_safetensors", "\"__metadata__\" is reserved"));
        }
    }
    let flats: Vec<(&str, Flat)> = tensors.iter().map(|(n, a)| Ok((*n, Flat::new(a)?))).collect::<Result<_>>()?;
    write_atomic_with(path, |tmp| write_file(tmp, &flats, metadata))
}

/// Write `bytes` to `path` atomically (see [`write_atomic_with`]).
pub fn write_atomic(path: impl AsRef<Path>, bytes: &[u8]) -> Result<()> {
    write_atomic_with(path.as_ref(), |tmp| {
        let io = |source| Error::Io { path: tmp.to_path_buf(), source };
        std::fs::OpenOptions::new().write(true).truncate(true).open(tmp).and_then(|mut f| f.write_all(bytes)).map_err(io)
    })
}

/// Make `path`'s new contents with `write`, given a temporary file in the same directory (created
/// empty, a name no other writer uses), then fsync it and rename it over `path`. A crash or an
/// error leaves any previous file at `path` as it was, and no temporary file behind.
pub fn write_atomic_with(path: &Path, write: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let fname = path.file_name().ok_or_else(|| Error::arg("write_atomic", format!("{} is not a file path", path.display())))?;
    let tmp = dir.join(format!(".{}.{}.{}.tmp", fname.to_string_lossy(), std::process::id(), COUNTER.fetch_add(1, Ordering::Relaxed)));
    let io = |p: &Path| {
        let p = p.to_path_buf();
        move |source| Error::Io { path: p, source }
    };
    let result = (|| {
        // Claim the name first (never clobber a file we did not create), then write into it.
        drop(std::fs::OpenOptions::new().write(true).create_new(true).open(&tmp).map_err(io(&tmp))?);
        write(&tmp)?;
        // fsync applies to the file, whichever descriptor asks.
        std::fs::File::open(&tmp).and_then(|f| f.sync_all()).map_err(io(&tmp))?;
        std::fs::rename(&tmp, path).map_err(io(path))?;
        // Make the rename itself durable (best effort: not every platform can open directories).
        if let Ok(d) = std::fs::File::open(&dir) {
            let _ = d.sync_all();
        }
        Ok(())
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}
