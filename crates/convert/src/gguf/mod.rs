//! GGUF files (versions 2 and 3): metadata, tensor infos and tensor data.
//!
//! [`GgufHeader::parse`] reads the header of untrusted bytes: every count is checked against the
//! bytes that remain before anything is allocated for it, and every tensor's extent is checked
//! against the data section. [`GgufFile::open`] memory-maps a file; [`GgufFile::tensor_f32`]
//! dequantizes one tensor straight from the map.
mod quant;
pub mod to_hf;
pub mod tokenizer;

pub use quant::{dequantize, dequantize_into, GgmlType};
pub use tokenizer::ChatTemplateSource;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// The most dimensions a GGML tensor has.
pub const MAX_DIMS: usize = 4;
/// `general.alignment` when the file does not set it.
pub const DEFAULT_ALIGNMENT: u64 = 32;

/// Why a GGUF file could not be read.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("not a GGUF file (magic {0:02x?}, expected \"GGUF\")")]
    BadMagic([u8; 4]),
    #[error("unsupported GGUF version {0} (versions 2 and 3 are supported)")]
    UnsupportedVersion(u32),
    #[error("file truncated at byte {offset}: {what} needs {need} bytes, {left} left")]
    Truncated { offset: usize, what: &'static str, need: u64, left: usize },
    #[error("{what} count {count} at byte {offset} cannot fit in the {left} bytes left")]
    CountTooLarge { what: &'static str, count: u64, offset: usize, left: usize },
    #[error("string at byte {offset} is not UTF-8")]
    InvalidUtf8 { offset: usize },
    #[error("metadata key {key:?}: unknown value type {ty}")]
    UnknownValueType { key: String, ty: u32 },
    #[error("metadata key {key:?} appears twice")]
    DuplicateKey { key: String },
    #[error("metadata key {key:?}: expected {expected}, found {found}")]
    MetadataType { key: String, expected: &'static str, found: &'static str },
    #[error("metadata key {key:?} is missing")]
    MissingKey { key: String },
    #[error("general.alignment {0} is not a positive power of two")]
    BadAlignment(u64),
    #[error("tensor {tensor:?}: unknown GGML type {ty}")]
    UnknownTensorType { tensor: String, ty: u32 },
    #[error("tensor {tensor:?}: GGML type {ty:?} cannot be dequantized by this crate")]
    UnsupportedTensorType { tensor: String, ty: GgmlType },
    #[error("tensor {tensor:?} appears twice")]
    DuplicateTensor { tensor: String },
    #[error("tensor {tensor:?}: {n_dims} dimensions (at most {MAX_DIMS})")]
    TooManyDims { tensor: String, n_dims: u32 },
    #[error("tensor {tensor:?}: dimensions {dims:?} {reason}")]
    BadShape { tensor: String, dims: Vec<u64>, reason: &'static str },
    #[error("tensor {tensor:?}: offset {offset} is not a multiple of the alignment {alignment}")]
    Misaligned { tensor: String, offset: u64, alignment: u64 },
    #[error("tensor {tensor:?}: bytes {offset}..{end} overrun the {data_len}-byte data section")]
    OutOfBounds { tensor: String, offset: u64, end: u64, data_len: u64 },
    #[error("no tensor named {0:?}")]
    NoSuchTensor(String),
    #[error("{0}")]
    Data(String),
}

pub type Result<T, E = GgufError> = std::result::Result<T, E>;

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum MetaValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Vec<MetaValue>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl MetaValue {
    /// The GGUF name of the value's type.
    pub fn type_name(&self) -> &'static str {
        match self {
            MetaValue::U8(_) => "uint8",
            MetaValue::I8(_) => "int8",
            MetaValue::U16(_) => "uint16",
            MetaValue::I16(_) => "int16",
            MetaValue::U32(_) => "uint32",
            MetaValue::I32(_) => "int32",
            MetaValue::F32(_) => "float32",
            MetaValue::Bool(_) => "bool",
            MetaValue::String(_) => "string",
            MetaValue::Array(_) => "array",
            MetaValue::U64(_) => "uint64",
            MetaValue::I64(_) => "int64",
            MetaValue::F64(_) => "float64",
        }
    }
    /// Any integer type as `u64` (negative values are `None`).
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            MetaValue::U8(v) => Some(v as u64),
            MetaValue::U16(v) => Some(v as u64),
            MetaValue::U32(v) => Some(v as u64),
            MetaValue::U64(v) => Some(v),
            MetaValue::I8(v) => u64::try_from(v).ok(),
            MetaValue::I16(v) => u64::try_from(v).ok(),
            MetaValue::I32(v) => u64::try_from(v).ok(),
            MetaValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }
    /// Any integer type as `i64` (`u64` beyond `i64::MAX` is `None`).
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            MetaValue::I8(v) => Some(v as i64),
            MetaValue::I16(v) => Some(v as i64),
            MetaValue::I32(v) => Some(v as i64),
            MetaValue::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }
    /// Any float or integer type as `f64`.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            MetaValue::F32(v) => Some(v as f64),
            MetaValue::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }
    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::String(s) => Some(s),
            _ => None,
        }
    }
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            MetaValue::Bool(b) => Some(b),
            _ => None,
        }
    }
    pub fn as_array(&self) -> Option<&[MetaValue]> {
        match self {
            MetaValue::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// One tensor's entry in the header.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    /// GGML order: `dims[0]` is the innermost (contiguous) axis. See [`TensorInfo::shape`].
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Offset from the start of the data section.
    pub offset: u64,
    /// Bytes of the tensor's data.
    pub n_bytes: u64,
}

impl TensorInfo {
    /// The row-major shape (`dims` reversed), as safetensors and MLX write it.
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }
}

/// A parsed header: version, metadata in file order, tensor infos, and where the data starts.
#[derive(Debug, Clone)]
pub struct GgufHeader {
    pub version: u32,
    pub metadata: Vec<(String, MetaValue)>,
    pub tensors: Vec<TensorInfo>,
    pub alignment: u64,
    /// Byte offset of the data section in the file.
    pub data_offset: u64,
    meta_index: HashMap<String, usize>,
    tensor_index: HashMap<String, usize>,
}

struct Reader<'a> {
    b: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn left(&self) -> usize {
        self.b.len() - self.pos
    }
    fn take(&mut self, n: u64, what: &'static str) -> Result<&'a [u8]> {
        if n > self.left() as u64 {
            return Err(GgufError::Truncated { offset: self.pos, what, need: n, left: self.left() });
        }
        let s = &self.b[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(s)
    }
    fn arr<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N]> {
        Ok(self.take(N as u64, what)?.try_into().expect("N bytes"))
    }
    fn u32(&mut self, what: &'static str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.arr(what)?))
    }
    fn u64(&mut self, what: &'static str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.arr(what)?))
    }
    /// A count of items of at least `min_item` bytes each, checked against what is left.
    fn count(&mut self, what: &'static str, min_item: u64) -> Result<u64> {
        let at = self.pos;
        let n = self.u64(what)?;
        if n.saturating_mul(min_item.max(1)) > self.left() as u64 {
            return Err(GgufError::CountTooLarge { what, count: n, offset: at, left: self.left() });
        }
        Ok(n)
    }
    fn string(&mut self, what: &'static str) -> Result<String> {
        let n = self.u64(what)?;
        let at = self.pos;
        let s = self.take(n, what)?;
        String::from_utf8(s.to_vec()).map_err(|_| GgufError::InvalidUtf8 { offset: at })
    }
    fn value(&mut self, key: &str, ty: u32, depth: u32) -> Result<MetaValue> {
        Ok(match ty {
            0 => MetaValue::U8(self.arr::<1>("uint8")?[0]),
            1 => MetaValue::I8(self.arr::<1>("int8")?[0] as i8),
            2 => MetaValue::U16(u16::from_le_bytes(self.arr("uint16")?)),
            3 => MetaValue::I16(i16::from_le_bytes(self.arr("int16")?)),
            4 => MetaValue::U32(self.u32("uint32")?),
            5 => MetaValue::I32(i32::from_le_bytes(self.arr("int32")?)),
            6 => MetaValue::F32(f32::from_le_bytes(self.arr("float32")?)),
            7 => MetaValue::Bool(self.arr::<1>("bool")?[0] != 0),
            8 => MetaValue::String(self.string("string value")?),
            9 => {
                // Nested arrays are legal; two levels is already more than any writer produces.
                if depth >= 2 {
                    return Err(GgufError::UnknownValueType { key: key.into(), ty });
                }
                let ety = self.u32("array type")?;
                let min = match ety {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    8 | 10..=12 => 8,
                    9 => 12,
                    _ => return Err(GgufError::UnknownValueType { key: key.into(), ty: ety }),
                };
                let n = self.count("array", min)?;
                let mut v = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    v.push(self.value(key, ety, depth + 1)?);
                }
                MetaValue::Array(v)
            }
            10 => MetaValue::U64(self.u64("uint64")?),
            11 => MetaValue::I64(i64::from_le_bytes(self.arr("int64")?)),
            12 => MetaValue::F64(f64::from_le_bytes(self.arr("float64")?)),
            _ => return Err(GgufError::UnknownValueType { key: key.into(), ty }),
        })
    }
}

impl GgufHeader {
    /// Parse the header of a GGUF file held in `bytes` (the whole file: tensor extents are
    /// checked against its length).
    pub fn parse(bytes: &[u8]) -> Result<Self> {
        let mut r = Reader { b: bytes, pos: 0 };
        let magic = r.arr::<4>("magic")?;
        if &magic != b"GGUF" {
            return Err(GgufError::BadMagic(magic));
        }
        let version = r.u32("version")?;
        if !(2..=3).contains(&version) {
            return Err(GgufError::UnsupportedVersion(version));
        }
        // A tensor info takes at least 8 (name) + 4 + 8 + 4 + 8 bytes; a key/value pair 8 + 4 + 1.
        let n_tensors = r.count("tensor", 32)?;
        let n_kv = r.count("metadata", 13)?;
        let mut metadata = Vec::with_capacity(n_kv as usize);
        let mut meta_index = HashMap::with_capacity(n_kv as usize);
        for _ in 0..n_kv {
            let key = r.string("metadata key")?;
            let ty = r.u32("value type")?;
            let v = r.value(&key, ty, 0)?;
            if meta_index.insert(key.clone(), metadata.len()).is_some() {
                return Err(GgufError::DuplicateKey { key });
            }
            metadata.push((key, v));
        }
        let alignment = match meta_index.get("general.alignment").map(|&i| &metadata[i].1) {
            None => DEFAULT_ALIGNMENT,
            Some(v) => match v.as_u64() {
                Some(a) if a > 0 && a.is_power_of_two() => a,
                Some(a) => return Err(GgufError::BadAlignment(a)),
                None => return Err(GgufError::MetadataType { key: "general.alignment".into(), expected: "an unsigned integer", found: v.type_name() }),
            },
        };
        let mut tensors = Vec::with_capacity(n_tensors as usize);
        let mut tensor_index = HashMap::with_capacity(n_tensors as usize);
        for _ in 0..n_tensors {
            let name = r.string("tensor name")?;
            let n_dims = r.u32("tensor dimension count")?;
            if n_dims as usize > MAX_DIMS {
                return Err(GgufError::TooManyDims { tensor: name, n_dims });
            }
            let dims = (0..n_dims).map(|_| r.u64("tensor dimension")).collect::<Result<Vec<_>>>()?;
            let raw_ty = r.u32("tensor type")?;
            let ty = GgmlType::from_u32(raw_ty).ok_or_else(|| GgufError::UnknownTensorType { tensor: name.clone(), ty: raw_ty })?;
            let offset = r.u64("tensor offset")?;
            let n = dims.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
            let n = n.ok_or_else(|| GgufError::BadShape { tensor: name.clone(), dims: dims.clone(), reason: "overflow: their product does not fit in 64 bits" })?;
            let (bs, ts) = ty.block();
            if dims.first().is_some_and(|&d0| d0 % bs != 0) {
                return Err(GgufError::BadShape { tensor: name, dims, reason: "do not fill whole blocks along the first axis" });
            }
            let n_bytes = (n / bs)
                .checked_mul(ts)
                .ok_or_else(|| GgufError::BadShape { tensor: name.clone(), dims: dims.clone(), reason: "overflow: their byte size does not fit in 64 bits" })?;
            if offset % alignment != 0 {
                return Err(GgufError::Misaligned { tensor: name, offset, alignment });
            }
            if tensor_index.insert(name.clone(), tensors.len()).is_some() {
                return Err(GgufError::DuplicateTensor { tensor: name });
            }
            tensors.push(TensorInfo { name, dims, ty, offset, n_bytes });
        }
        let data_offset = (r.pos as u64).div_ceil(alignment) * alignment;
        let data_len = (bytes.len() as u64).saturating_sub(data_offset);
        for t in &tensors {
            let end = t.offset.checked_add(t.n_bytes).unwrap_or(u64::MAX);
            if end > data_len {
                return Err(GgufError::OutOfBounds { tensor: t.name.clone(), offset: t.offset, end, data_len });
            }
        }
        Ok(GgufHeader { version, metadata, tensors, alignment, data_offset, meta_index, tensor_index })
    }

    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.meta_index.get(key).map(|&i| &self.metadata[i].1)
    }
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }
    /// `general.architecture`.
    pub fn architecture(&self) -> Result<&str> {
        self.get_str("general.architecture")
    }
    pub fn get_str(&self, key: &str) -> Result<&str> {
        let v = self.require(key)?;
        v.as_str().ok_or_else(|| GgufError::MetadataType { key: key.into(), expected: "a string", found: v.type_name() })
    }
    pub fn get_u64(&self, key: &str) -> Result<u64> {
        let v = self.require(key)?;
        v.as_u64().ok_or_else(|| GgufError::MetadataType { key: key.into(), expected: "an unsigned integer", found: v.type_name() })
    }
    pub fn get_f64(&self, key: &str) -> Result<f64> {
        let v = self.require(key)?;
        v.as_f64().ok_or_else(|| GgufError::MetadataType { key: key.into(), expected: "a number", found: v.type_name() })
    }
    pub fn get_array(&self, key: &str) -> Result<&[MetaValue]> {
        let v = self.require(key)?;
        v.as_array().ok_or_else(|| GgufError::MetadataType { key: key.into(), expected: "an array", found: v.type_name() })
    }
    fn require(&self, key: &str) -> Result<&MetaValue> {
        self.get(key).ok_or_else(|| GgufError::MissingKey { key: key.into() })
    }
}

/// A memory-mapped GGUF file.
pub struct GgufFile {
    map: memmap2::Mmap,
    pub header: GgufHeader,
    path: PathBuf,
}

impl GgufFile {
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let io = |source| GgufError::Io { path: path.clone(), source };
        let f = std::fs::File::open(&path).map_err(io)?;
        // SAFETY: the map is read-only; the file is not expected to change while it is open
        // (as with every mmap-based loader, a concurrent truncation is the caller's problem).
        let map = unsafe { memmap2::Mmap::map(&f) }.map_err(io)?;
        let header = GgufHeader::parse(&map)?;
        Ok(GgufFile { map, header, path })
    }
    pub fn path(&self) -> &Path {
        &self.path
    }
    /// The raw bytes of a tensor (a slice of the map).
    pub fn tensor_bytes(&self, t: &TensorInfo) -> &[u8] {
        let start = (self.header.data_offset + t.offset) as usize;
        &self.map[start..start + t.n_bytes as usize]
    }
    /// A tensor dequantized to f32, in row-major order of [`TensorInfo::shape`].
    pub fn tensor_f32(&self, name: &str) -> Result<Vec<f32>> {
        let t = self.header.tensor(name).ok_or_else(|| GgufError::NoSuchTensor(name.into()))?;
        dequantize(t.ty, self.tensor_bytes(t), t.n_elements() as usize)
            .map_err(|ty| GgufError::UnsupportedTensorType { tensor: t.name.clone(), ty })
    }
}
