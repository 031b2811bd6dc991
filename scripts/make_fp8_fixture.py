#!/usr/bin/env python3
"""A block-scaled FP8 checkpoint (the layout of Qwen3's FP8 releases) made from the tiny Qwen3
fixture, and the weights an independent decoder reads from its bytes.

    python3 scripts/make_fp8_fixture.py [OUT_DIR]     (needs numpy, ml_dtypes, safetensors)

Every linear weight of the decoder layers is stored as `weight` in F8_E4M3 (e4m3fn, rounded by
ml_dtypes) with `weight_scale_inv` (f32, one per 32 x 32 block: amax / 448); config.json gets
`quantization_config = {"quant_method": "fp8", "weight_block_size": [32, 32], ...}`.
`dequantized.safetensors` holds ml_dtypes' decoding of those bytes times the block scales, in
f32: the parity test loads a checkpoint of these next to the FP8 one (its dense path is the
Qwen3 family's, checked against transformers) and requires the same logits.
"""
import json
import os
import shutil
import struct
import sys

import ml_dtypes
import numpy as np
from safetensors.numpy import load_file, save_file

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "crates", "models", "tests", "fixtures", "tiny")
SRC = os.path.join(ROOT, "qwen3")
BLOCK = 32


def fp8(w):
    o, i = w.shape
    b = w.astype(np.float32).reshape(o // BLOCK, BLOCK, i // BLOCK, BLOCK)
    scale = np.maximum(np.abs(b).max(axis=(1, 3)), 1e-12) / np.float32(448.0)
    q = (b / scale[:, None, :, None]).reshape(o, i).astype(ml_dtypes.float8_e4m3fn)
    deq = (q.astype(np.float32).reshape(o // BLOCK, BLOCK, i // BLOCK, BLOCK) * scale[:, None, :, None]).reshape(o, i)
    return q.view(np.uint8), scale.astype(np.float32), deq.astype(np.float32)


def write_safetensors(path, tensors):
    """tensors: name -> (dtype name, shape, bytes)."""
    header, off, blobs = {"__metadata__": {"format": "pt"}}, 0, []
    for name in sorted(tensors):
        dt, shape, data = tensors[name]
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + len(data)]}
        off += len(data)
        blobs.append(data)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        for b in blobs:
            f.write(b)


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "qwen3_fp8")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    import ml_dtypes as _  # noqa: F401  (bf16 arrays below come back as ml_dtypes.bfloat16)
    w = load_file(os.path.join(SRC, "model.safetensors"))
    stored, dense = {}, {}
    names = {np.dtype(ml_dtypes.bfloat16): "BF16", np.dtype(np.float32): "F32", np.dtype(np.float16): "F16"}
    for k, v in w.items():
        if ".layers." in k and k.endswith("_proj.weight"):
            q, s, d = fp8(v)
            stored[k] = ("F8_E4M3", q.shape, q.tobytes())
            stored[k.replace(".weight", ".weight_scale_inv")] = ("F32", s.shape, s.tobytes())
            dense[k] = d
        else:
            stored[k] = (names[v.dtype], v.shape, v.tobytes())
            dense[k] = v.astype(np.float32)
    write_safetensors(os.path.join(out, "model.safetensors"), stored)
    save_file(dense, os.path.join(out, "dequantized.safetensors"))
    cfg = json.load(open(os.path.join(SRC, "config.json")))
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK]}
    json.dump(cfg, open(os.path.join(out, "config.json"), "w"), indent=1)
    shutil.copy(os.path.join(SRC, "reference.safetensors"), os.path.join(out, "prompt.safetensors"))
    for f in ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]:
        if os.path.exists(os.path.join(SRC, f)):
            shutil.copy(os.path.join(SRC, f), out)
    print("wrote", out, len(stored), "tensors")


if __name__ == "__main__":
    main()
