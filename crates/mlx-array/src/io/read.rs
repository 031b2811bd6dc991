//! Reading safetensors checkpoints through a memory map.
use super::dtype_from_name;
use crate::array::check_shape;
use crate::error::{Error, Result};
use crate::{Array, DType};
use memmap2::Mmap;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

/// The index file of a sharded checkpoint.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// Headers larger than this are rejected as corrupt (the format's own limit).
const MAX_HEADER: u64 = 100_000_000;

/// A tensor's name, dtype and shape, read from a header without loading data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
}

fn bad(path: &Path, msg: impl Into<String>) -> Error {
    Error::Safetensors { path: path.to_path_buf(), msg: msg.into() }
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |source| Error::Io { path: path.to_path_buf(), source }
}

#[derive(serde::Deserialize)]
struct RawEntry {
    dtype: String,
    shape: Vec<usize>,
    data_offsets: (u64, u64),
}

/// One memory-mapped `.safetensors` file with a validated header.
pub struct SafetensorsFile {
    path: PathBuf,
    mmap: Mmap,
    /// name -> (info, byte range in the file)
    entries: BTreeMap<String, (TensorInfo, std::ops::Range<usize>)>,
    metadata: HashMap<String, String>,
}

impl std::fmt::Debug for SafetensorsFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SafetensorsFile({}, {} tensors)", self.path.display(), self.entries.len())
    }
}

impl SafetensorsFile {
    /// Map `path` and check its header: JSON, dtypes, shapes against byte ranges, and that the
    /// file holds every byte the header promises.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let file = std::fs::File::open(&path).map_err(io_err(&path))?;
        // SAFETY: the map is read-only; a file changed underneath us while mapped is outside
        // what any reader of checkpoints can defend against (as with every mmap loader).
        let mmap = unsafe { Mmap::map(&file) }.map_err(io_err(&path))?;
        let len = mmap.len() as u64;
        if len < 8 {
            return Err(Error::Truncated { path, expected: 8, actual: len });
        }
        let n = u64::from_le_bytes(mmap[..8].try_into().unwrap());
        if n > MAX_HEADER {
            return Err(bad(&path, format!("header length {n} exceeds {MAX_HEADER} bytes")));
        }
        if 8 + n > len {
            return Err(Error::Truncated { path, expected: 8 + n, actual: len });
        }
        let header: serde_json::Map<String, serde_json::Value> =
            serde_json::from_slice(&mmap[8..8 + n as usize]).map_err(|e| bad(&path, format!("header is not valid JSON: {e}")))?;
        let data_start = 8 + n;
        let mut entries = BTreeMap::new();
        let mut metadata = HashMap::new();
        let mut data_end = 0u64;
        for (name, value) in header {
            if name == "__metadata__" {
                // MLX's own `save_safetensors` writes `"__metadata__": null` when given none.
                if value.is_null() {
                    continue;
                }
                metadata = serde_json::from_value(value).map_err(|e| bad(&path, format!("__metadata__ must map strings to strings: {e}")))?;
                continue;
            }
            let raw: RawEntry = serde_json::from_value(value).map_err(|e| bad(&path, format!("entry {name:?}: {e}")))?;
            let dtype = dtype_from_name(&raw.dtype)
                .ok_or_else(|| Error::UnknownDType { path: path.clone(), name: name.clone(), dtype: raw.dtype.clone() })?;
            let (b, e) = raw.data_offsets;
            let numel = raw.shape.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d as u64));
            let want = numel.and_then(|k| k.checked_mul(dtype.size() as u64));
            if e < b || want != Some(e - b) {
                return Err(bad(&path, format!("tensor {name:?}: {dtype} {:?} does not fit data_offsets [{b}, {e}]", raw.shape)));
            }
            check_shape("safetensors", &raw.shape)?;
            // Offsets come from the file: check them against its length before any use.
            let end = data_start.checked_add(e).filter(|&x| x <= len).ok_or_else(|| Error::Truncated { path: path.clone(), expected: data_start.saturating_add(e), actual: len })?;
            data_end = data_end.max(e);
            let range = (data_start + b) as usize..end as usize;
            entries.insert(name.clone(), (TensorInfo { name, dtype, shape: raw.shape }, range));
        }
        if data_start + data_end > len {
            return Err(Error::Truncated { path, expected: data_start + data_end, actual: len });
        }
        // The safetensors crate's own checks (offsets contiguous, no overlap, full coverage).
        if let Err(e) = safetensors::SafeTensors::deserialize(&mmap) {
            return Err(bad(&path, e.to_string()));
        }
        Ok(SafetensorsFile { path, mmap, entries, metadata })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Every tensor, sorted by name.
    pub fn tensors(&self) -> Vec<TensorInfo> {
        self.entries.values().map(|(i, _)| i.clone()).collect()
    }

    pub fn contains(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    /// The header's `__metadata__` (empty when absent).
    pub fn metadata(&self) -> &HashMap<String, String> {
        &self.metadata
    }

    /// Load one tensor (a copy out of the map); float tensors are converted to `float_dtype`
    /// when it is given.
    pub fn load(&self, name: &str, float_dtype: Option<DType>) -> Result<Array> {
        check_float_dtype(float_dtype)?;
        let (info, range) = self
            .entries
            .get(name)
            .ok_or_else(|| Error::MissingTensor { name: name.to_string(), path: self.path.clone() })?;
        let a = Array::from_raw_bytes(&self.mmap[range.clone()], &info.shape, info.dtype)?;
        match float_dtype {
            Some(d) if info.dtype.is_float() && info.dtype != d => {
                let c = a.astype(d)?;
                c.eval()?; // frees the file-dtype copy now rather than at first use
                Ok(c)
            }
            _ => Ok(a),
        }
    }

    /// Load only `start..end` along `axis` of one tensor, copying just those bytes out of the
    /// map (a rank's shard of a tensor-parallel layer); floats are converted as in
    /// [`SafetensorsFile::load`].
    pub fn load_slice(&self, name: &str, axis: usize, start: usize, end: usize, float_dtype: Option<DType>) -> Result<Array> {
        self.load_slice_as(name, None, axis, start, end, float_dtype)
    }

    /// [`SafetensorsFile::load_slice`] of the tensor viewed as `view` (a shape with the same
    /// number of elements, e.g. `[3, h, h]` for a `[3h, h]` projection of three parts): the
    /// slice comes back in the view's layout.
    pub fn load_slice_as(&self, name: &str, view: Option<&[usize]>, axis: usize, start: usize, end: usize, float_dtype: Option<DType>) -> Result<Array> {
        check_float_dtype(float_dtype)?;
        let (info, range) = self
            .entries
            .get(name)
            .ok_or_else(|| Error::MissingTensor { name: name.to_string(), path: self.path.clone() })?;
        let shape = view.unwrap_or(&info.shape);
        if shape.iter().product::<usize>() != info.shape.iter().product::<usize>() {
            return Err(Error::arg("load_slice", format!("{name:?} {:?} viewed as {shape:?}", info.shape)));
        }
        if axis >= shape.len() || start > end || end > shape[axis] {
            return Err(Error::arg("load_slice", format!("{start}..{end} along axis {axis} of {name:?} {shape:?}")));
        }
        let inner: usize = shape[axis + 1..].iter().product::<usize>() * info.dtype.size();
        let outer: usize = shape[..axis].iter().product();
        let (row, take) = (shape[axis] * inner, (end - start) * inner);
        let data = &self.mmap[range.clone()];
        let mut bytes = Vec::with_capacity(outer * take);
        for o in 0..outer {
            let at = o * row + start * inner;
            bytes.extend_from_slice(&data[at..at + take]);
        }
        let mut out_shape = shape.to_vec();
        out_shape[axis] = end - start;
        let a = Array::from_raw_bytes(&bytes, &out_shape, info.dtype)?;
        match float_dtype {
            Some(d) if info.dtype.is_float() && info.dtype != d => {
                let c = a.astype(d)?;
                c.eval()?;
                Ok(c)
            }
            _ => Ok(a),
        }
    }

    /// Load every tensor.
    pub fn load_all(&self, float_dtype: Option<DType>) -> Result<HashMap<String, Array>> {
        self.entries.keys().map(|n| Ok((n.clone(), self.load(n, float_dtype)?))).collect()
    }
}

fn check_float_dtype(d: Option<DType>) -> Result<()> {
    match d {
        Some(d) if !d.is_float() => Err(Error::DType { op: "load_safetensors", expected: "a float dtype".into(), got: d.to_string() }),
        _ => Ok(()),
    }
}

impl Array {
    /// An array copied from little-endian `bytes` laid out row-major as `dtype` elements.
    pub fn from_raw_bytes(bytes: &[u8], shape: &[usize], dtype: DType) -> Result<Array> {
        let dims = check_shape("from_raw_bytes", shape)?;
        let numel: usize = shape.iter().product();
        if dtype == DType::Complex64 || bytes.len() != numel * dtype.size() {
            return Err(Error::shape("from_raw_bytes", format!("{} bytes for {dtype} {shape:?}", bytes.len())));
        }
        // MLX reads the buffer as typed elements: give it an aligned copy when `bytes` is not.
        let aligned;
        let ptr = if (bytes.as_ptr() as usize) % dtype.size() == 0 {
            bytes.as_ptr()
        } else {
            let mut v = vec![0u64; bytes.len().div_ceil(8)];
            // SAFETY: `v` holds at least `bytes.len()` bytes.
            unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), v.as_mut_ptr() as *mut u8, bytes.len()) };
            aligned = v;
            aligned.as_ptr() as *const u8
        };
        crate::ffi::ensure_handler();
        // SAFETY: `ptr` points at `numel` elements of `dtype`, which MLX copies before returning.
        let raw = unsafe { mlx_sys::mlx_array_new_data(ptr as *const std::ffi::c_void, dims.as_ptr(), dims.len() as i32, dtype.to_mlx() as mlx_sys::mlx_dtype) };
        if raw.ctx.is_null() {
            return Err(crate::ffi::take_error("from_raw_bytes", 1));
        }
        Ok(Array::wrap(unsafe { mlx_rs::Array::from_ptr(raw) }))
    }
}

/// A checkpoint: one `.safetensors` file, or the shards of a `model.safetensors.index.json`.
#[derive(Debug)]
pub struct Checkpoint {
    path: PathBuf,
    files: Vec<SafetensorsFile>,
    /// tensor name -> index into `files`
    owner: BTreeMap<String, usize>,
}

impl Checkpoint {
    /// Open a `.safetensors` file, an index JSON (`weight_map` naming shard files next to it), or
    /// a directory: its [`INDEX_FILE`] when present, else every `*.safetensors` in it.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        if path.is_dir() {
            let index = path.join(INDEX_FILE);
            if index.exists() {
                return Self::open_index(&index);
            }
            let mut shards: Vec<PathBuf> = std::fs::read_dir(path)
                .map_err(io_err(path))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "safetensors") && p.is_file())
                .collect();
            shards.sort();
            if shards.is_empty() {
                return Err(Error::Io { path: path.to_path_buf(), source: std::io::Error::new(std::io::ErrorKind::NotFound, "no *.safetensors files") });
            }
            return Self::from_files(path, shards.into_iter().map(SafetensorsFile::open).collect::<Result<_>>()?);
        }
        if path.extension().is_some_and(|x| x == "json") {
            return Self::open_index(path);
        }
        Self::from_files(path, vec![SafetensorsFile::open(path)?])
    }

    fn from_files(path: &Path, files: Vec<SafetensorsFile>) -> Result<Self> {
        let mut owner = BTreeMap::new();
        for (i, f) in files.iter().enumerate() {
            for name in f.entries.keys() {
                if let Some(j) = owner.insert(name.clone(), i) {
                    return Err(bad(path, format!("tensor {name:?} is in both {} and {}", files[j].path.display(), f.path.display())));
                }
            }
        }
        Ok(Checkpoint { path: path.to_path_buf(), files, owner })
    }

    fn open_index(index: &Path) -> Result<Self> {
        let text = std::fs::read(index).map_err(io_err(index))?;
        #[derive(serde::Deserialize)]
        struct Index {
            weight_map: BTreeMap<String, String>,
        }
        let idx: Index = serde_json::from_slice(&text).map_err(|e| bad(index, format!("invalid index: {e}")))?;
        let dir = index.parent().unwrap_or(Path::new("."));
        let mut shard_names: Vec<&String> = idx.weight_map.values().collect();
        shard_names.sort();
        shard_names.dedup();
        let mut files = Vec::new();
        let mut slot = HashMap::new();
        for s in shard_names {
            let p = dir.join(s);
            if !p.is_file() {
                return Err(Error::MissingShard { index: index.to_path_buf(), shard: p });
            }
            slot.insert(s.clone(), files.len());
            files.push(SafetensorsFile::open(&p)?);
        }
        let mut owner = BTreeMap::new();
        for (name, shard) in &idx.weight_map {
            let i = slot[shard];
            if !files[i].contains(name) {
                return Err(Error::MissingTensor { name: name.clone(), path: files[i].path.clone() });
            }
            owner.insert(name.clone(), i);
        }
        Ok(Checkpoint { path: index.to_path_buf(), files, owner })
    }

    /// The file, index or directory this was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The shard files (one for a single-file checkpoint).
    pub fn files(&self) -> &[SafetensorsFile] {
        &self.files
    }

    /// Every tensor, sorted by name, without loading data.
    pub fn tensors(&self) -> Vec<TensorInfo> {
        self.owner.iter().map(|(n, &i)| self.files[i].entries[n].0.clone()).collect()
    }

    pub fn contains(&self, name: &str) -> bool {
        self.owner.contains_key(name)
    }

    /// Load one tensor (see [`SafetensorsFile::load`]).
    pub fn load(&self, name: &str, float_dtype: Option<DType>) -> Result<Array> {
        match self.owner.get(name) {
            Some(&i) => self.files[i].load(name, float_dtype),
            None => Err(Error::MissingTensor { name: name.to_string(), path: self.path.clone() }),
        }
    }

    /// Load `start..end` along `axis` of one tensor (see [`SafetensorsFile::load_slice`]).
    pub fn load_slice(&self, name: &str, axis: usize, start: usize, end: usize, float_dtype: Option<DType>) -> Result<Array> {
        self.load_slice_as(name, None, axis, start, end, float_dtype)
    }

    /// See [`SafetensorsFile::load_slice_as`].
    pub fn load_slice_as(&self, name: &str, view: Option<&[usize]>, axis: usize, start: usize, end: usize, float_dtype: Option<DType>) -> Result<Array> {
        match self.owner.get(name) {
            Some(&i) => self.files[i].load_slice_as(name, view, axis, start, end, float_dtype),
            None => Err(Error::MissingTensor { name: name.to_string(), path: self.path.clone() }),
        }
    }

    /// The given `.safetensors` files as one checkpoint (`path` names it in errors); a tensor
    /// in two of them is an error.
    pub fn open_files(path: impl AsRef<Path>, files: &[PathBuf]) -> Result<Self> {
        Self::from_files(path.as_ref(), files.iter().map(SafetensorsFile::open).collect::<Result<_>>()?)
    }

    /// Load the named tensors; any missing name is an error.
    pub fn load_selected(&self, names: &[&str], float_dtype: Option<DType>) -> Result<HashMap<String, Array>> {
        names.iter().map(|&n| Ok((n.to_string(), self.load(n, float_dtype)?))).collect()
    }

    /// Load every tensor.
    pub fn load_all(&self, float_dtype: Option<DType>) -> Result<HashMap<String, Array>> {
        self.owner.keys().map(|n| Ok((n.clone(), self.load(n, float_dtype)?))).collect()
    }
}

/// Load every tensor of a file, index or directory (see [`Checkpoint::open`]); floats are
/// converted to `float_dtype` when given (e.g. `Some(DType::F32)` to upcast bf16 weights).
pub fn load_safetensors(path: impl AsRef<Path>, float_dtype: Option<DType>) -> Result<HashMap<String, Array>> {
    Checkpoint::open(path)?.load_all(float_dtype)
}

/// Load every tensor of a model directory (sharded through [`INDEX_FILE`] when present).
pub fn load_dir(dir: &Path, float_dtype: Option<DType>) -> Result<HashMap<String, Array>> {
    load_safetensors(dir, float_dtype)
}

/// Names, dtypes and shapes of every tensor of a file, index or directory, sorted by name.
pub fn list_tensors(path: impl AsRef<Path>) -> Result<Vec<TensorInfo>> {
    Ok(Checkpoint::open(path)?.tensors())
}
