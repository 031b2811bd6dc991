#!/usr/bin/env python3
"""Tiny activation-quantised checkpoints and mlx-lm's activation maxima on them, for the calibration test.

    python3 scripts/make_amax_fixture.py    (mlx-lm 0.32.2, mlx[cpu] 0.32.4, tokenizers)

mlx-lm loads the tiny Qwen3 fixture, casts it to f32 and quantizes it with `quantize_model` into
crates/models/tests/fixtures/tiny/<name> (`save_model` / `save_config`, with the tokenizer files
and `calibration.txt`, the texts one per line):
- qwen3_mxfp8_attn: the attention projections (`self_attn.{q,k,v,o}_proj`) in mxfp8 through
  per-layer entries, the rest in its default affine 4-bit groups of 64 (the layout of NVIDIA's
  mxfp8-attention recipe); sites: the mxfp8 projections;
- qwen3_nvfp4: every layer in nvfp4 (mlx-lm's `--q-mode nvfp4`); sites: every nvfp4 linear layer.

The reference (independent of our loader): each text is encoded with the `tokenizers` package
(the tokenizer's own special tokens, no chat template), cut to SEQ_LEN tokens and prefilled by
mlx-lm's model on the CPU; a wrapper around `nn.QuantizedLinear.__call__` records max |x| of the
input of every site, the running maximum over the texts (modelopt's MaxCalibrator). Then, with
each site's input quantized and dequantized with that maximum (mxfp8: E4M3 with one scale,
`from_fp8(to_fp8(x * 448/amax)) * amax/448`; nvfp4: `mx.quantize(x, mode="nvfp4",
global_scale=amax)` and back; both in f32), mlx-lm's logits on a 24-token prompt, and the plain
logits for contrast. `reference.json` holds the ids and maxima, `reference.safetensors` the
prompt and both logits. mlx-lm dequantizes nvfp4 embedding rows to bf16 by default; they are
cast to f32 here (our loader computes in f32 on the CPU).
"""
import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_map
from mlx_lm.utils import load_model, quantize_model, save_config, save_model
from tokenizers import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "crates/models/tests/fixtures/tiny"
SOURCE = TINY / "qwen3"
SEQ_LEN = 24
SITES = (".self_attn.q_proj", ".self_attn.k_proj", ".self_attn.v_proj", ".self_attn.o_proj")
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Calibration runs a prefill over raw text and records the largest activation of each projection.",
    "def add(a, b):\\n    return a + b",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30",
    "Ünïcödé, emoji 🙂 and CJK 漢字 mixed into one line.",
    "short",
]
E4M3_MAX = np.float32(448.0)

mx.set_default_device(mx.cpu)
_embed = nn.QuantizedEmbedding.__call__
nn.QuantizedEmbedding.__call__ = lambda self, x: _embed(self, x).astype(mx.float32)


def mxfp8_attention(path, module):
    if path.endswith(SITES):
        return {"group_size": 32, "bits": 8, "mode": "mxfp8"}
    return True


def fake_quant(x, a, mode):
    xf = x.astype(mx.float32)
    if mode == "mxfp8":
        q = mx.to_fp8(xf * mx.array(E4M3_MAX / a, dtype=mx.float32))
        return (mx.from_fp8(q, mx.float32) * mx.array(a / E4M3_MAX, dtype=mx.float32)).astype(x.dtype)
    g = mx.array(a, dtype=mx.float32)
    w, s = mx.quantize(xf, mode="nvfp4", global_scale=g)[:2]
    return mx.dequantize(w, s, mode="nvfp4", global_scale=g, dtype=mx.float32).astype(x.dtype)


def build(name, quantize_args, site_mode, n_sites):
    out = TINY / name
    model, config = load_model(SOURCE)
    model.update(tree_map(lambda v: v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v, model.parameters()))
    model, config = quantize_model(model, config, **quantize_args)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    save_model(out, model)
    config["torch_dtype"] = "float32"
    save_config(config, out / "config.json")
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copyfile(SOURCE / f, out / f)
    (out / "calibration.txt").write_text("".join(t + "\n" for t in TEXTS))

    # the reference, from the files just written
    model, _ = load_model(out)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    rows = [tok.encode(t, add_special_tokens=True).ids[:SEQ_LEN] for t in TEXTS]
    rows = [r for r in rows if r]
    for path, m in model.named_modules():
        if isinstance(m, nn.QuantizedLinear) and m.mode == site_mode and path != "lm_head":
            m.calib_key = path

    amax = {}
    state = {"recording": True, "fake_quant": False}
    _call = nn.QuantizedLinear.__call__

    def call(self, x):
        key = getattr(self, "calib_key", None)
        if key is not None and state["recording"]:
            v = mx.max(mx.abs(x.astype(mx.float32))).item()
            amax[key] = max(amax.get(key, 0.0), v)
        if key is not None and state["fake_quant"]:
            x = fake_quant(x, np.float32(amax[key]), site_mode)
        return _call(self, x)

    nn.QuantizedLinear.__call__ = call
    try:
        for r in rows:
            mx.eval(model(mx.array([r])))
        assert len(amax) == n_sites, sorted(amax)
        state["recording"] = False
        prompt = mx.array(np.array(mx.load(str(SOURCE / "reference.safetensors"))["input_ids"]).astype(np.int32)[:, :24])
        plain = model(prompt).astype(mx.float32)
        state["fake_quant"] = True
        quantized = model(prompt).astype(mx.float32)
        mx.eval(plain, quantized)
    finally:
        nn.QuantizedLinear.__call__ = _call
    mx.save_safetensors(str(out / "reference.safetensors"), {"input_ids": prompt, "logits_plain": plain, "logits_fakequant": quantized})
    rel = float(mx.max(mx.abs(plain - quantized)).item() / mx.max(mx.abs(quantized)).item())
    json.dump(
        {
            "seq_len": SEQ_LEN,
            "texts": "calibration.txt",
            "site_mode": site_mode,
            "ids": rows,
            "amax": dict(sorted(amax.items())),
            "fakequant_vs_plain_rel_diff": rel,
            "mlx": mx.__version__,
        },
        open(out / "reference.json", "w"),
        indent=1,
    )
    print(f"{out}: {len(rows)} rows, {len(amax)} projections; quantized-activation vs plain logits rel diff {rel:.3e}")


build("qwen3_mxfp8_attn", dict(group_size=64, bits=4, mode="affine", quant_predicate=mxfp8_attention), "mxfp8", 12)
build("qwen3_nvfp4", dict(group_size=None, bits=None, mode="nvfp4"), "nvfp4", 21)
