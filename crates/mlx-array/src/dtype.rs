//! Element types.
use half::{bf16, f16};
use mlx_rs::Dtype as M;

/// The element types this crate exposes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F16,
    BF16,
    I32,
    U32,
    I64,
    U8,
    I8,
    Bool,
    /// MLX dtypes that models do not use, kept so that [`crate::Array::dtype`] is total.
    U16,
    U64,
    I16,
    F64,
    Complex64,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::I64 | DType::U64 | DType::F64 | DType::Complex64 => 8,
            DType::U16 | DType::I16 => 2,
            DType::U8 | DType::I8 | DType::Bool => 1,
        }
    }
    /// The name torch and transformers' config.json (`torch_dtype`, `dtype`) give this dtype.
    pub fn torch_name(self) -> &'static str {
        match self {
            DType::F32 => "float32",
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
            DType::F64 => "float64",
            DType::I32 => "int32",
            DType::U32 => "uint32",
            DType::I64 => "int64",
            DType::U8 => "uint8",
            DType::I8 => "int8",
            DType::Bool => "bool",
            DType::U16 => "uint16",
            DType::U64 => "uint64",
            DType::I16 => "int16",
            DType::Complex64 => "complex64",
        }
    }
    /// f32, f16 or bf16.
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F16 | DType::BF16 | DType::F64)
    }
    pub(crate) fn to_mlx(self) -> M {
        match self {
            DType::F32 => M::Float32,
            DType::F16 => M::Float16,
            DType::BF16 => M::Bfloat16,
            DType::I32 => M::Int32,
            DType::U32 => M::Uint32,
            DType::I64 => M::Int64,
            DType::U8 => M::Uint8,
            DType::I8 => M::Int8,
            DType::Bool => M::Bool,
            DType::U16 => M::Uint16,
            DType::U64 => M::Uint64,
            DType::I16 => M::Int16,
            DType::F64 => M::Float64,
            DType::Complex64 => M::Complex64,
        }
    }
    pub(crate) fn from_mlx(d: M) -> Self {
        match d {
            M::Float32 => DType::F32,
            M::Float16 => DType::F16,
            M::Bfloat16 => DType::BF16,
            M::Int32 => DType::I32,
            M::Uint32 => DType::U32,
            M::Int64 => DType::I64,
            M::Uint8 => DType::U8,
            M::Int8 => DType::I8,
            M::Bool => DType::Bool,
            M::Uint16 => DType::U16,
            M::Uint64 => DType::U64,
            M::Int16 => DType::I16,
            M::Float64 => DType::F64,
            M::Complex64 => DType::Complex64,
        }
    }
    /// The safetensors name of this dtype (`F32`, `BF16`, ...).
    pub fn safetensors_name(self) -> &'static str {
        match self {
            DType::F32 => "F32",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            DType::I32 => "I32",
            DType::U32 => "U32",
            DType::I64 => "I64",
            DType::U8 => "U8",
            DType::I8 => "I8",
            DType::Bool => "BOOL",
            DType::U16 => "U16",
            DType::U64 => "U64",
            DType::I16 => "I16",
            DType::F64 => "F64",
            DType::Complex64 => "C64",
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I32 => "i32",
            DType::U32 => "u32",
            DType::I64 => "i64",
            DType::U8 => "u8",
            DType::I8 => "i8",
            DType::Bool => "bool",
            DType::U16 => "u16",
            DType::U64 => "u64",
            DType::I16 => "i16",
            DType::F64 => "f64",
            DType::Complex64 => "complex64",
        })
    }
}

mod sealed {
    pub trait Sealed {}
}

/// Rust element types that map one-to-one onto a [`DType`].
pub trait Element:
    sealed::Sealed + Copy + Send + Sync + 'static + mlx_rs::ArrayElement
{
    const DTYPE: DType;
    #[doc(hidden)]
    fn make_array(data: &[Self], shape: &[i32]) -> mlx_rs::Array;
}

macro_rules! element {
    ($($t:ty => $d:ident),*) => {$(
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const DTYPE: DType = DType::$d;
            fn make_array(data: &[Self], shape: &[i32]) -> mlx_rs::Array { mlx_rs::Array::from_slice(data, shape) }
        }
    )*};
}
element!(f32 => F32, f16 => F16, bf16 => BF16, i32 => I32, u32 => U32, i64 => I64, u8 => U8, i8 => I8, bool => Bool);
