//! Safetensors round trips and every typed error.
use mlx_array::io::{self, Checkpoint, SafetensorsFile, TensorInfo};
use mlx_array::{bf16, f16, Array, DType, Error};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

fn all_dtypes() -> Vec<(&'static str, Array)> {
    vec![
        ("f32", Array::from_slice(&[1.5f32, -2.0, 3.25, 0.0, 1e-3, 7.0], &[2, 3]).unwrap()),
        ("f16", Array::from_slice(&[f16::from_f32(0.5), f16::from_f32(-8.0)], &[2]).unwrap()),
        ("bf16", Array::from_slice(&[bf16::from_f32(1.0), bf16::from_f32(-3.0), bf16::from_f32(96.0)], &[3, 1]).unwrap()),
        ("i32", Array::from_slice(&[i32::MIN, -1, 0, i32::MAX], &[4]).unwrap()),
        ("i64", Array::from_slice(&[i64::MIN, 5], &[1, 2]).unwrap()),
        ("u8", Array::from_slice(&[0u8, 255, 7], &[3]).unwrap()),
        ("i8", Array::from_slice(&[-128i8, 127], &[2]).unwrap()),
        ("u32", Array::from_slice(&[u32::MAX, 1], &[2]).unwrap()),
        ("bool", Array::from_slice(&[true, false, true], &[3]).unwrap()),
        ("scalar", Array::scalar(42.0f32)),
        ("empty", Array::zeros(&[0, 4], DType::F32).unwrap()),
    ]
}

fn same(a: &Array, b: &Array) {
    assert_eq!(a.shape(), b.shape());
    assert_eq!(a.dtype(), b.dtype());
    let (x, y) = (a.astype(DType::F32).unwrap(), b.astype(DType::F32).unwrap());
    if a.dtype() == DType::I64 || a.dtype() == DType::U32 || a.dtype() == DType::I32 {
        let (x, y) = (a.astype(DType::I64).unwrap(), b.astype(DType::I64).unwrap());
        assert_eq!(x.to_vec::<i64>().unwrap(), y.to_vec::<i64>().unwrap());
    } else {
        assert_eq!(x.to_vec::<f32>().unwrap(), y.to_vec::<f32>().unwrap());
    }
}

/// [`all_dtypes`] saved (with `meta`) as `m.safetensors` in a new temporary directory; returns
/// the directory, the file and the arrays.
fn saved_all_dtypes(meta: Option<&HashMap<String, String>>) -> (tempfile::TempDir, PathBuf, Vec<(&'static str, Array)>) {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("m.safetensors");
    let ts = all_dtypes();
    let refs: Vec<(&str, &Array)> = ts.iter().map(|(n, a)| (*n, a)).collect();
    io::save_safetensors(&p, &refs, meta).unwrap();
    (dir, p, ts)
}

#[test]
fn roundtrip_every_dtype_with_metadata() {
    let meta: HashMap<String, String> = [("format".to_string(), "mlx".to_string())].into();
    let (_dir, p, ts) = saved_all_dtypes(Some(&meta));
    let f = SafetensorsFile::open(&p).unwrap();
    assert_eq!(f.metadata(), &meta);
    let infos = f.tensors();
    assert_eq!(infos.len(), ts.len());
    assert!(infos.contains(&TensorInfo { name: "bf16".into(), dtype: DType::BF16, shape: vec![3, 1] }));
    let loaded = f.load_all(None).unwrap();
    for (n, a) in &ts {
        same(a, &loaded[*n]);
    }
    // A transposed (non-contiguous) array is written in logical order.
    let t = ts[0].1.transpose(&[1, 0]).unwrap();
    io::save_safetensors(&p, &[("t", &t)], None).unwrap();
    assert_eq!(io::load_safetensors(&p, None).unwrap()["t"].to_vec::<f32>().unwrap(), t.to_vec::<f32>().unwrap());
    // So is a broadcast (zero-stride) one.
    let b = Array::scalar(2.5f32).broadcast_to(&[2, 3]).unwrap();
    io::save_safetensors(&p, &[("b", &b)], None).unwrap();
    assert_eq!(io::load_safetensors(&p, None).unwrap()["b"].to_vec::<f32>().unwrap(), vec![2.5; 6]);
}

#[test]
fn upcast_and_selected() {
    let (_dir, p, _) = saved_all_dtypes(None);
    let ck = Checkpoint::open(&p).unwrap();
    let got = ck.load_selected(&["bf16", "f16", "i32"], Some(DType::F32)).unwrap();
    assert_eq!(got.len(), 3);
    assert_eq!(got["bf16"].dtype(), DType::F32);
    assert_eq!(got["bf16"].to_vec::<f32>().unwrap(), vec![1.0, -3.0, 96.0]);
    assert_eq!(got["f16"].to_vec::<f32>().unwrap(), vec![0.5, -8.0]);
    assert_eq!(got["i32"].dtype(), DType::I32, "integers are never converted");
    assert!(matches!(ck.load_selected(&["f32", "nope"], None), Err(Error::MissingTensor { name, .. }) if name == "nope"));
    assert!(matches!(ck.load("f32", Some(DType::I32)), Err(Error::DType { .. })));
}

fn write_shards(dir: &Path) {
    let a = Array::arange(0, 6, DType::F32).unwrap().reshape(&[2, 3]).unwrap();
    let b = Array::from_slice(&[bf16::from_f32(2.0)], &[1]).unwrap();
    let c = Array::from_slice(&[9i64], &[1]).unwrap();
    io::save_safetensors(dir.join("model-00001-of-00002.safetensors"), &[("a", &a), ("b", &b)], None).unwrap();
    io::save_safetensors(dir.join("model-00002-of-00002.safetensors"), &[("c", &c)], None).unwrap();
    let index = r#"{"metadata": {"total_size": 34}, "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00001-of-00002.safetensors", "c": "model-00002-of-00002.safetensors"}}"#;
    std::fs::write(dir.join(io::INDEX_FILE), index).unwrap();
}

#[test]
fn sharded_index_and_dir() {
    let dir = tempfile::tempdir().unwrap();
    write_shards(dir.path());
    for p in [dir.path().to_path_buf(), dir.path().join(io::INDEX_FILE)] {
        let ck = Checkpoint::open(&p).unwrap();
        assert_eq!(ck.files().len(), 2);
        let names: Vec<String> = ck.tensors().into_iter().map(|t| t.name).collect();
        assert_eq!(names, ["a", "b", "c"]);
        let all = io::load_dir(&p, Some(DType::F32)).unwrap();
        assert_eq!(all["a"].to_vec::<f32>().unwrap(), vec![0., 1., 2., 3., 4., 5.]);
        assert_eq!(all["b"].to_vec::<f32>().unwrap(), vec![2.0]);
        assert_eq!(all["c"].to_vec::<i64>().unwrap(), vec![9]);
    }
    // Without an index, a directory's files are merged.
    std::fs::remove_file(dir.path().join(io::INDEX_FILE)).unwrap();
    assert_eq!(io::list_tensors(dir.path()).unwrap().len(), 3);
}

#[test]
fn sharded_errors() {
    let dir = tempfile::tempdir().unwrap();
    write_shards(dir.path());
    let idx = dir.path().join(io::INDEX_FILE);
    std::fs::write(&idx, r#"{"weight_map": {"a": "model-00001-of-00002.safetensors", "z": "missing.safetensors"}}"#).unwrap();
    match Checkpoint::open(&idx) {
        Err(Error::MissingShard { shard, .. }) => assert!(shard.ends_with("missing.safetensors")),
        other => panic!("{other:?}"),
    }
    std::fs::write(&idx, r#"{"weight_map": {"q": "model-00001-of-00002.safetensors"}}"#).unwrap();
    assert!(matches!(Checkpoint::open(&idx), Err(Error::MissingTensor { name, .. }) if name == "q"));
    std::fs::write(&idx, r#"{"weight_map": 3}"#).unwrap();
    assert!(matches!(Checkpoint::open(&idx), Err(Error::Safetensors { .. })));
}

fn raw_file(header: &str, data: &[u8]) -> Vec<u8> {
    let mut v = (header.len() as u64).to_le_bytes().to_vec();
    v.extend_from_slice(header.as_bytes());
    v.extend_from_slice(data);
    v
}

#[test]
fn file_errors_are_typed() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("x.safetensors");
    match SafetensorsFile::open(dir.path().join("absent.safetensors")) {
        Err(Error::Io { source, .. }) => assert_eq!(source.kind(), std::io::ErrorKind::NotFound),
        other => panic!("{other:?}"),
    }
    // Shorter than the length prefix.
    std::fs::write(&p, [1u8, 2, 3]).unwrap();
    assert!(matches!(SafetensorsFile::open(&p), Err(Error::Truncated { expected: 8, actual: 3, .. })));
    // Header longer than the file.
    std::fs::write(&p, &raw_file("{}", &[])[..9]).unwrap();
    assert!(matches!(SafetensorsFile::open(&p), Err(Error::Truncated { expected: 10, actual: 9, .. })));
    // Data shorter than the header promises.
    let h = r#"{"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}}"#;
    std::fs::write(&p, raw_file(h, &[0u8; 12])).unwrap();
    match SafetensorsFile::open(&p) {
        Err(Error::Truncated { expected, actual, .. }) => assert_eq!((expected, actual), (8 + h.len() as u64 + 16, 8 + h.len() as u64 + 12)),
        other => panic!("{other:?}"),
    }
    // A real file cut short.
    let w = Array::ones(&[16, 16], DType::F32).unwrap();
    io::save_safetensors(&p, &[("w", &w)], None).unwrap();
    let full = std::fs::read(&p).unwrap();
    std::fs::write(&p, &full[..full.len() - 100]).unwrap();
    assert!(matches!(SafetensorsFile::open(&p), Err(Error::Truncated { .. })));
    // Bad JSON.
    std::fs::write(&p, raw_file("{\"w\": [", &[])).unwrap();
    assert!(matches!(SafetensorsFile::open(&p), Err(Error::Safetensors { msg, .. }) if msg.contains("JSON")));
    // Unknown dtype.
    let h = r#"{"w":{"dtype":"F8_E5M2","shape":[2],"data_offsets":[0,2]}}"#;
    std::fs::write(&p, raw_file(h, &[0u8; 2])).unwrap();
    assert!(matches!(SafetensorsFile::open(&p), Err(Error::UnknownDType { dtype, name, .. }) if dtype == "F8_E5M2" && name == "w"));
    // FP8 e4m3 loads as its raw bytes (MLX has no fp8 dtype; model loaders decode it).
    let h = r#"{"w":{"dtype":"F8_E4M3","shape":[2],"data_offsets":[0,2]}}"#;
    std::fs::write(&p, raw_file(h, &[0x38u8, 0x7e])).unwrap();
    let f = SafetensorsFile::open(&p).unwrap();
    let a = f.load("w", Some(DType::F32)).unwrap();
    assert_eq!((a.dtype(), a.to_vec::<u8>().unwrap()), (DType::U8, vec![0x38, 0x7e]));
    // Shape that does not match its byte range.
    let h = r#"{"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}"#;
    std::fs::write(&p, raw_file(h, &[0u8; 8])).unwrap();
    assert!(matches!(SafetensorsFile::open(&p), Err(Error::Safetensors { .. })));
    // Missing tensor.
    io::save_safetensors(&p, &[("w", &w)], None).unwrap();
    assert!(matches!(SafetensorsFile::open(&p).unwrap().load("v", None), Err(Error::MissingTensor { .. })));
}

#[test]
fn unaligned_data_loads() {
    // A hand-written header of odd length puts the f32 data at an odd address in the map.
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("u.safetensors");
    let h = r#"{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}} "#;
    assert!(h.len() % 4 != 0);
    let data: Vec<u8> = [1.5f32, -2.5].iter().flat_map(|x| x.to_le_bytes()).collect();
    std::fs::write(&p, raw_file(h, &data)).unwrap();
    assert_eq!(io::load_safetensors(&p, None).unwrap()["w"].to_vec::<f32>().unwrap(), vec![1.5, -2.5]);
}

#[test]
fn null_metadata_is_empty_and_bad_metadata_is_typed() {
    // MLX's `mx.save_safetensors` (and so mlx-lm's tools) write `"__metadata__": null` when no
    // metadata is given; such files must load.
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("n.safetensors");
    let data: Vec<u8> = [1.5f32, -2.5].iter().flat_map(|x| x.to_le_bytes()).collect();
    let h = r#"{"__metadata__":null,"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#;
    std::fs::write(&p, raw_file(h, &data)).unwrap();
    let f = SafetensorsFile::open(&p).unwrap();
    assert!(f.metadata().is_empty());
    assert_eq!(f.load("w", None).unwrap().to_vec::<f32>().unwrap(), vec![1.5, -2.5]);
    // Anything else that is not a string map is still refused.
    let h = r#"{"__metadata__":{"format":3},"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#;
    std::fs::write(&p, raw_file(h, &data)).unwrap();
    assert!(matches!(SafetensorsFile::open(&p), Err(Error::Safetensors { msg, .. }) if msg.contains("__metadata__")));
}

#[test]
fn save_is_atomic_and_validated() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("m.safetensors");
    let a = Array::ones(&[4], DType::F32).unwrap();
    io::save_safetensors(&p, &[("a", &a)], None).unwrap();
    let before = std::fs::read(&p).unwrap();
    // Failing saves leave the old file and no temporary behind.
    assert!(matches!(io::save_safetensors(&p, &[("a", &a), ("a", &a)], None), Err(Error::InvalidArgument { .. })));
    let c = Array::ones(&[2], DType::F32).unwrap().astype(DType::Complex64).unwrap();
    assert!(matches!(io::save_safetensors(&p, &[("b", &a), ("c", &c)], None), Err(Error::DType { .. })));
    assert!(matches!(io::save_safetensors(dir.path().join("no/such/dir/x.safetensors"), &[("a", &a)], None), Err(Error::Io { .. })));
    assert_eq!(std::fs::read(&p).unwrap(), before);
    let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names, vec![std::ffi::OsString::from("m.safetensors")]);
    // Overwrite replaces.
    let b = Array::zeros(&[3], DType::I32).unwrap();
    io::save_safetensors(&p, &[("b", &b)], None).unwrap();
    let ck = Checkpoint::open(&p).unwrap();
    assert!(!ck.contains("a") && ck.contains("b"));
}

/// The same tensors and metadata give the same bytes, whatever order the metadata map iterates
/// in (each `HashMap` has its own random order): resumable training compares files byte for byte.
#[test]
fn writes_are_deterministic() {
    let dir = tempfile::tempdir().unwrap();
    let tensors = all_dtypes();
    let refs: Vec<(&str, &Array)> = tensors.iter().map(|(n, a)| (*n, a)).collect();
    let files: Vec<Vec<u8>> = (0..6)
        .map(|i| {
            let meta: HashMap<String, String> = (0..12).map(|k| (format!("key{k}"), format!("value{k}"))).collect();
            let p = dir.path().join(format!("f{i}.safetensors"));
            io::save_safetensors(&p, &refs, Some(&meta)).unwrap();
            std::fs::read(&p).unwrap()
        })
        .collect();
    assert!(files.iter().all(|f| f == &files[0]), "the same content written six times gave different bytes");
    let back = SafetensorsFile::open(dir.path().join("f0.safetensors")).unwrap();
    assert_eq!(back.metadata().len(), 12);
}
