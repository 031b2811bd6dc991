//! Writing checkpoints: an output directory that appears whole or not at all, and a streaming
//! safetensors writer (the header is known up front, tensors are written one at a time), weights
//! sharded as mlx-lm shards them ([`ShardedWriter`]).
use std::fs::{self, File};
use std::io::{BufWriter, Write};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::ConvertError;

/// Element type of a written tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OutDtype {
    F32,
    #[default]
    Bf16,
    F16,
}

impl OutDtype {
    pub fn size(self) -> u64 {
        match self {
            OutDtype::F32 => 4,
            OutDtype::Bf16 | OutDtype::F16 => 2,
        }
    }
    /// The safetensors dtype name.
    pub fn safetensors_name(self) -> &'static str {
        match self {
            OutDtype::F32 => "F32",
            OutDtype::Bf16 => "BF16",
            OutDtype::F16 => "F16",
        }
    }
    /// The `torch_dtype` config.json names.
    pub fn torch_name(self) -> &'static str {
        match self {
            OutDtype::F32 => "float32",
            OutDtype::Bf16 => "bfloat16",
            OutDtype::F16 => "float16",
        }
    }
    /// Append `v` in this dtype, little-endian (bf16 and f16 round to nearest even).
    pub fn encode(self, v: &[f32], out: &mut Vec<u8>) {
        out.reserve(v.len() * self.size() as usize);
        match self {
            OutDtype::F32 => v.iter().for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
            OutDtype::Bf16 => v.iter().for_each(|&x| out.extend_from_slice(&half::bf16::from_f32(x).to_le_bytes())),
            OutDtype::F16 => v.iter().for_each(|&x| out.extend_from_slice(&half::f16::from_f32(x).to_le_bytes())),
        }
    }
}

impl std::str::FromStr for OutDtype {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "f32" | "float32" => Ok(OutDtype::F32),
            "bf16" | "bfloat16" => Ok(OutDtype::Bf16),
            "f16" | "float16" => Ok(OutDtype::F16),
            _ => Err(format!("unknown dtype {s:?} (expected f32, bf16 or f16)")),
        }
    }
}

pub(crate) fn io(path: &Path) -> impl Fn(std::io::Error) -> ConvertError + '_ {
    move |source| ConvertError::Io { path: path.to_path_buf(), source }
}

/// A directory built under a temporary name next to its destination and renamed into place by
/// [`StagedDir::commit`]. Dropped without a commit, it removes itself: an interrupted
/// conversion leaves the previous destination (or none), never a half-written one.
pub struct StagedDir {
    tmp: PathBuf,
    dest: PathBuf,
    committed: bool,
}

impl StagedDir {
    pub fn new(dest: &Path) -> Result<Self, ConvertError> {
        let name = dest.file_name().ok_or_else(|| ConvertError::BadOutput(dest.to_path_buf()))?.to_string_lossy().into_owned();
        let parent = match dest.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        fs::create_dir_all(&parent).map_err(io(&parent))?;
        let tmp = parent.join(format!(".{name}.partial-{}", std::process::id()));
        if tmp.exists() {
            fs::remove_dir_all(&tmp).map_err(io(&tmp))?;
        }
        fs::create_dir(&tmp).map_err(io(&tmp))?;
        Ok(StagedDir { tmp, dest: dest.to_path_buf(), committed: false })
    }
    /// Where files are written until the commit.
    pub fn path(&self) -> &Path {
        &self.tmp
    }
    /// Write a small file whole.
    pub fn write(&self, name: &str, bytes: &[u8]) -> Result<(), ConvertError> {
        let p = self.tmp.join(name);
        fs::write(&p, bytes).map_err(io(&p))
    }
    /// Replace the destination with the staged directory.
    pub fn commit(mut self) -> Result<PathBuf, ConvertError> {
        let old = self.tmp.with_file_name(format!("{}.old", self.tmp.file_name().unwrap().to_string_lossy()));
        let had_old = self.dest.exists();
        if had_old {
            fs::rename(&self.dest, &old).map_err(io(&self.dest))?;
        }
        if let Err(e) = fs::rename(&self.tmp, &self.dest) {
            if had_old {
                let _ = fs::rename(&old, &self.dest);
            }
            return Err(io(&self.dest)(e));
        }
        self.committed = true;
        if had_old {
            fs::remove_dir_all(&old).map_err(io(&old))?;
        }
        Ok(self.dest.clone())
    }
}

impl Drop for StagedDir {
    fn drop(&mut self) {
        if !self.committed {
            let _ = fs::remove_dir_all(&self.tmp);
        }
    }
}

/// One tensor of a safetensors file: name, dtype name, shape.
#[derive(Debug, Clone)]
pub struct TensorSpec {
    pub name: String,
    pub dtype: &'static str,
    pub shape: Vec<usize>,
    pub n_bytes: u64,
}

/// A safetensors file whose header is written first; tensors must then be written in the order
/// they were declared, each with exactly its declared size.
pub struct SafetensorsWriter {
    w: BufWriter<File>,
    path: PathBuf,
    specs: Vec<TensorSpec>,
    next: usize,
}

impl SafetensorsWriter {
    pub fn create(path: &Path, specs: Vec<TensorSpec>, metadata: &[(&str, &str)]) -> Result<Self, ConvertError> {
        let mut header = serde_json::Map::new();
        if !metadata.is_empty() {
            let m: serde_json::Map<_, _> = metadata.iter().map(|(k, v)| (k.to_string(), serde_json::Value::from(*v))).collect();
            header.insert("__metadata__".into(), m.into());
        }
        let mut offset = 0u64;
        for s in &specs {
            header.insert(
                s.name.clone(),
                serde_json::json!({"dtype": s.dtype, "shape": s.shape, "data_offsets": [offset, offset + s.n_bytes]}),
            );
            offset += s.n_bytes;
        }
        let mut h = serde_json::to_vec(&header)?;
        while h.len() % 8 != 0 {
            h.push(b' ');
        }
        let f = File::create(path).map_err(io(path))?;
        let mut w = BufWriter::with_capacity(1 << 20, f);
        w.write_all(&(h.len() as u64).to_le_bytes()).map_err(io(path))?;
        w.write_all(&h).map_err(io(path))?;
        Ok(SafetensorsWriter { w, path: path.to_path_buf(), specs, next: 0 })
    }
    pub fn write_tensor(&mut self, name: &str, bytes: &[u8]) -> Result<(), ConvertError> {
        let spec = self.specs.get(self.next).ok_or_else(|| ConvertError::Internal(format!("{name}: more tensors than declared")))?;
        if spec.name != name || spec.n_bytes != bytes.len() as u64 {
            return Err(ConvertError::Internal(format!(
                "{name} ({} bytes) written where {} ({} bytes) was declared",
                bytes.len(),
                spec.name,
                spec.n_bytes
            )));
        }
        self.w.write_all(bytes).map_err(io(&self.path))?;
        self.next += 1;
        Ok(())
    }
    pub fn finish(mut self) -> Result<(), ConvertError> {
        if self.next != self.specs.len() {
            return Err(ConvertError::Internal(format!("{} of {} tensors written", self.next, self.specs.len())));
        }
        self.w.flush().map_err(io(&self.path))?;
        self.w.get_ref().sync_all().map_err(io(&self.path))?;
        Ok(())
    }
}

/// mlx-lm's default shard limit (`MAX_FILE_SIZE_GB = 5`, as `5 << 30` bytes).
pub const DEFAULT_MAX_SHARD_BYTES: u64 = 5 << 30;

/// Weights written shard by shard as mlx-lm's `save_model` writes them: tensors are added in
/// order, and a shard is written (and its tensors released) as soon as the next tensor would
/// take it past `max_shard_bytes`; a tensor larger than the limit gets a shard of its own.
/// [`ShardedWriter::finish`] names the shards `model-0000k-of-0000n.safetensors` (a single shard
/// is `model.safetensors`) and writes `model.safetensors.index.json` with `metadata.total_size`,
/// `metadata.total_parameters` and the sorted `weight_map`. Peak memory is one shard plus the
/// tensor being added.
pub struct ShardedWriter {
    dir: PathBuf,
    max_shard_bytes: u64,
    pending: Vec<(String, mlx_array::Array)>,
    pending_bytes: u64,
    /// (temporary file name, tensor names) of each written shard
    written: Vec<(String, Vec<String>)>,
    total_bytes: u64,
    names: std::collections::HashSet<String>,
}

/// What [`ShardedWriter::finish`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardsWritten {
    /// Shard file names in order.
    pub files: Vec<String>,
    /// Sum of the tensors' bytes (the index's `metadata.total_size`).
    pub total_size: u64,
}

impl ShardedWriter {
    /// Shards go into `dir` (a staged directory); `max_shard_bytes` must be positive.
    pub fn new(dir: &Path, max_shard_bytes: u64) -> Result<Self, ConvertError> {
        if max_shard_bytes == 0 {
            return Err(ConvertError::BadOption("the shard size limit must be positive".into()));
        }
        Ok(ShardedWriter {
            dir: dir.to_path_buf(),
            max_shard_bytes,
            pending: Vec::new(),
            pending_bytes: 0,
            written: Vec::new(),
            total_bytes: 0,
            names: Default::default(),
        })
    }

    /// Add one tensor. It is evaluated now, so that whatever it was computed from can be freed.
    pub fn add(&mut self, name: String, a: mlx_array::Array) -> Result<(), ConvertError> {
        if !self.names.insert(name.clone()) {
            return Err(ConvertError::Internal(format!("tensor {name:?} written twice")));
        }
        a.eval()?;
        let n = a.nbytes() as u64;
        if !self.pending.is_empty() && self.pending_bytes + n > self.max_shard_bytes {
            self.flush()?;
        }
        self.pending.push((name, a));
        self.pending_bytes += n;
        self.total_bytes += n;
        Ok(())
    }

    fn flush(&mut self) -> Result<(), ConvertError> {
        let tmp_name = format!(".shard-{:05}.safetensors.partial", self.written.len() + 1);
        let refs: Vec<(&str, &mlx_array::Array)> = self.pending.iter().map(|(n, a)| (n.as_str(), a)).collect();
        let meta: std::collections::HashMap<String, String> = [("format".to_string(), "mlx".to_string())].into();
        mlx_array::io::save_safetensors(self.dir.join(&tmp_name), &refs, Some(&meta))?;
        let names = self.pending.drain(..).map(|(n, _)| n).collect();
        self.pending_bytes = 0;
        self.written.push((tmp_name, names));
        Ok(())
    }

    /// Bytes of the tensors added so far.
    pub fn total_bytes(&self) -> u64 {
        self.total_bytes
    }

    /// Write the last shard, name the shards and write the index. `total_parameters` is the
    /// index's `metadata.total_parameters`.
    pub fn finish(mut self, total_parameters: u64) -> Result<ShardsWritten, ConvertError> {
        if !self.pending.is_empty() || self.written.is_empty() {
            self.flush()?;
        }
        let n = self.written.len();
        let mut weight_map = BTreeMap::new();
        let mut files = Vec::with_capacity(n);
        for (i, (tmp, names)) in self.written.iter().enumerate() {
            let name = if n == 1 { "model.safetensors".to_string() } else { format!("model-{:05}-of-{:05}.safetensors", i + 1, n) };
            let (from, to) = (self.dir.join(tmp), self.dir.join(&name));
            fs::rename(&from, &to).map_err(io(&to))?;
            for t in names {
                weight_map.insert(t.clone(), name.clone());
            }
            files.push(name);
        }
        let index = serde_json::json!({
            "metadata": {"total_size": self.total_bytes, "total_parameters": total_parameters},
            "weight_map": weight_map,
        });
        // json.dump(..., indent=4) as mlx-lm writes it
        let mut bytes = Vec::new();
        let mut ser = serde_json::Serializer::with_formatter(&mut bytes, serde_json::ser::PrettyFormatter::with_indent(b"    "));
        index.serialize(&mut ser)?;
        mlx_array::io::write_atomic(self.dir.join(mlx_array::io::INDEX_FILE), &bytes)?;
        Ok(ShardsWritten { files, total_size: self.total_bytes })
    }
}

