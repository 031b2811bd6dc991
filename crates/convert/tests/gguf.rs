//! The GGUF reader against references made by `scripts/gguf_reference.py` with the `gguf`
//! PyPI package, and against malformed input.
use std::path::PathBuf;

use mlx_convert::gguf::{dequantize, GgmlType, GgufError, GgufFile, GgufHeader, MetaValue};
use proptest::prelude::*;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn type_by_name(name: &str) -> GgmlType {
    (0..64).filter_map(GgmlType::from_u32).find(|t| format!("{t:?}") == name).unwrap_or_else(|| panic!("no type {name}"))
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
}

#[test]
fn dequantization_is_bit_exact_against_gguf_py() {
    let dir = fixtures().join("quants");
    let mut checked = Vec::new();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) != Some("bin") {
            continue;
        }
        let name = path.file_stem().unwrap().to_str().unwrap().to_string();
        let ty = type_by_name(&name);
        let raw = std::fs::read(&path).unwrap();
        let want = f32s(&std::fs::read(path.with_extension("f32")).unwrap());
        let got = dequantize(ty, &raw, want.len()).unwrap_or_else(|t| panic!("{t:?} not supported"));
        assert_eq!(got.len(), want.len(), "{name}");
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()), "{name}[{i}]: {g} vs gguf-py {w}");
        }
        checked.push(name);
    }
    checked.sort();
    for required in [
        "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "MXFP4",
        "TQ1_0", "TQ2_0", "IQ4_NL", "IQ4_XS", "NVFP4",
    ] {
        assert!(checked.iter().any(|c| c == required), "no reference for {required}: {checked:?}");
    }
}

#[test]
fn types_without_a_decoder_are_named_in_the_error() {
    for ty in [GgmlType::IQ2_XXS, GgmlType::IQ1_S, GgmlType::IQ3_S, GgmlType::Q8_K] {
        assert!(!ty.can_dequantize());
        let (bs, ts) = ty.block();
        assert_eq!(dequantize(ty, &vec![0u8; ts as usize], bs as usize), Err(ty));
    }
}

#[test]
fn reads_every_metadata_type_and_tensor_info() {
    let f = GgufFile::open(fixtures().join("tiny-llama.gguf")).unwrap();
    let h = &f.header;
    assert_eq!(h.version, 3);
    assert_eq!(h.architecture().unwrap(), "llama");
    assert_eq!(h.get("test.u8"), Some(&MetaValue::U8(200)));
    assert_eq!(h.get("test.i8"), Some(&MetaValue::I8(-100)));
    assert_eq!(h.get("test.u16"), Some(&MetaValue::U16(60000)));
    assert_eq!(h.get("test.i16"), Some(&MetaValue::I16(-30000)));
    assert_eq!(h.get("test.i32"), Some(&MetaValue::I32(-2_000_000_000)));
    assert_eq!(h.get("test.i64"), Some(&MetaValue::I64(-(1 << 40))));
    assert_eq!(h.get("test.u64"), Some(&MetaValue::U64(1 << 50)));
    assert_eq!(h.get("test.f64"), Some(&MetaValue::F64(0.1)));
    assert_eq!(h.get("test.bool"), Some(&MetaValue::Bool(true)));
    assert_eq!(h.get_u64("llama.block_count").unwrap(), 2);
    assert_eq!(h.get_f64("llama.rope.freq_base").unwrap(), 10000.0);
    let floats: Vec<f64> = h.get_array("test.f32s").unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
    assert_eq!(floats, vec![0.5, -1.25, 3.0]);
    let tokens = h.get_array("tokenizer.ggml.tokens").unwrap();
    assert_eq!(tokens[1].as_str(), Some("<|im_start|>"));
    assert!(matches!(h.get_str("test.u8"), Err(GgufError::MetadataType { .. })));
    assert!(matches!(h.get_str("no.such.key"), Err(GgufError::MissingKey { .. })));

    let emb = h.tensor("token_embd.weight").unwrap();
    assert_eq!(emb.ty, GgmlType::Q8_0);
    assert_eq!(emb.shape(), vec![273, 32]);
    assert_eq!(emb.n_bytes, 273 * 34);
    assert_eq!(h.tensor("blk.0.attn_v.weight").unwrap().ty, GgmlType::BF16);
    assert!(matches!(f.tensor_f32("nope"), Err(GgufError::NoSuchTensor(_))));
    // Unpermuted tensors equal gguf-py's dequantization directly.
    let reference = std::fs::read(fixtures().join("tiny-llama.reference.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&reference).unwrap();
    for (gguf_name, hf_name) in [
        ("token_embd.weight", "model.embed_tokens.weight"),
        ("output.weight", "lm_head.weight"),
        ("blk.0.attn_v.weight", "model.layers.0.self_attn.v_proj.weight"),
        ("blk.1.ffn_down.weight", "model.layers.1.mlp.down_proj.weight"),
    ] {
        let got = f.tensor_f32(gguf_name).unwrap();
        let want = f32s(st.tensor(hf_name).unwrap().data());
        assert_eq!(got, want, "{gguf_name}");
    }
}

/// A minimal GGUF v3 writer for malformed-input tests.
#[derive(Clone)]
struct Builder {
    version: u32,
    kv: Vec<u8>,
    n_kv: u64,
    tensors: Vec<u8>,
    n_tensors: u64,
    data: Vec<u8>,
}

impl Builder {
    fn new() -> Self {
        Builder { version: 3, kv: vec![], n_kv: 0, tensors: vec![], n_tensors: 0, data: vec![] }
    }
    fn str_bytes(s: &[u8]) -> Vec<u8> {
        let mut v = (s.len() as u64).to_le_bytes().to_vec();
        v.extend_from_slice(s);
        v
    }
    fn kv_u32(mut self, key: &str, v: u32) -> Self {
        self.kv.extend(Self::str_bytes(key.as_bytes()));
        self.kv.extend(4u32.to_le_bytes());
        self.kv.extend(v.to_le_bytes());
        self.n_kv += 1;
        self
    }
    fn kv_str(mut self, key: &str, v: &[u8]) -> Self {
        self.kv.extend(Self::str_bytes(key.as_bytes()));
        self.kv.extend(8u32.to_le_bytes());
        self.kv.extend(Self::str_bytes(v));
        self.n_kv += 1;
        self
    }
    fn kv_str_array(mut self, key: &str, items: &[&str]) -> Self {
        self.kv.extend(Self::str_bytes(key.as_bytes()));
        self.kv.extend(9u32.to_le_bytes());
        self.kv.extend(8u32.to_le_bytes());
        self.kv.extend((items.len() as u64).to_le_bytes());
        for s in items {
            self.kv.extend(Self::str_bytes(s.as_bytes()));
        }
        self.n_kv += 1;
        self
    }
    fn tensor(mut self, name: &str, dims: &[u64], ty: u32, offset: u64) -> Self {
        self.tensors.extend(Self::str_bytes(name.as_bytes()));
        self.tensors.extend((dims.len() as u32).to_le_bytes());
        for d in dims {
            self.tensors.extend(d.to_le_bytes());
        }
        self.tensors.extend(ty.to_le_bytes());
        self.tensors.extend(offset.to_le_bytes());
        self.n_tensors += 1;
        self
    }
    fn data(mut self, n: usize) -> Self {
        self.data = (0..n).map(|i| (i * 7 % 251) as u8).collect();
        self
    }
    fn build(&self) -> Vec<u8> {
        let mut b = b"GGUF".to_vec();
        b.extend(self.version.to_le_bytes());
        b.extend(self.n_tensors.to_le_bytes());
        b.extend(self.n_kv.to_le_bytes());
        b.extend(&self.kv);
        b.extend(&self.tensors);
        while b.len() % 32 != 0 {
            b.push(0);
        }
        b.extend(&self.data);
        b
    }
}

fn valid() -> Builder {
    Builder::new()
        .kv_str("general.architecture", b"llama")
        .kv_u32("llama.block_count", 1)
        .kv_str_array("tokenizer.ggml.tokens", &["a", "b", "c"])
        .tensor("a", &[32, 2], 0, 0)
        .tensor("b", &[32], 8, 256)
        .data(256 + 34)
}

#[test]
fn the_hand_built_file_is_valid() {
    let h = GgufHeader::parse(&valid().build()).unwrap();
    assert_eq!(h.tensors.len(), 2);
    assert_eq!(h.tensor("b").unwrap().n_bytes, 34);
}

#[test]
fn malformed_files_give_typed_errors() {
    let good = valid().build();
    let e = |b: &[u8]| GgufHeader::parse(b).unwrap_err();
    let mut bad = good.clone();
    bad[0] = b'X';
    assert!(matches!(e(&bad), GgufError::BadMagic(_)));
    assert!(matches!(e(&Builder { version: 1, ..valid() }.build()), GgufError::UnsupportedVersion(1)));
    assert!(matches!(e(&Builder { version: 4, ..valid() }.build()), GgufError::UnsupportedVersion(4)));
    assert!(matches!(e(&good[..3]), GgufError::Truncated { .. }));
    assert!(matches!(e(&good[..40]), GgufError::Truncated { .. } | GgufError::CountTooLarge { .. }));
    let one = Builder::new().kv_str("key", b"a value").build();
    assert!(matches!(e(&one[..24 + 8 + 3 + 4 + 8 + 5]), GgufError::Truncated { what: "string value", .. }));
    // Lying counts are rejected before anything is allocated for them.
    let mut lie = good.clone();
    lie[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(matches!(e(&lie), GgufError::CountTooLarge { what: "tensor", .. }));
    let mut lie = good.clone();
    lie[16..24].copy_from_slice(&(1u64 << 40).to_le_bytes());
    assert!(matches!(e(&lie), GgufError::CountTooLarge { what: "metadata", .. }));
    let arr = Builder::new().kv_str_array("k", &["x"]).build();
    let mut lie = arr.clone();
    let at = 24 + 8 + 1 + 4 + 4; // the array's count
    lie[at..at + 8].copy_from_slice(&(1u64 << 60).to_le_bytes());
    assert!(matches!(e(&lie), GgufError::CountTooLarge { what: "array", .. }));
    let mut long = arr.clone();
    long[24..32].copy_from_slice(&(1u64 << 62).to_le_bytes());
    assert!(matches!(e(&long), GgufError::Truncated { .. }));

    assert!(matches!(e(&Builder::new().kv_str("k", b"\xff\xfe").build()), GgufError::InvalidUtf8 { .. }));
    assert!(matches!(e(&Builder::new().kv_u32("k", 1).kv_u32("k", 2).build()), GgufError::DuplicateKey { .. }));
    assert!(matches!(e(&valid().kv_u32("general.alignment", 24).build()), GgufError::BadAlignment(24)));
    assert!(matches!(e(&valid().kv_u32("general.alignment", 0).build()), GgufError::BadAlignment(0)));
    assert!(matches!(e(&valid().kv_str("general.alignment", b"32").build()), GgufError::MetadataType { .. }));
    let mut t = valid().build();
    // the value type of the first key: 24 header bytes + 8 + len("general.architecture")
    let at = 24 + 8 + "general.architecture".len();
    t[at..at + 4].copy_from_slice(&99u32.to_le_bytes());
    assert!(matches!(e(&t), GgufError::UnknownValueType { ty: 99, .. }));

    assert!(matches!(e(&valid().tensor("a", &[32], 0, 512).build()), GgufError::DuplicateTensor { .. }));
    assert!(matches!(e(&Builder::new().tensor("x", &[32], 77, 0).data(64).build()), GgufError::UnknownTensorType { ty: 77, .. }));
    assert!(matches!(e(&Builder::new().tensor("x", &[1, 1, 1, 1, 1], 0, 0).data(64).build()), GgufError::TooManyDims { n_dims: 5, .. }));
    let huge = [1u64 << 33, 1 << 33];
    assert!(matches!(e(&Builder::new().tensor("x", &huge, 0, 0).data(64).build()), GgufError::BadShape { .. }));
    assert!(matches!(e(&Builder::new().tensor("x", &[1u64 << 62, 2], 0, 0).data(64).build()), GgufError::BadShape { .. }));
    assert!(matches!(e(&Builder::new().tensor("x", &[33], 8, 0).data(64).build()), GgufError::BadShape { .. }));
    assert!(matches!(e(&Builder::new().tensor("x", &[32], 0, 8).data(256).build()), GgufError::Misaligned { .. }));
    assert!(matches!(e(&Builder::new().tensor("x", &[32, 2], 0, 0).data(255).build()), GgufError::OutOfBounds { .. }));
    assert!(matches!(e(&Builder::new().tensor("x", &[32], 0, u64::MAX - 31).data(64).build()), GgufError::OutOfBounds { .. }));
}

#[test]
fn unsupported_tensor_types_name_the_tensor() {
    // IQ2_XXS (16): 256 elements in 66 bytes
    let b = Builder::new().tensor("blk.0.ffn_up.weight", &[256], 16, 0).data(66).build();
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("x.gguf");
    std::fs::write(&p, b).unwrap();
    let f = GgufFile::open(&p).unwrap();
    let err = f.tensor_f32("blk.0.ffn_up.weight").unwrap_err();
    assert!(matches!(&err, GgufError::UnsupportedTensorType { ty: GgmlType::IQ2_XXS, .. }));
    let msg = err.to_string();
    assert!(msg.contains("blk.0.ffn_up.weight") && msg.contains("IQ2_XXS"), "{msg}");
}

fn mutated_inputs() -> impl Strategy<Value = Vec<u8>> {
    let real = std::fs::read(fixtures().join("tiny-llama.gguf")).unwrap();
    // the header only: mutating tensor data would not reach the parser
    let header_len = GgufHeader::parse(&real).unwrap().data_offset as usize;
    let seeds = vec![valid().build(), real[..header_len + 64].to_vec(), real[..header_len].to_vec()];
    (0..seeds.len(), prop::collection::vec((any::<prop::sample::Index>(), any::<u8>(), 0u8..4), 1..8), any::<prop::sample::Index>())
        .prop_map(move |(which, edits, cut)| {
            let mut b = seeds[which].clone();
            for (at, val, kind) in edits {
                let i = at.index(b.len());
                match kind {
                    0 => b[i] = val,
                    1 => b[i] ^= 1 << (val % 8),
                    // inflate an eight-byte little-endian count at i
                    2 => {
                        let end = (i + 8).min(b.len());
                        for x in &mut b[i..end] {
                            *x = 0xff >> (val % 8);
                        }
                    }
                    _ => {
                        b.truncate(i.max(1));
                    }
                }
            }
            if cut.index(16) == 0 {
                let n = cut.index(b.len().max(1));
                b.truncate(n);
            }
            b
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 10_000, failure_persistence: None, ..ProptestConfig::default() })]
    /// Mutated headers (bytes set or flipped, counts inflated, truncations) never panic, and
    /// whatever parses has tensors inside the file.
    #[test]
    fn mutated_headers_never_panic(bytes in mutated_inputs()) {
        if let Ok(h) = GgufHeader::parse(&bytes) {
            for t in &h.tensors {
                prop_assert!(h.data_offset + t.offset + t.n_bytes <= bytes.len() as u64);
            }
        }
    }
}
