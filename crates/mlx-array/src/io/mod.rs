//! Safetensors weights I/O: memory-mapped reading of single and sharded checkpoints, and atomic
//! writing.
//!
//! ```
//! use mlx_array::{io, Array, DType};
//! # fn main() -> mlx_array::Result<()> {
//! # let dir = std::env::temp_dir().join(format!("mlx-array-doc-{}", std::process::id()));
//! # std::fs::create_dir_all(&dir).unwrap();
//! let path = dir.join("w.safetensors");
//! let w = Array::from_slice(&[1.0f32, 2., 3., 4.], &[2, 2])?.astype(DType::BF16)?;
//! io::save_safetensors(&path, &[("w", &w)], None)?;
//! let info = io::list_tensors(&path)?;
//! assert_eq!((info[0].name.as_str(), info[0].dtype, info[0].shape.clone()), ("w", DType::BF16, vec![2, 2]));
//! let loaded = io::load_safetensors(&path, Some(DType::F32))?; // upcast floats at load
//! assert_eq!(loaded["w"].to_vec::<f32>()?, vec![1., 2., 3., 4.]);
//! # std::fs::remove_dir_all(&dir).unwrap();
//! # Ok(()) }
//! ```
mod read;
mod write;

pub use read::{list_tensors, load_dir, load_safetensors, Checkpoint, SafetensorsFile, TensorInfo, INDEX_FILE};
pub use write::{save_safetensors, write_atomic, write_atomic_with};

use crate::DType;

/// Our dtype for a safetensors dtype name, if this crate loads it.
fn dtype_from_name(name: &str) -> Option<DType> {
    Some(match name {
        "F32" => DType::F32,
        "F16" => DType::F16,
        "BF16" => DType::BF16,
        "I32" => DType::I32,
        "U32" => DType::U32,
        "I64" => DType::I64,
        "U8" => DType::U8,
        "I8" => DType::I8,
        "BOOL" => DType::Bool,
        "U16" => DType::U16,
        "I16" => DType::I16,
        "U64" => DType::U64,
        "F64" => DType::F64,
        // MLX has no fp8 dtype: FP8 (e4m3fn) tensors load as their raw bytes, for the model
        // loader to decode with their scales.
        "F8_E4M3" => DType::U8,
        _ => return None,
    })
}

fn to_st_dtype(d: DType) -> Option<safetensors::Dtype> {
    use safetensors::Dtype as S;
    Some(match d {
        DType::F32 => S::F32,
        DType::F16 => S::F16,
        DType::BF16 => S::BF16,
        DType::I32 => S::I32,
        DType::U32 => S::U32,
        DType::I64 => S::I64,
        DType::U8 => S::U8,
        DType::I8 => S::I8,
        DType::Bool => S::BOOL,
        DType::U16 => S::U16,
        DType::I16 => S::I16,
        DType::U64 => S::U64,
        DType::F64 => S::F64,
        DType::Complex64 => return None,
    })
}
