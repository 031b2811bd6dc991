//! Safetensors parsing of untrusted bytes: mutated valid files and headers built from arbitrary
//! values (huge offsets and dims, unknown dtypes, wrong types) open with a typed error or open
//! and load, never panic. 10,000 cases each.
use mlx_array::io::{save_safetensors, SafetensorsFile};
use mlx_array::Array;
use proptest::prelude::*;
use std::path::Path;

fn valid_file(dir: &Path) -> Vec<u8> {
    let a = Array::from_slice(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3]).unwrap();
    let b = Array::from_slice(&[7i32, 8], &[2]).unwrap();
    let p = dir.join("valid.safetensors");
    let meta = [("format".to_string(), "pt".to_string())].into();
    save_safetensors(&p, &[("a", &a), ("b.weight", &b)], Some(&meta)).unwrap();
    std::fs::read(&p).unwrap()
}

/// Open `bytes` as a file; when it opens, load every tensor (each must succeed or fail typed).
fn exercise(path: &Path, bytes: &[u8]) {
    std::fs::write(path, bytes).unwrap();
    if let Ok(f) = SafetensorsFile::open(path) {
        for t in f.tensors() {
            if let Ok(a) = f.load(&t.name, None) {
                assert_eq!(a.shape(), t.shape);
            }
        }
    }
}

fn header_file(header: &str, data_len: usize) -> Vec<u8> {
    let mut v = (header.len() as u64).to_le_bytes().to_vec();
    v.extend_from_slice(header.as_bytes());
    v.resize(v.len() + data_len, 0x3f);
    v
}

fn any_u64() -> impl Strategy<Value = u64> {
    prop_oneof![0u64..64, Just(u64::MAX), Just(u64::MAX - 7), Just(1u64 << 63), Just(u32::MAX as u64 + 1), any::<u64>()]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 10_000, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn mutated_files_never_panic(flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..6),
                                 cut in prop::option::of(any::<prop::sample::Index>()),
                                 len_override in prop::option::of(any_u64())) {
        let dir = tempfile::tempdir().unwrap();
        let mut bytes = valid_file(dir.path());
        for (i, b) in flips {
            let n = bytes.len();
            bytes[i.index(n)] = b;
        }
        if let Some(l) = len_override {
            bytes[..8].copy_from_slice(&l.to_le_bytes());
        }
        if let Some(c) = cut {
            let n = bytes.len();
            bytes.truncate(c.index(n + 1));
        }
        exercise(&dir.path().join("m.safetensors"), &bytes);
    }

    #[test]
    fn arbitrary_headers_never_panic(dtype in prop_oneof![Just("F32"), Just("BF16"), Just("I64"), Just("U8"), Just("BOOL"), Just("F8_E4M3"), Just("Q4"), Just("")],
                                     shape in prop::collection::vec(any_u64(), 0..4),
                                     begin in any_u64(), end in any_u64(),
                                     data_len in 0usize..64,
                                     meta_kind in 0u8..4,
                                     consistent in any::<bool>()) {
        // Half the cases make `end - begin` match the dtype and shape, so the offsets' own
        // bounds (not the size check) are what must hold.
        let size = match dtype { "F32" => 4u64, "BF16" => 2, "I64" => 8, "U8" | "BOOL" | "F8_E4M3" => 1, _ => 1 };
        let bytes = shape.iter().try_fold(size, |a, &d| a.checked_mul(d));
        let end = match (consistent, bytes.and_then(|n| begin.checked_add(n))) {
            (true, Some(e)) => e,
            _ => end,
        };
        let meta = match meta_kind {
            0 => String::new(),
            1 => r#""__metadata__": {"k": "v"}, "#.to_string(),
            2 => r#""__metadata__": {"k": 3}, "#.to_string(),
            _ => r#""__metadata__": null, "#.to_string(),
        };
        let header = format!(r#"{{{meta}"t": {{"dtype": "{dtype}", "shape": {shape:?}, "data_offsets": [{begin}, {end}]}}}}"#);
        let dir = tempfile::tempdir().unwrap();
        exercise(&dir.path().join("h.safetensors"), &header_file(&header, data_len));
    }
}
