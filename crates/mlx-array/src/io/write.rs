//! Writing safetensors files atomically.
use super::to_st_dtype;
use crate::error::{Error, OpExt, Result};
use crate::{Array, DType};
use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
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

impl safetensors::View for &Flat {
    fn dtype(&self) -> safetensors::Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(self.raw().expect("checked in Flat::new"))
    }
    fn data_len(&self) -> usize {
        self.flat.nbytes()
    }
}

static COUNTER: AtomicU64 = AtomicU64::new(0);

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
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let fname = path.file_name().ok_or_else(|| Error::arg("save_safetensors", format!("{} is not a file path", path.display())))?;
    let tmp = dir.join(format!(".{}.{}.{}.tmp", fname.to_string_lossy(), std::process::id(), COUNTER.fetch_add(1, Ordering::Relaxed)));
    let io = |p: &Path| {
        let p = p.to_path_buf();
        move |source| Error::Io { path: p, source }
    };
    let result = (|| {
        // Claim the name first (never clobber a file we did not create), then stream into it.
        drop(std::fs::OpenOptions::new().write(true).create_new(true).open(&tmp).map_err(io(&tmp))?);
        safetensors::serialize_to_file(flats.iter().map(|(n, f)| (*n, f)), metadata.cloned(), &tmp).map_err(|e| match e {
            safetensors::SafeTensorError::IoError(source) => Error::Io { path: tmp.clone(), source },
            e => Error::Safetensors { path: path.to_path_buf(), msg: e.to_string() },
        })?;
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
