#!/usr/bin/env python3
"""Tiny random UVDoc document-unwarping checkpoint and its PyTorch reference, for
crates/models/tests/docunwarp.rs.

    python3 scripts/make_docunwarp_fixture.py OUT_DIR
    (needs torch, numpy, safetensors; /work/venvs/privacy/bin/python has them)

The network is written here from scratch in PyTorch (NCHW, `nn.Conv2d` / `nn.BatchNorm2d` in eval mode,
`padding_mode="reflect"` in the output head, `F.interpolate` and `F.grid_sample`), independent of the Rust
implementation, which runs NHWC on MLX:

- `resnet_head`: two (conv k x k, stride 2, no bias) + BN + ReLU;
- `resnet_down.layer1..3`: residual blocks (`block_nums`, default 3/4/6). Block 0 of a layer has plain
  convolutions with the layer's stride (default 1/2/2) and, when the stride is not 1 or the width
  changes, a `downsample` (conv k x k with bias + BN); blocks 1.. have dilation-3 convolutions. All
  block convolutions have biases; out = relu(bn2(conv2(relu(bn1(conv1(x))))) + residual);
- `bridge_1..6`: dilated 3x3 conv + BN + ReLU chains (dilations 1 / 2 / 5 / 8,3,2 / 12,7,4 / 18,12,6) on
  the encoder output, concatenated on channels, then `bridge_concat` (1x1 conv + BN + ReLU);
- `out_point_positions2D`: conv k x k (reflect padding, no bias) + BN + PReLU + conv k x k (reflect
  padding, bias) to 2 channels: the sampling grid (x, y) in [-1, 1] coordinates.

Tensor names are those of the MLX UVDoc checkpoints (`UVDoc-mlx`, converted from PaddleX's UVDoc): block
convolutions are `conv1.0` / `conv2.0`, single-branch bridges carry an extra level (`bridge_1.0.0.0` is the
convolution, `bridge_1.0.0.1` its BN), BN statistics are `running_mean` / `running_var`, there is no
`num_batches_tracked` and no 3-D head. config.json has the same four fields as those checkpoints
(`model_type`, `num_filter`, `kernel_size`, `img_size` as [width, height]); the rest are defaults.

Pipeline of the reference (PaddleX's `UVDocNet.forward`, with the sampler clamping to the border as
mlx-node's does): RGB / 255 resized to `img_size` with bilinear `align_corners=True`; the network; the
grid resized to the image size (bilinear, `align_corners=True`); `grid_sample` of the 8-bit image
(bilinear, `align_corners=True`, `padding_mode="border"`), rounded to 8 bits.

OUT_DIR receives `config.json`, `model.safetensors` (float32), `image.png` (a generated RGB picture,
written with zlib here), and `reference.safetensors`: `input` [1, H, W, 3] (the network input, NHWC),
`flow` [1, GH, GW, 2] (the network output, NHWC) and `unwarped` [h, w, 3] uint8.
"""
import argparse
import json
import os
import struct
import zlib

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save_file

SEED = 25
NUM_FILTER = 3
KERNEL = 5
IMG_SIZE = (72, 104)  # network input, [width, height]
IMAGE_WH = (45, 61)  # the test picture, width x height
GRID = (7, 5)  # the network's output, height x width
# --full-size: the published network's widths and input size (7.9 M parameters, 32 MB; not
# committed), for `cargo test -p mlx-models --test docunwarp -- --ignored` with DOCUNWARP_FULL_DIR
FULL = {"num_filter": 32, "img_size": (488, 712), "image_wh": (620, 877), "grid": (45, 31)}
MAP_NUM = (1, 2, 4)
BLOCK_NUMS = (3, 4, 6)
STRIDES = (1, 2, 2)
BRIDGES = ((1,), (2,), (5,), (8, 3, 2), (12, 7, 4), (18, 12, 6))


def bn(c):
    return nn.BatchNorm2d(c)


def conv_bn_relu(cin, cout, k, stride=1, dilation=1):
    pad = dilation * (k // 2)
    return nn.Sequential(nn.Conv2d(cin, cout, k, stride, pad, dilation, bias=False), bn(cout), nn.ReLU())


class Block(nn.Module):
    def __init__(self, cin, cout, k, stride, top):
        super().__init__()
        plain = stride != 1 or top
        dil = 1 if plain else 3
        pad = dil * (k // 2)
        self.conv1 = nn.Sequential(nn.Conv2d(cin, cout, k, stride if plain else 1, pad, dil))
        self.bn1 = bn(cout)
        self.conv2 = nn.Sequential(nn.Conv2d(cout, cout, k, 1, pad, dil))
        self.bn2 = bn(cout)
        self.downsample = None
        if top and (stride != 1 or cin != cout):
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, k, stride, k // 2), bn(cout))

    def forward(self, x):
        res = x if self.downsample is None else self.downsample(x)
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + res)


class Encoder(nn.Module):
    def __init__(self, nf, k):
        super().__init__()
        cin = nf * MAP_NUM[0]
        for i, (m, n, s) in enumerate(zip(MAP_NUM, BLOCK_NUMS, STRIDES)):
            cout = nf * m
            blocks = [Block(cin, cout, k, s, True)] + [Block(cout, cout, k, 1, False) for _ in range(n - 1)]
            setattr(self, f"layer{i + 1}", nn.Sequential(*blocks))
            cin = cout

    def forward(self, x):
        return self.layer3(self.layer2(self.layer1(x)))


class UVDoc(nn.Module):
    def __init__(self, nf=NUM_FILTER, k=KERNEL):
        super().__init__()
        c0, c2 = nf * MAP_NUM[0], nf * MAP_NUM[2]
        self.resnet_head = nn.Sequential(
            nn.Conv2d(3, c0, k, 2, k // 2, bias=False), bn(c0), nn.ReLU(),
            nn.Conv2d(c0, c0, k, 2, k // 2, bias=False), bn(c0), nn.ReLU())
        self.resnet_down = Encoder(nf, k)
        for i, dils in enumerate(BRIDGES):
            chain = nn.Sequential(*[conv_bn_relu(c2, c2, 3, dilation=d) for d in dils])
            # one-convolution branches are nested one level deeper in the checkpoints
            setattr(self, f"bridge_{i + 1}", nn.Sequential(chain) if len(dils) == 1 else chain)
        self.bridge_concat = nn.Sequential(nn.Conv2d(6 * c2, c2, 1, bias=False), bn(c2), nn.ReLU())
        self.out_point_positions2D = nn.Sequential(
            nn.Conv2d(c2, c0, k, 1, k // 2, bias=False, padding_mode="reflect"), bn(c0), nn.PReLU(),
            nn.Conv2d(c0, 2, k, 1, k // 2, padding_mode="reflect"))

    def forward(self, x):
        x = self.resnet_down(self.resnet_head(x))
        b = torch.cat([getattr(self, f"bridge_{i + 1}")(x) for i in range(6)], dim=1)
        return self.out_point_positions2D(self.bridge_concat(b))


def randomize(model, gen):
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            fan_in = m.weight[0].numel()
            m.weight.data = torch.randn(m.weight.shape, generator=gen) * (1.6 / fan_in) ** 0.5
            if m.bias is not None:
                m.bias.data = torch.rand(m.bias.shape, generator=gen) * 0.4 - 0.2
        elif isinstance(m, nn.BatchNorm2d):
            c = m.num_features
            m.weight.data = torch.rand(c, generator=gen) + 0.5
            m.bias.data = torch.rand(c, generator=gen) * 0.4 - 0.2
            m.running_mean.data = torch.rand(c, generator=gen) * 0.4 - 0.2
            m.running_var.data = torch.rand(c, generator=gen) + 0.5
        elif isinstance(m, nn.PReLU):
            m.weight.data = torch.tensor([0.15])


def picture(w, h):
    """A deterministic RGB test picture: gradients, a checkerboard and a disc, with seeded noise."""
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    r = 255 * x / (w - 1)
    g = 255 * y / (h - 1)
    b = np.where(((x // 6) + (y // 6)) % 2 == 0, 230.0, 25.0)
    disc = (x - w * 0.6) ** 2 + (y - h * 0.4) ** 2 < (min(w, h) * 0.25) ** 2
    r = np.where(disc, 255 - r, r)
    img = np.stack([r, g, b], axis=-1) + np.random.default_rng(SEED).normal(0, 8, (h, w, 3))
    return np.clip(np.rint(img), 0, 255).astype(np.uint8)


def write_png(path, img):
    h, w, _ = img.shape
    raw = b"".join(b"\x00" + img[row].tobytes() for row in range(h))

    def chunk(tag, data):
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
    png += chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")
    with open(path, "wb") as f:
        f.write(png)


@torch.no_grad()
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--full-size", action="store_true", help="the published widths and 488x712 input, a 620x877 picture")
    args = ap.parse_args()
    out = args.out_dir
    nf, img_size, image_wh, grid_hw = NUM_FILTER, IMG_SIZE, IMAGE_WH, GRID
    if args.full_size:
        nf, img_size, image_wh, grid_hw = FULL["num_filter"], FULL["img_size"], FULL["image_wh"], FULL["grid"]
    os.makedirs(out, exist_ok=True)
    gen = torch.Generator().manual_seed(SEED)
    model = UVDoc(nf)
    randomize(model, gen)
    model.eval()

    img = picture(*image_wh)
    x = torch.from_numpy(img).permute(2, 0, 1)[None].double()
    inp = F.interpolate(x.float() / 255, size=(img_size[1], img_size[0]), mode="bilinear", align_corners=True)
    flow = model(inp)
    # Scale the last convolution so the grid spans about [-1.25, 1.25]: most samples land inside the
    # picture (interpolated), a few past its edges (clamped).
    scale = 1.25 / flow.abs().max().item()
    last = model.out_point_positions2D[3]
    last.weight.data *= scale
    last.bias.data *= scale
    flow = model(inp)
    assert flow.shape[2:] == grid_hw, flow.shape
    grid = F.interpolate(flow, size=img.shape[:2], mode="bilinear", align_corners=True).permute(0, 2, 3, 1)
    sampled = F.grid_sample(x.float(), grid, mode="bilinear", padding_mode="border", align_corners=True)
    unwarped = sampled[0].permute(1, 2, 0).round().clamp(0, 255).to(torch.uint8)
    inside = (grid.abs() <= 1).all(-1).float().mean().item()
    print(f"grid {tuple(flow.shape[2:])}, range [{flow.min():.3f}, {flow.max():.3f}], {inside:.1%} of samples inside")

    sd = {k: v.contiguous() for k, v in model.state_dict().items() if not k.endswith("num_batches_tracked")}
    save_file(sd, os.path.join(out, "model.safetensors"))
    config = {"model_type": "uvdoc", "num_filter": nf, "kernel_size": KERNEL, "img_size": list(img_size)}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    write_png(os.path.join(out, "image.png"), img)
    save_file({"input": inp.permute(0, 2, 3, 1).contiguous(), "flow": flow.permute(0, 2, 3, 1).contiguous(),
               "unwarped": unwarped.contiguous()}, os.path.join(out, "reference.safetensors"))
    print(f"{len(sd)} tensors, {sum(v.numel() for v in sd.values())} parameters -> {out}")


if __name__ == "__main__":
    main()
