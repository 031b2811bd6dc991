//! `DocUnwarpModel` (UVDoc) against the PyTorch re-implementation in
//! `scripts/make_docunwarp_fixture.py` (tests/fixtures/tiny/docunwarp): the preprocessed input, the
//! predicted grid and the unwarped image; PNG output and its atomic save; typed errors for bad
//! images, a missing or misshapen tensor, an unexpected tensor and a bad config.
mod common;

use mlx_array::{Array, DType};
use mlx_models::docunwarp::{remap, Displacement, DocUnwarpConfig, DocUnwarpError, DocUnwarpModel};
use mlx_models::media::{ImageInput, MediaError, RgbImage};
use mlx_models::ModelError;
use std::collections::HashMap;
use std::path::Path;

const FIXTURE: &str = "docunwarp";
/// Bound on max |a - b| / max |b| of the network input and output against PyTorch (f32 on both sides).
const REL_TOL: f32 = 1e-4;
/// Bound on each channel of each pixel of the unwarped image (8-bit levels): the grid differs from
/// PyTorch's by float rounding, which can move a sample across a .5 rounding boundary.
const PIXEL_TOL: u8 = 1;

fn model() -> DocUnwarpModel {
    DocUnwarpModel::load(common::fixture(FIXTURE)).unwrap()
}

fn image() -> ImageInput {
    ImageInput::path(common::fixture(FIXTURE).join("image.png"))
}

fn reference(name: &str) -> Array {
    common::reference(FIXTURE).remove(name).unwrap()
}

#[test]
fn preprocess_and_grid_match_pytorch() {
    let m = model();
    assert_eq!(m.config().img_size, [72, 104]);
    assert_eq!(
        m.config().block_nums,
        vec![3, 4, 6],
        "absent fields take the published network's values"
    );
    let rgb = image().decode().unwrap();
    let input = m.preprocess(&rgb).unwrap();
    let want_input = reference("input");
    assert_eq!(input.shape(), want_input.shape());
    let err = common::rel_err(
        &input.to_vec_f32().unwrap(),
        &want_input.to_vec_f32().unwrap(),
    );
    println!("input rel err {err:.2e}");
    assert!(err < 1e-6, "input rel err {err}");

    // the network alone, on PyTorch's input
    let want_flow = reference("flow");
    let flow = m.forward(&want_input).unwrap();
    assert_eq!(flow.shape(), vec![1, 7, 5, 2]);
    assert_eq!(m.grid_size(), (7, 5));
    let want = want_flow.to_vec_f32().unwrap();
    let err = common::rel_err(&flow.to_vec_f32().unwrap(), &want);
    println!("grid rel err {err:.2e}");
    assert!(err < REL_TOL, "flow rel err {err}");
    // and end to end from the decoded image
    let d = m.displacement(&rgb).unwrap();
    assert_eq!((d.height, d.width), (7, 5));
    let err = common::rel_err(&d.data, &want);
    println!("grid from the decoded image rel err {err:.2e}");
    assert!(err < REL_TOL, "displacement rel err {err}");
}

/// (largest difference, number of differing values, number of values) between `got` and the
/// `[h, w, 3]` 8-bit reference image.
fn pixel_diffs(got: &RgbImage, want: &Array) -> (u8, usize, usize) {
    assert_eq!(
        want.shape(),
        vec![got.height as usize, got.width as usize, 3]
    );
    let want = want.astype(DType::U8).unwrap().to_vec::<u8>().unwrap();
    let diffs: Vec<u8> = got
        .data
        .iter()
        .zip(&want)
        .map(|(a, b)| a.abs_diff(*b))
        .collect();
    (
        diffs.iter().copied().max().unwrap_or(0),
        diffs.iter().filter(|&&d| d > 0).count(),
        diffs.len(),
    )
}

#[test]
fn unwarped_image_matches_pytorch_and_saves_as_png() {
    let m = model();
    let out = m.unwarp(&image()).unwrap();
    assert_eq!((out.image.width, out.image.height), (45, 61));
    let (worst, off, total) = pixel_diffs(&out.image, &reference("unwarped"));
    println!("unwarped image: max diff {worst} level(s), {off} of {total} values differ");
    assert!(
        worst <= PIXEL_TOL,
        "max pixel diff {worst} ({off} of {total} values differ)"
    );
    assert!(
        off * 100 < total,
        "{off} of {total} values differ by one level"
    );
    // a non-trivial warp: the result is not the input
    let input = image().decode().unwrap();
    assert!(
        input
            .data
            .iter()
            .zip(&out.image.data)
            .filter(|(a, b)| a != b)
            .count()
            > total / 2
    );

    // PNG bytes decode back to the same pixels; save writes them atomically
    assert_eq!(
        ImageInput::Bytes(out.png.clone()).decode().unwrap(),
        out.image
    );
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("out.png");
    std::fs::write(&path, b"old").unwrap();
    out.save(&path).unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), out.png);
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        1,
        "no temporary file left behind"
    );
    let err = out
        .save(dir.path().join("missing-dir/out.png"))
        .unwrap_err();
    assert!(
        matches!(
            err,
            DocUnwarpError::Model(ModelError::Array(mlx_array::Error::Io { .. }))
        ),
        "{err:?}"
    );
}

#[test]
fn identity_grid_reproduces_the_image_and_the_border_clamps() {
    let img = RgbImage::new(3, 2, (0..18).map(|v| v * 10).collect()).unwrap();
    let identity = Displacement {
        height: 2,
        width: 2,
        data: vec![-1., -1., 1., -1., -1., 1., 1., 1.],
    };
    assert_eq!(remap(&img, &identity).unwrap(), img);
    // a point far outside (right, above): clamped to the top-right pixel
    let outside = Displacement {
        height: 1,
        width: 1,
        data: vec![5., -5.],
    };
    let corner = remap(&img, &outside).unwrap();
    assert!(
        corner.data.chunks(3).all(|p| p == [60, 70, 80]),
        "{:?}",
        corner.data
    );
    // half-way between the first two pixels of the first row
    let half = Displacement {
        height: 1,
        width: 1,
        data: vec![-0.5, -1.],
    };
    assert!(remap(&img, &half)
        .unwrap()
        .data
        .chunks(3)
        .all(|p| p == [15, 25, 35]));
    let bad = Displacement {
        height: 2,
        width: 2,
        data: vec![0.; 7],
    };
    assert!(matches!(
        remap(&img, &bad),
        Err(DocUnwarpError::Model(ModelError::InvalidInput(_)))
    ));
}

#[test]
fn bad_images_are_typed_errors() {
    let m = model();
    let png = std::fs::read(common::fixture(FIXTURE).join("image.png")).unwrap();
    for (what, bytes) in [
        ("truncated PNG", png[..png.len() / 2].to_vec()),
        ("garbage", b"definitely not an image".to_vec()),
        ("empty", Vec::new()),
    ] {
        let err = m.unwarp(&ImageInput::Bytes(bytes)).unwrap_err();
        assert!(
            matches!(err, DocUnwarpError::Image(MediaError::Image { .. })),
            "{what}: {err:?}"
        );
    }
    let err = m
        .unwarp(&ImageInput::path("/nonexistent/page.png"))
        .unwrap_err();
    assert!(
        matches!(err, DocUnwarpError::Image(MediaError::Io { .. })),
        "{err:?}"
    );
    let err = m
        .forward(&Array::zeros(&[1, 104, 72], DType::F32).unwrap())
        .unwrap_err();
    assert!(
        matches!(err, DocUnwarpError::Model(ModelError::InvalidInput(_))),
        "{err:?}"
    );
    let err = m
        .forward(&Array::zeros(&[1, 8, 8, 3], DType::F32).unwrap())
        .unwrap_err();
    assert!(
        matches!(err, DocUnwarpError::Model(ModelError::InvalidInput(_))),
        "{err:?}"
    );
    // a one-pixel page unwarps (every sample is that pixel)
    let dot = RgbImage::new(1, 1, vec![9, 8, 7]).unwrap();
    assert_eq!(m.unwarp(&ImageInput::Rgb(dot.clone())).unwrap().image, dot);
}

/// A copy of the fixture with `edit` applied to its tensors and `config` as config.json.
fn edited_checkpoint(
    dir: &Path,
    edit: impl FnOnce(&mut HashMap<String, Array>),
    config: Option<&str>,
) {
    let src = common::fixture(FIXTURE);
    let mut tensors = mlx_array::io::load_safetensors(src.join("model.safetensors"), None).unwrap();
    edit(&mut tensors);
    let list: Vec<(&str, &Array)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    mlx_array::io::save_safetensors(dir.join("model.safetensors"), &list, None).unwrap();
    let cfg = match config {
        Some(c) => c.to_string(),
        None => std::fs::read_to_string(src.join("config.json")).unwrap(),
    };
    std::fs::write(dir.join("config.json"), cfg).unwrap();
}

fn checkpoint_error(
    edit: impl FnOnce(&mut HashMap<String, Array>),
    config: Option<&str>,
) -> DocUnwarpError {
    let dir = tempfile::tempdir().unwrap();
    edited_checkpoint(dir.path(), edit, config);
    DocUnwarpModel::load(dir.path()).unwrap_err()
}

#[test]
fn checkpoint_problems_are_typed_errors() {
    let checkpoint_msg = |err: DocUnwarpError| match err {
        DocUnwarpError::Model(ModelError::Checkpoint { msg, .. }) => msg,
        e => panic!("{e:?}"),
    };
    let msg = checkpoint_msg(checkpoint_error(
        |t| drop(t.remove("bridge_4.1.0.weight")),
        None,
    ));
    assert!(msg.contains("missing tensor bridge_4.1.0.weight"), "{msg}");
    // a BatchNorm vector of the wrong width, and a tensor no layer reads
    for (name, len) in [
        ("resnet_down.layer1.0.bn1.running_var", 4),
        ("extra.weight", 2),
    ] {
        let ones = Array::ones(&[len], DType::F32).unwrap();
        let msg = checkpoint_msg(checkpoint_error(
            |t| drop(t.insert(name.into(), ones)),
            None,
        ));
        assert!(msg.contains(name), "{msg}");
    }
    let configs = [
        (
            r#"{"model_type": "uvdoc", "num_filter": 3, "kernel_size": 4, "img_size": [72, 104]}"#,
            "odd",
        ),
        (
            r#"{"model_type": "uvdoc", "num_filter": 3, "img_size": [8, 8]}"#,
            "too small",
        ),
    ];
    for (config, why) in configs {
        match checkpoint_error(|_| {}, Some(config)) {
            DocUnwarpError::Model(ModelError::MalformedConfig { reason, .. }) => {
                assert!(reason.contains(why), "{reason}")
            }
            e => panic!("{config}: {e:?}"),
        }
    }
    let err = checkpoint_error(|_| {}, Some(r#"{"model_type": "layoutlm"}"#));
    assert!(
        matches!(
            &err,
            DocUnwarpError::Model(ModelError::UnsupportedModelType { .. })
        ),
        "{err:?}"
    );
    let err = DocUnwarpModel::load("/nonexistent/uvdoc").unwrap_err();
    assert!(
        matches!(&err, DocUnwarpError::Model(ModelError::ConfigNotFound(_))),
        "{err:?}"
    );
}

/// Max relative error of the grid of the fixture's checkpoint edited by `edit`, on PyTorch's input.
fn flow_err_after(edit: impl FnOnce(&mut HashMap<String, Array>)) -> f32 {
    let dir = tempfile::tempdir().unwrap();
    edited_checkpoint(dir.path(), edit, None);
    let m = DocUnwarpModel::load(dir.path()).unwrap();
    let got = m
        .forward(&reference("input"))
        .unwrap()
        .to_vec_f32()
        .unwrap();
    common::rel_err(&got, &reference("flow").to_vec_f32().unwrap())
}

#[test]
fn original_pytorch_names_and_extras_load() {
    // the original UVDoc state dict: the first block of a layer has bare `conv1` / `conv2`
    // convolutions and one-convolution bridges one level less; counters and the 3-D head are ignored
    let err = flow_err_after(|t| {
        let names: Vec<String> = t.keys().cloned().collect();
        for n in names {
            let mut renamed = n.clone();
            for layer in 1..=3 {
                for conv in ["conv1", "conv2"] {
                    let nested = format!("resnet_down.layer{layer}.0.{conv}.0.");
                    if let Some(rest) = n.strip_prefix(&nested) {
                        renamed = format!("resnet_down.layer{layer}.0.{conv}.{rest}");
                    }
                }
            }
            for b in 1..=3 {
                if let Some(rest) = n.strip_prefix(&format!("bridge_{b}.0.0.")) {
                    renamed = format!("bridge_{b}.0.{rest}");
                }
            }
            if renamed != n {
                let v = t.remove(&n).unwrap();
                t.insert(renamed, v);
            }
        }
        assert!(
            t.contains_key("resnet_down.layer2.0.conv1.weight")
                && t.contains_key("bridge_3.0.1.running_var")
        );
        t.insert(
            "resnet_head.1.num_batches_tracked".into(),
            Array::from_slice(&[7i64], &[]).unwrap(),
        );
        t.insert(
            "out_point_positions3D.3.weight".into(),
            Array::ones(&[3, 3, 5, 5], DType::F32).unwrap(),
        );
    });
    assert!(err < REL_TOL, "flow rel err {err}");
}

#[test]
fn mlx_kernel_layout_loads() {
    // kernels stored in MLX's [out, kh, kw, in] layout give the same network
    let err = flow_err_after(|t| {
        let names: Vec<String> = t.keys().filter(|k| t[*k].ndim() == 4).cloned().collect();
        for n in names {
            let w = t[&n].transpose(&[0, 2, 3, 1]).unwrap();
            t.insert(n, w);
        }
    });
    assert!(err < REL_TOL, "flow rel err {err}");
    assert_eq!(DocUnwarpConfig::default().img_size, [488, 712]);
}

/// The published network's size (32 filters, 488x712 input, 45x31 grid, 7.9 M parameters) on a
/// 620x877 picture: `scripts/make_docunwarp_fixture.py --full-size DIR`, then
/// `DOCUNWARP_FULL_DIR=DIR cargo test -p mlx-models --test docunwarp -- --ignored --nocapture`.
#[test]
#[ignore = "needs a full-size checkpoint made by scripts/make_docunwarp_fixture.py --full-size (32 MB)"]
fn full_size_network_matches_pytorch() {
    let dir = std::env::var("DOCUNWARP_FULL_DIR")
        .expect("set DOCUNWARP_FULL_DIR to the --full-size output");
    let dir = Path::new(&dir);
    let m = DocUnwarpModel::load(dir).unwrap();
    let refs = mlx_array::io::load_safetensors(dir.join("reference.safetensors"), None).unwrap();
    let t = std::time::Instant::now();
    let out = m.unwarp(&ImageInput::path(dir.join("image.png"))).unwrap();
    let secs = t.elapsed().as_secs_f64();
    let want_flow = refs["flow"].to_vec_f32().unwrap();
    let err = common::rel_err(&out.displacement.data, &want_flow);
    let (worst, off, total) = pixel_diffs(&out.image, &refs["unwarped"]);
    println!(
        "{}x{} page, {}x{} grid in {secs:.2} s: grid rel err {err:.2e}; image max diff {worst}, {off} of {} values differ",
        out.image.width,
        out.image.height,
        out.displacement.height,
        out.displacement.width,
        total
    );
    assert_eq!((out.displacement.height, out.displacement.width), (45, 31));
    assert!(err < REL_TOL, "grid rel err {err}");
    assert!(worst <= PIXEL_TOL, "max pixel diff {worst}");
}
