//! Document image unwarping with UVDoc (PaddleOCR's `UVDoc` module, mlx-node's `DocUnwarpModel`): a
//! convolutional network predicts, for a coarse grid over the page, where in the photo each point
//! of the flat page lies; the photo is resampled through that grid.
//!
//! Pipeline of [`DocUnwarpModel::unwarp`]:
//! 1. decode the image to 8-bit RGB ([`ImageInput::decode`]), scale to `[0, 1]` and resize to
//!    `img_size` (`[width, height]`, 488x712 by default) with bilinear interpolation, corners
//!    aligned (PaddleX's `F.upsample(..., align_corners=True)`);
//! 2. the network (NHWC on MLX, f32):
//!    - `resnet_head`: two (conv k x k stride 2, no bias) + BatchNorm + ReLU;
//!    - `resnet_down.layer1..3`: `block_nums` residual blocks (3/4/6) of widths
//!      `num_filter * map_num[0..3]`. Block 0 of a layer has plain convolutions with the layer's
//!      `stride` (1/2/2) and a `downsample` (conv k x k with bias + BatchNorm) when the stride is
//!      not 1 or the width changes; blocks 1.. use dilation 3. `relu(bn2(conv2(relu(bn1(conv1
//!      (x))))) + residual)`;
//!    - `bridge_1..6`: chains of dilated 3x3 conv + BatchNorm + ReLU (dilations 1 / 2 / 5 /
//!      8,3,2 / 12,7,4 / 18,12,6) over the encoder output, concatenated on channels and reduced by
//!      `bridge_concat` (1x1 conv + BatchNorm + ReLU);
//!    - `out_point_positions2D`: conv k x k (reflect padding, no bias) + BatchNorm + PReLU +
//!      conv k x k (reflect padding, bias) to two channels, the sampling grid `(x, y)` in
//!      `[-1, 1]` image coordinates, `[GH, GW]` (45x31 for the default input);
//! 3. the grid is resized to the image's size (bilinear, corners aligned) and the original 8-bit
//!    image is sampled bilinearly at each point (corners aligned; points outside the image are
//!    clamped to its border, as mlx-node clamps), rounded to 8 bits, and encoded as PNG.
//!
//! Checkpoints are mlx-node's `UVDoc-mlx` layout: `model.safetensors` with PyTorch-named tensors
//! (`resnet_head.0.weight`, `resnet_down.layer2.0.conv1.0.weight`, `resnet_down.layer2.0.
//! downsample.1.running_var`, `bridge_1.0.0.0.weight`, `bridge_4.2.1.bias`,
//! `out_point_positions2D.2.weight`, ...), convolution kernels `[out, in, kh, kw]` (MLX's
//! `[out, kh, kw, in]` is accepted too), and a `config.json` with `model_type: "uvdoc"`,
//! `num_filter`, `kernel_size` and `img_size`. The original PyTorch UVDoc state dict, saved as
//! safetensors, loads too: its names differ where its modules nest one level less (the first
//! block's `conv1.weight`, `bridge_1.0.0.weight`), and its `*.num_batches_tracked` and unused 3-D
//! head (`out_point_positions3D.*`) are ignored; any other tensor the
//! network does not read is an error.
use crate::media::{ImageInput, MediaError, RgbImage};
use crate::weights::{Init, Vb, Weights};
use crate::ModelError;
use mlx_array::{ops, Array, DType};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// BatchNorm epsilon of the UVDoc modules (PyTorch's and Paddle's default).
const BN_EPS: f32 = 1e-5;
/// Dilations of the six bridge branches.
const BRIDGE_DILATIONS: [&[usize]; 6] = [&[1], &[2], &[5], &[8, 3, 2], &[12, 7, 4], &[18, 12, 6]];
/// Dilation of the residual blocks after the first of each layer.
const BLOCK_DILATION: usize = 3;

/// Why unwarping failed.
#[derive(Debug, thiserror::Error)]
pub enum DocUnwarpError {
    /// The image could not be read or decoded (truncated or not PNG/JPEG), or its pixels are inconsistent.
    #[error(transparent)]
    Image(#[from] MediaError),
    /// Loading (config, missing or misshapen tensors), running the network, or writing a file.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The unwarped image could not be encoded as PNG.
    #[error("cannot encode the unwarped image as PNG: {0}")]
    Encode(String),
}

impl From<mlx_array::Error> for DocUnwarpError {
    fn from(e: mlx_array::Error) -> Self {
        DocUnwarpError::Model(ModelError::Array(e))
    }
}

pub type Result<T> = std::result::Result<T, DocUnwarpError>;

/// `config.json` of a UVDoc checkpoint. mlx-node's conversions write `model_type`, `num_filter`,
/// `kernel_size` and `img_size`; the other fields (PaddleX's `UVDocNetConfig` names) default to
/// the published network.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DocUnwarpConfig {
    /// `"uvdoc"`.
    #[serde(default = "default_model_type")]
    pub model_type: String,
    /// Base width: the encoder layers are `num_filter * map_num[i]` channels wide.
    #[serde(default = "default_num_filter")]
    pub num_filter: usize,
    /// Kernel size of the head, residual and output convolutions (odd).
    #[serde(default = "default_kernel_size")]
    pub kernel_size: usize,
    /// Network input size, `[width, height]`.
    #[serde(default = "default_img_size")]
    pub img_size: [usize; 2],
    /// Width multipliers; the first three are used (head and output head: `[0]`, layers: `[0..3]`,
    /// bridge: `[2]`).
    #[serde(default = "default_map_num")]
    pub map_num: Vec<usize>,
    /// Residual blocks of the three encoder layers.
    #[serde(default = "default_block_nums")]
    pub block_nums: Vec<usize>,
    /// Stride of the first block of each encoder layer.
    #[serde(default = "default_stride")]
    pub stride: Vec<usize>,
}

fn default_model_type() -> String {
    "uvdoc".into()
}
fn default_num_filter() -> usize {
    32
}
fn default_kernel_size() -> usize {
    5
}
fn default_img_size() -> [usize; 2] {
    [488, 712]
}
fn default_map_num() -> Vec<usize> {
    vec![1, 2, 4, 8, 16]
}
fn default_block_nums() -> Vec<usize> {
    vec![3, 4, 6]
}
fn default_stride() -> Vec<usize> {
    vec![1, 2, 2]
}

impl Default for DocUnwarpConfig {
    fn default() -> Self {
        DocUnwarpConfig {
            model_type: default_model_type(),
            num_filter: default_num_filter(),
            kernel_size: default_kernel_size(),
            img_size: default_img_size(),
            map_num: default_map_num(),
            block_nums: default_block_nums(),
            stride: default_stride(),
        }
    }
}

/// Output size of a convolution along one axis (PyTorch's formula).
fn conv_out(n: usize, k: usize, stride: usize, pad: usize, dil: usize) -> Option<usize> {
    let span = dil * (k - 1) + 1;
    (n + 2 * pad).checked_sub(span).map(|r| r / stride + 1)
}

impl DocUnwarpConfig {
    /// Read `dir/config.json`.
    pub fn from_dir(dir: &Path) -> std::result::Result<Self, ModelError> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => ModelError::ConfigNotFound(dir.to_path_buf()),
            _ => ModelError::io(&path, e),
        })?;
        let c: DocUnwarpConfig =
            serde_json::from_str(&text).map_err(|e| ModelError::MalformedConfig {
                path: path.clone(),
                reason: e.to_string(),
            })?;
        if c.model_type != "uvdoc" {
            return Err(ModelError::UnsupportedModelType {
                path: dir.to_path_buf(),
                model_type: c.model_type,
            });
        }
        c.validate()
            .map_err(|reason| ModelError::MalformedConfig { path, reason })?;
        Ok(c)
    }

    /// Widths of the head (`[0]`), the three encoder layers, and the bridge (the last).
    fn widths(&self) -> [usize; 3] {
        [0, 1, 2].map(|i| self.num_filter * self.map_num[i])
    }

    /// Shape checks the network would otherwise fail on at run time.
    pub fn validate(&self) -> std::result::Result<(), String> {
        if self.num_filter == 0 {
            return Err("num_filter must be positive".into());
        }
        if self.kernel_size == 0 || self.kernel_size % 2 == 0 {
            return Err(format!("kernel_size {} must be odd", self.kernel_size));
        }
        if self.map_num.len() < 3 || self.map_num[..3].contains(&0) {
            return Err(format!(
                "map_num {:?} needs three positive multipliers",
                self.map_num
            ));
        }
        if self.block_nums.len() != 3 || self.block_nums.contains(&0) {
            return Err(format!(
                "block_nums {:?} must be three positive counts",
                self.block_nums
            ));
        }
        if self.stride.len() != 3 || self.stride.contains(&0) {
            return Err(format!(
                "stride {:?} must be three positive strides",
                self.stride
            ));
        }
        let [w, h] = self.img_size;
        let (gh, gw) = self
            .grid_size_for(h, w)
            .ok_or_else(|| format!("img_size {:?} is too small for the network", self.img_size))?;
        let pad = self.kernel_size / 2;
        if gh <= pad || gw <= pad {
            return Err(format!(
                "img_size {:?} gives a {gh}x{gw} grid, too small for reflect padding of {pad}",
                self.img_size
            ));
        }
        Ok(())
    }

    /// Grid size `(GH, GW)` the network predicts for an `h x w` input, if it is large enough.
    fn grid_size_for(&self, h: usize, w: usize) -> Option<(usize, usize)> {
        let k = self.kernel_size;
        let p = k / 2;
        let down = |n: usize| -> Option<usize> {
            let mut n = conv_out(n, k, 2, p, 1)?;
            n = conv_out(n, k, 2, p, 1)?;
            for &s in &self.stride {
                n = conv_out(n, k, s, p, 1)?;
            }
            (n > 0).then_some(n)
        };
        Some((down(h)?, down(w)?))
    }
}

/// A convolution in MLX layout, with its padding (zeros), stride and dilation.
struct Conv {
    /// `[out, kh, kw, in]`.
    weight: Array,
    bias: Option<Array>,
    stride: usize,
    pad: usize,
    dilation: usize,
}

impl Conv {
    #[allow(clippy::too_many_arguments)]
    fn load(
        vb: &Vb,
        cin: usize,
        cout: usize,
        k: usize,
        stride: usize,
        pad: usize,
        dilation: usize,
        bias: bool,
    ) -> Result<Self> {
        let w = vb.get_either(
            "weight",
            &[&[cout, cin, k, k], &[cout, k, k, cin]],
            Init::WEIGHT,
        )?;
        // `[out, in, kh, kw]` (PyTorch, Paddle) unless it has MLX's shape only (the two agree when in == k)
        let weight = if w.shape() == [cout, cin, k, k] {
            w.transpose(&[0, 2, 3, 1])?
        } else {
            w
        };
        let bias = if bias {
            Some(vb.get("bias", &[cout])?)
        } else {
            None
        };
        Ok(Conv {
            weight: weight.astype(DType::F32)?,
            bias,
            stride,
            pad,
            dilation,
        })
    }

    fn forward(&self, x: &Array) -> Result<Array> {
        let y = x.conv2d(
            &self.weight,
            (self.stride, self.stride),
            (self.pad, self.pad),
            (self.dilation, self.dilation),
            1,
        )?;
        Ok(match &self.bias {
            Some(b) => y.add(b)?,
            None => y,
        })
    }
}

/// Inference BatchNorm folded to `x * scale + shift`.
struct BatchNorm {
    scale: Array,
    shift: Array,
}

impl BatchNorm {
    fn load(vb: &Vb, c: usize) -> Result<Self> {
        let get = |n: &str| -> Result<Array> { Ok(vb.get(n, &[c])?.astype(DType::F32)?) };
        let (w, b, mean, var) = (
            get("weight")?,
            get("bias")?,
            get("running_mean")?,
            get("running_var")?,
        );
        let scale = w.mul(&var.add_scalar(BN_EPS)?.rsqrt()?)?;
        let shift = b.sub(&mean.mul(&scale)?)?;
        Ok(BatchNorm { scale, shift })
    }

    fn forward(&self, x: &Array) -> Result<Array> {
        Ok(x.mul(&self.scale)?.add(&self.shift)?)
    }
}

/// `vb.0` (the checkpoints' nesting of a one-module `Sequential`), or `vb` itself where only it
/// holds `probe` (the original PyTorch names, one level less).
fn nested<'a>(vb: Vb<'a>, probe: &str) -> Vb<'a> {
    let inner = vb.pp(0);
    if !inner.contains(probe) && vb.contains(probe) {
        vb
    } else {
        inner
    }
}

fn relu(x: &Array) -> Result<Array> {
    Ok(x.maximum(&Array::scalar(0f32))?)
}

/// Convolution, BatchNorm and ReLU (`vb.0`, `vb.1`; the ReLU has no parameters).
struct ConvBnRelu {
    conv: Conv,
    bn: BatchNorm,
}

impl ConvBnRelu {
    fn load(vb: &Vb, conv: Conv, c: usize) -> Result<Self> {
        Ok(ConvBnRelu {
            conv,
            bn: BatchNorm::load(&vb.pp(1), c)?,
        })
    }
    fn forward(&self, x: &Array) -> Result<Array> {
        relu(&self.bn.forward(&self.conv.forward(x)?)?)
    }
}

struct ResidualBlock {
    conv1: Conv,
    bn1: BatchNorm,
    conv2: Conv,
    bn2: BatchNorm,
    downsample: Option<(Conv, BatchNorm)>,
}

impl ResidualBlock {
    /// Block `vb`: plain convolutions with `stride` for the first block of a layer (`top`),
    /// dilated stride-1 convolutions otherwise; a downsample branch when given.
    fn load(vb: &Vb, cin: usize, cout: usize, k: usize, stride: usize, top: bool) -> Result<Self> {
        let dil = if top || stride != 1 {
            1
        } else {
            BLOCK_DILATION
        };
        let pad = dil * (k / 2);
        let downsample = if top && (stride != 1 || cin != cout) {
            let d = vb.pp("downsample");
            Some((
                Conv::load(&d.pp(0), cin, cout, k, stride, k / 2, 1, true)?,
                BatchNorm::load(&d.pp(1), cout)?,
            ))
        } else {
            None
        };
        Ok(ResidualBlock {
            conv1: Conv::load(
                &nested(vb.pp("conv1"), "weight"),
                cin,
                cout,
                k,
                stride,
                pad,
                dil,
                true,
            )?,
            bn1: BatchNorm::load(&vb.pp("bn1"), cout)?,
            conv2: Conv::load(
                &nested(vb.pp("conv2"), "weight"),
                cout,
                cout,
                k,
                1,
                pad,
                dil,
                true,
            )?,
            bn2: BatchNorm::load(&vb.pp("bn2"), cout)?,
            downsample,
        })
    }

    fn forward(&self, x: &Array) -> Result<Array> {
        let residual = match &self.downsample {
            Some((conv, bn)) => bn.forward(&conv.forward(x)?)?,
            None => x.clone(),
        };
        let y = relu(&self.bn1.forward(&self.conv1.forward(x)?)?)?;
        let y = self.bn2.forward(&self.conv2.forward(&y)?)?;
        relu(&y.add(&residual)?)
    }
}

/// `x` padded by `pad` on both sides of `axis` with its mirror image (edge not repeated), as
/// PyTorch's `padding_mode="reflect"`; needs `pad < len`.
fn reflect_pad(x: &Array, axis: usize, pad: usize) -> Result<Array> {
    let n = x.shape()[axis];
    if pad >= n {
        return Err(ModelError::InvalidInput(format!(
            "feature map of {n} along axis {axis} is too small for reflect padding of {pad}"
        ))
        .into());
    }
    let idx: Vec<i32> = (1..=pad)
        .rev()
        .chain(0..n)
        .chain((n - 1 - pad..n - 1).rev())
        .map(|i| i as i32)
        .collect();
    Ok(x.take(&Array::from_slice(&idx, &[idx.len()])?, axis as i32)?)
}

/// The output head: conv (reflect) + BatchNorm + PReLU + conv (reflect) to the 2-channel grid.
struct OutputHead {
    conv1: Conv,
    bn: BatchNorm,
    /// PReLU slope, one or one per channel.
    prelu: Array,
    conv2: Conv,
    pad: usize,
}

impl OutputHead {
    fn load(vb: &Vb, cin: usize, c: usize, k: usize) -> Result<Self> {
        Ok(OutputHead {
            conv1: Conv::load(&vb.pp(0), cin, c, k, 1, 0, 1, false)?,
            bn: BatchNorm::load(&vb.pp(1), c)?,
            prelu: vb
                .pp(2)
                .get_either("weight", &[&[1], &[c]], Init::normal(0.25, 0.0))?
                .astype(DType::F32)?,
            conv2: Conv::load(&vb.pp(3), c, 2, k, 1, 0, 1, true)?,
            pad: k / 2,
        })
    }

    fn pad2d(&self, x: &Array) -> Result<Array> {
        reflect_pad(&reflect_pad(x, 1, self.pad)?, 2, self.pad)
    }

    fn forward(&self, x: &Array) -> Result<Array> {
        let y = self.bn.forward(&self.conv1.forward(&self.pad2d(x)?)?)?;
        let zero = Array::scalar(0f32);
        let y = y
            .maximum(&zero)?
            .add(&y.minimum(&zero)?.mul(&self.prelu)?)?;
        self.conv2.forward(&self.pad2d(&y)?)
    }
}

/// The network's sampling grid for one image: `height x width` points, each `(x, y)` in `[-1, 1]`
/// coordinates of the image (`-1` the first pixel's centre, `1` the last's).
#[derive(Debug, Clone, PartialEq)]
pub struct Displacement {
    pub height: usize,
    pub width: usize,
    /// Row-major, `(x, y)` interleaved: `2 * height * width` values.
    pub data: Vec<f32>,
}

/// An unwarped page.
#[derive(Debug, Clone)]
pub struct UnwarpOutput {
    /// The unwarped image, the size of the input.
    pub image: RgbImage,
    /// `image` encoded as PNG.
    pub png: Vec<u8>,
    /// The network's grid the image was resampled through.
    pub displacement: Displacement,
}

impl UnwarpOutput {
    /// Write the PNG to `path` atomically (a temporary file in the same directory, renamed over `path`).
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        Ok(mlx_array::io::write_atomic(path, &self.png)?)
    }
}

/// A UVDoc document-unwarping model (mlx-node's `DocUnwarpModel`).
pub struct DocUnwarpModel {
    config: DocUnwarpConfig,
    path: PathBuf,
    head: Vec<ConvBnRelu>,
    layers: Vec<Vec<ResidualBlock>>,
    bridges: Vec<Vec<ConvBnRelu>>,
    bridge_concat: ConvBnRelu,
    out: OutputHead,
}

impl std::fmt::Debug for DocUnwarpModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DocUnwarpModel")
            .field("path", &self.path)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl DocUnwarpModel {
    /// Load `dir/config.json` and `dir/model*.safetensors` (f32).
    pub fn load(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let config = DocUnwarpConfig::from_dir(dir)?;
        let mut weights = Weights::load(dir, Some(DType::F32))?;
        weights.set_aside(|n| {
            n.ends_with(".num_batches_tracked") || n.starts_with("out_point_positions3D.")
        });
        let model = Self::build(&weights.root(), config, dir)?;
        weights.check_all_used()?;
        Ok(model)
    }

    fn build(vb: &Vb, config: DocUnwarpConfig, dir: &Path) -> Result<Self> {
        let k = config.kernel_size;
        let [c0, _, c2] = config.widths();
        let h = vb.pp("resnet_head");
        // modules 0 and 3 are the convolutions, 1 and 4 their BatchNorms (2 and 5 the ReLUs)
        let head = vec![
            ConvBnRelu {
                conv: Conv::load(&h.pp(0), 3, c0, k, 2, k / 2, 1, false)?,
                bn: BatchNorm::load(&h.pp(1), c0)?,
            },
            ConvBnRelu {
                conv: Conv::load(&h.pp(3), c0, c0, k, 2, k / 2, 1, false)?,
                bn: BatchNorm::load(&h.pp(4), c0)?,
            },
        ];
        let mut layers = Vec::with_capacity(3);
        let mut cin = c0;
        for (i, (&n, &stride)) in config.block_nums.iter().zip(&config.stride).enumerate() {
            let cout = config.num_filter * config.map_num[i];
            let lv = vb.pp("resnet_down").pp(format!("layer{}", i + 1));
            let mut blocks = vec![ResidualBlock::load(&lv.pp(0), cin, cout, k, stride, true)?];
            for b in 1..n {
                blocks.push(ResidualBlock::load(&lv.pp(b), cout, cout, k, 1, false)?);
            }
            layers.push(blocks);
            cin = cout;
        }
        let mut bridges = Vec::with_capacity(BRIDGE_DILATIONS.len());
        for (i, dils) in BRIDGE_DILATIONS.iter().enumerate() {
            let mut bv = vb.pp(format!("bridge_{}", i + 1));
            if dils.len() == 1 {
                bv = nested(bv, "0.0.weight"); // one-convolution branches sit one level deeper
            }
            let chain = dils
                .iter()
                .enumerate()
                .map(|(j, &d)| {
                    let cv = bv.pp(j);
                    ConvBnRelu::load(&cv, Conv::load(&cv.pp(0), c2, c2, 3, 1, d, d, false)?, c2)
                })
                .collect::<Result<Vec<_>>>()?;
            bridges.push(chain);
        }
        let cv = vb.pp("bridge_concat");
        let bridge_concat = ConvBnRelu::load(
            &cv,
            Conv::load(&cv.pp(0), 6 * c2, c2, 1, 1, 0, 1, false)?,
            c2,
        )?;
        let out = OutputHead::load(&vb.pp("out_point_positions2D"), c2, c0, k)?;
        Ok(DocUnwarpModel {
            config,
            path: dir.to_path_buf(),
            head,
            layers,
            bridges,
            bridge_concat,
            out,
        })
    }

    pub fn config(&self) -> &DocUnwarpConfig {
        &self.config
    }

    /// The grid size `(GH, GW)` predicted for the configured input size.
    pub fn grid_size(&self) -> (usize, usize) {
        let [w, h] = self.config.img_size;
        // validated at load
        self.config.grid_size_for(h, w).unwrap_or((0, 0))
    }

    /// The network input for `image`: `[1, H, W, 3]` f32 in `[0, 1]`, resized to `img_size`
    /// (bilinear, corners aligned).
    pub fn preprocess(&self, image: &RgbImage) -> Result<Array> {
        let (w, h) = (image.width as usize, image.height as usize);
        let [ow, oh] = self.config.img_size;
        let resized =
            resize_bilinear_aligned(&image.data, |v| v as f32 / 255.0, (h, w, 3), (oh, ow));
        Ok(Array::from_slice(&resized, &[1, oh, ow, 3])?)
    }

    /// The network: `[N, H, W, 3]` NHWC pixels in `[0, 1]` to the grid `[N, GH, GW, 2]`.
    pub fn forward(&self, pixels: &Array) -> Result<Array> {
        let s = pixels.shape();
        if s.len() != 4 || s[3] != 3 || s[0] == 0 {
            return Err(ModelError::InvalidInput(format!(
                "UVDoc input must be [N, H, W, 3] pixels, got {s:?}"
            ))
            .into());
        }
        if self.config.grid_size_for(s[1], s[2]).is_none() {
            return Err(ModelError::InvalidInput(format!(
                "UVDoc input of {}x{} is too small",
                s[2], s[1]
            ))
            .into());
        }
        let mut x = pixels.astype(DType::F32)?;
        for l in &self.head {
            x = l.forward(&x)?;
        }
        for layer in &self.layers {
            for b in layer {
                x = b.forward(&x)?;
            }
        }
        let mut branches = Vec::with_capacity(self.bridges.len());
        for chain in &self.bridges {
            let mut y = x.clone();
            for l in chain {
                y = l.forward(&y)?;
            }
            branches.push(y);
        }
        let cat = ops::concatenate(&branches.iter().collect::<Vec<_>>(), 3)?;
        self.out.forward(&self.bridge_concat.forward(&cat)?)
    }

    /// The network's grid for `image`.
    pub fn displacement(&self, image: &RgbImage) -> Result<Displacement> {
        let grid = self.forward(&self.preprocess(image)?)?;
        let s = grid.shape();
        Ok(Displacement {
            height: s[1],
            width: s[2],
            data: grid.to_vec_f32()?,
        })
    }

    /// Unwarp a document photo: the corrected image (same size as the input) and its PNG.
    pub fn unwarp(&self, image: &ImageInput) -> Result<UnwarpOutput> {
        let rgb = image.decode()?;
        let displacement = self.displacement(&rgb)?;
        let image = remap(&rgb, &displacement)?;
        let png = encode_png(&image)?;
        Ok(UnwarpOutput {
            image,
            png,
            displacement,
        })
    }
}

/// Resize `src` (`h x w x c`, row-major, each element read through `value`) to `oh x ow x c` with
/// bilinear interpolation, corners aligned (PyTorch's `F.interpolate(mode="bilinear",
/// align_corners=True)`).
fn resize_bilinear_aligned<T: Copy>(
    src: &[T],
    value: impl Fn(T) -> f32,
    (h, w, c): (usize, usize, usize),
    (oh, ow): (usize, usize),
) -> Vec<f32> {
    // (index below, index above, weight of the one above) for each output coordinate
    let taps = |n: usize, on: usize| -> Vec<(usize, usize, f32)> {
        let scale = if on > 1 {
            (n - 1) as f32 / (on - 1) as f32
        } else {
            0.0
        };
        (0..on)
            .map(|o| {
                let s = scale * o as f32;
                let i0 = (s as usize).min(n - 1);
                (i0, (i0 + 1).min(n - 1), s - i0 as f32)
            })
            .collect()
    };
    let (ty, tx) = (taps(h, oh), taps(w, ow));
    let mut out = Vec::with_capacity(oh * ow * c);
    for &(y0, y1, ly) in &ty {
        for &(x0, x1, lx) in &tx {
            for ch in 0..c {
                let at = |y: usize, x: usize| value(src[(y * w + x) * c + ch]);
                let top = (1.0 - lx) * at(y0, x0) + lx * at(y0, x1);
                let bottom = (1.0 - lx) * at(y1, x0) + lx * at(y1, x1);
                out.push((1.0 - ly) * top + ly * bottom);
            }
        }
    }
    out
}

/// Resample `image` through `grid`: the grid is resized to the image's size (bilinear, corners
/// aligned) and each output pixel is the bilinear sample of `image` at its point (corners aligned,
/// clamped to the border), rounded to 8 bits (PyTorch's `F.grid_sample(..., align_corners=True,
/// padding_mode="border")`).
pub fn remap(image: &RgbImage, grid: &Displacement) -> Result<RgbImage> {
    if grid.height == 0 || grid.width == 0 || grid.data.len() != grid.height * grid.width * 2 {
        return Err(ModelError::InvalidInput(format!(
            "grid of {}x{} needs {} values, got {}",
            grid.height,
            grid.width,
            grid.height * grid.width * 2,
            grid.data.len()
        ))
        .into());
    }
    let (w, h) = (image.width as usize, image.height as usize);
    let points = resize_bilinear_aligned(&grid.data, |v| v, (grid.height, grid.width, 2), (h, w));
    let unnormalize =
        |v: f32, n: usize| ((v + 1.0) / 2.0 * (n - 1) as f32).clamp(0.0, (n - 1) as f32);
    let mut data = Vec::with_capacity(w * h * 3);
    for p in points.chunks_exact(2) {
        // NaN coordinates (a diverged network) clamp to 0 through `as usize`
        let (x, y) = (unnormalize(p[0], w), unnormalize(p[1], h));
        let (x0, y0) = (x.floor() as usize, y.floor() as usize);
        let (x1, y1) = ((x0 + 1).min(w - 1), (y0 + 1).min(h - 1));
        let (fx, fy) = (x - x0 as f32, y - y0 as f32);
        for c in 0..3 {
            let v = (1.0 - fy)
                * ((1.0 - fx) * image.at(x0, y0, c) as f32 + fx * image.at(x1, y0, c) as f32)
                + fy * ((1.0 - fx) * image.at(x0, y1, c) as f32 + fx * image.at(x1, y1, c) as f32);
            data.push(v.round().clamp(0.0, 255.0) as u8);
        }
    }
    Ok(RgbImage::new(image.width, image.height, data)?)
}

/// PNG bytes of an 8-bit RGB image.
pub fn encode_png(image: &RgbImage) -> Result<Vec<u8>> {
    use image::ImageEncoder;
    let mut png = Vec::new();
    image::codecs::png::PngEncoder::new(&mut png)
        .write_image(
            &image.data,
            image.width,
            image.height,
            image::ExtendedColorType::Rgb8,
        )
        .map_err(|e| DocUnwarpError::Encode(e.to_string()))?;
    Ok(png)
}
