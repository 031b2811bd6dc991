//! `media::resize` against Pillow's `Image.resize` (`scripts/make_pillow_resize_fixture.py`,
//! Pillow 13): 26 resizes of six noise images (7x30, 30x7, 13x13, 40x25, 1x9, 23x11) to fixed
//! and seeded random sizes, each side shrinking, growing or kept, bicubic and bilinear, equal
//! byte for byte. Pillow 13 picks the pass order from the sizes (vertical first when the height
//! shrinks by more than twice as many pixels as the width): 7x30 -> 32x136 needs the horizontal
//! pass first (vertical first is off by 18/255), 7x30 -> 14x12 the vertical one (horizontal
//! first is off by 6/255).
use mlx_array::{Array, DType};
use mlx_models::media::{resize, Filter, RgbImage};
use std::path::PathBuf;

fn u8s(a: &Array) -> Vec<u8> {
    a.astype(DType::U8).unwrap().to_vec::<u8>().unwrap()
}

#[test]
fn resize_equals_pillow_byte_for_byte() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/pillow_resize");
    let r = mlx_array::io::load_safetensors(dir.join("reference.safetensors"), None).unwrap();
    let meta: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("cases.json")).unwrap()).unwrap();
    let cases = meta["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 26);
    let mut worst = Vec::new();
    for (j, c) in cases.iter().enumerate() {
        let input = &r[&format!("in{}", c["input"])];
        let (h, w) = (input.shape()[0] as u32, input.shape()[1] as u32);
        let img = RgbImage::new(w, h, u8s(input)).unwrap();
        let (tw, th) = (c["width"].as_u64().unwrap() as u32, c["height"].as_u64().unwrap() as u32);
        let filter = match c["filter"].as_str().unwrap() {
            "bicubic" => Filter::Bicubic,
            "bilinear" => Filter::Bilinear,
            f => panic!("filter {f}"),
        };
        let got = resize(&img, tw, th, filter).unwrap();
        let want = &r[&format!("out{j}")];
        assert_eq!((got.height as usize, got.width as usize), (want.shape()[0], want.shape()[1]), "case {j}: size");
        let diff = got.data.iter().zip(u8s(want)).map(|(&a, b)| a.abs_diff(b)).max().unwrap_or(0);
        if diff > 0 {
            worst.push(format!("case {j} ({w}x{h} -> {tw}x{th} {filter:?}): max |diff| {diff}"));
        }
    }
    assert!(worst.is_empty(), "differs from Pillow:\n{}", worst.join("\n"));
}
