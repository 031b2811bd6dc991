//! Parquet datasets, converted to JSON lines as mlx-node's `convertParquetToJsonl` does: one
//! JSON object per row, the row's columns as keys in the file's column order. Nested columns
//! become nested values (structs: objects, lists: arrays, maps with string keys: objects, other
//! maps: arrays of `[key, value]`); binary values must be UTF-8 text; non-finite floats become
//! `null` (JSON has no NaN); dates, times, timestamps and decimals are written as their text.
//! Pages uncompressed or compressed with snappy (pandas' and pyarrow's default) are read; other
//! codecs are a typed error.
//!
//! A file that is not Parquet, is truncated or corrupt, or holds a value that has no JSON form
//! is a [`TrainError::Data`] naming the file (and the row), never a panic.
use crate::data::{parse_line, Example, TextEncoder};
use crate::error::{io_err, Result, TrainError};
use ::parquet::file::reader::{FileReader, SerializedFileReader};
use ::parquet::record::{Field, Row};
use serde_json::{Map, Value};
use std::path::Path;

/// What [`convert_parquet_to_jsonl`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConversionResult {
    /// Rows read (= lines written).
    pub rows: usize,
    /// Column names, in the file's order.
    pub columns: Vec<String>,
}

fn bad(path: &Path, row: usize, msg: impl Into<String>) -> TrainError {
    TrainError::Data { path: path.to_path_buf(), line: row, msg: msg.into() }
}

fn field_json(f: &Field) -> std::result::Result<Value, String> {
    Ok(match f {
        Field::Null => Value::Null,
        Field::Bool(b) => Value::Bool(*b),
        Field::Byte(v) => Value::from(*v),
        Field::Short(v) => Value::from(*v),
        Field::Int(v) => Value::from(*v),
        Field::Long(v) => Value::from(*v),
        Field::UByte(v) => Value::from(*v),
        Field::UShort(v) => Value::from(*v),
        Field::UInt(v) => Value::from(*v),
        Field::ULong(v) => Value::from(*v),
        Field::Float16(v) => serde_json::Number::from_f64(f64::from(*v)).map_or(Value::Null, Value::Number),
        Field::Float(v) => serde_json::Number::from_f64(*v as f64).map_or(Value::Null, Value::Number),
        Field::Double(v) => serde_json::Number::from_f64(*v).map_or(Value::Null, Value::Number),
        Field::Str(s) => Value::String(s.clone()),
        Field::Bytes(b) => Value::String(std::str::from_utf8(b.data()).map_err(|_| "a binary value that is not UTF-8 text".to_string())?.to_string()),
        Field::Group(row) => row_json(row)?,
        Field::ListInternal(list) => Value::Array(list.elements().iter().map(field_json).collect::<std::result::Result<_, _>>()?),
        Field::MapInternal(map) => {
            let entries = map.entries();
            if entries.iter().all(|(k, _)| matches!(k, Field::Str(_))) {
                let mut obj = Map::new();
                for (k, v) in entries {
                    if let Field::Str(k) = k {
                        obj.insert(k.clone(), field_json(v)?);
                    }
                }
                Value::Object(obj)
            } else {
                Value::Array(entries.iter().map(|(k, v)| Ok(Value::Array(vec![field_json(k)?, field_json(v)?]))).collect::<std::result::Result<_, String>>()?)
            }
        }
        // dates, times, timestamps, decimals: their text
        other => Value::String(other.to_string()),
    })
}

fn row_json(row: &Row) -> std::result::Result<Value, String> {
    let mut obj = Map::new();
    for (name, f) in row.get_column_iter() {
        obj.insert(name.clone(), field_json(f).map_err(|e| format!("column {name}: {e}"))?);
    }
    Ok(Value::Object(obj))
}

/// Every row of the Parquet file `path` as a JSON object (see the module docs), in order,
/// with the column names.
///
/// The `parquet` crate panics on some corrupt files (an `unwrap` in its metadata decoder, found
/// by tests/parquet.rs flipping bytes): such a panic is caught and returned as a
/// [`TrainError::Data`] (the panic hook still reports it on stderr).
pub fn read_parquet_rows(path: &Path) -> Result<(Vec<Value>, Vec<String>)> {
    let file = std::fs::File::open(path).map_err(io_err(path))?;
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| read_rows(path, file))) {
        Ok(r) => r,
        Err(p) => {
            let what = p.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| p.downcast_ref::<String>().cloned()).unwrap_or_default();
            Err(bad(path, 0, format!("corrupt Parquet file (the reader failed: {what})")))
        }
    }
}

fn read_rows(path: &Path, file: std::fs::File) -> Result<(Vec<Value>, Vec<String>)> {
    let reader = SerializedFileReader::new(file).map_err(|e| bad(path, 0, format!("not a readable Parquet file: {e}")))?;
    let columns: Vec<String> = reader.metadata().file_metadata().schema_descr().root_schema().get_fields().iter().map(|f| f.name().to_string()).collect();
    let rows = reader.get_row_iter(None).map_err(|e| bad(path, 0, format!("Parquet rows: {e}")))?;
    let mut out = Vec::new();
    for (i, row) in rows.enumerate() {
        let row = row.map_err(|e| bad(path, i + 1, format!("Parquet row: {e}")))?;
        out.push(row_json(&row).map_err(|e| bad(path, i + 1, e))?);
    }
    Ok((out, columns))
}

/// Convert the Parquet file `input` to JSON lines in `output` (written atomically), as
/// mlx-node's `convertParquetToJsonl`.
pub fn convert_parquet_to_jsonl(input: &Path, output: &Path) -> Result<ConversionResult> {
    let (rows, columns) = read_parquet_rows(input)?;
    let mut text = String::new();
    for r in &rows {
        text.push_str(&r.to_string());
        text.push('\n');
    }
    mlx_array::io::write_atomic(output, text.as_bytes())?;
    Ok(ConversionResult { rows: rows.len(), columns })
}

/// SFT examples from a Parquet file: each row read as a line of [`crate::load_jsonl`] (one of
/// the three dataset forms).
pub fn load_parquet(path: &Path, enc: &TextEncoder, max_len: Option<usize>) -> Result<Vec<Example>> {
    let (rows, _) = read_parquet_rows(path)?;
    let out = rows.iter().enumerate().map(|(i, r)| parse_line(&r.to_string(), enc, max_len).map_err(|msg| bad(path, i + 1, msg))).collect::<Result<Vec<_>>>()?;
    if out.is_empty() {
        return Err(bad(path, 0, "no examples"));
    }
    Ok(out)
}

/// [`load_parquet`] for `.parquet` files, [`crate::load_jsonl`] otherwise.
pub fn load_dataset(path: &Path, enc: &TextEncoder, max_len: Option<usize>) -> Result<Vec<Example>> {
    if path.extension().is_some_and(|e| e.eq_ignore_ascii_case("parquet")) {
        load_parquet(path, enc, max_len)
    } else {
        crate::load_jsonl(path, enc, max_len)
    }
}
