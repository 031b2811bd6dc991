#!/usr/bin/env python3
"""Draft/target pairs for the speculative benchmarks, made from one checkpoint (a Llama/Qwen-style
Hugging Face directory: `model.layers.N.*`):

  deep SRC OUT --extra N [--scale S]
      a target that is SRC with N more decoder layers after its own (copies of SRC's layers,
      cycling, whose attention and MLP output projections are scaled by S, default 0.02): the
      extra layers add little to SRC's residual stream, so SRC drafts for it with high
      agreement, while the target costs (L + N) / L times as much per token.
  random SRC OUT [--seed K]
      SRC's shape with random weights (N(0, 0.02), norms 1): a draft that never agrees.

Writes OUT/config.json, OUT/model.safetensors and SRC's tokenizer files. Needs mlx (the mlx-lm
venv of benches/setup_mlx_lm.sh).
  python3 crates/speculative/benches/make_pairs.py deep ~/.cache/mlx-models/SmolLM2-135M-Instruct /tmp/smollm2-deep --extra 90
"""
import argparse
import json
import os
import re
import shutil

import mlx.core as mx

OUT_PROJ = ("self_attn.o_proj.weight", "mlp.down_proj.weight")


def load(src):
    w = {}
    for f in sorted(os.listdir(src)):
        if f.endswith(".safetensors"):
            w.update(mx.load(os.path.join(src, f)))
    with open(os.path.join(src, "config.json")) as f:
        return w, json.load(f)


def save(out, src, weights, cfg):
    os.makedirs(out, exist_ok=True)
    for f in os.listdir(src):
        if f.startswith("tokenizer") or f == "generation_config.json":
            shutil.copy(os.path.join(src, f), out)
    tmp = os.path.join(out, "model.tmp.safetensors")
    mx.save_safetensors(tmp, weights)
    os.replace(tmp, os.path.join(out, "model.safetensors"))
    with open(os.path.join(out, "config.json.tmp"), "w") as f:
        json.dump(cfg, f, indent=2)
    os.replace(os.path.join(out, "config.json.tmp"), os.path.join(out, "config.json"))


def deep(a):
    w, cfg = load(a.src)
    n = cfg["num_hidden_layers"]
    layer = re.compile(r"model\.layers\.(\d+)\.(.*)")
    per = {}
    for k, v in w.items():
        m = layer.fullmatch(k)
        if m:
            per.setdefault(int(m.group(1)), {})[m.group(2)] = v
    out = dict(w)
    for j in range(a.extra):
        for name, v in per[j % n].items():
            out[f"model.layers.{n + j}.{name}"] = v * a.scale if name in OUT_PROJ else v
    cfg["num_hidden_layers"] = n + a.extra
    cfg.pop("layer_types", None)
    save(a.out, a.src, out, cfg)


def random(a):
    w, cfg = load(a.src)
    mx.random.seed(a.seed)
    out = {}
    for k, v in w.items():
        if k.endswith("norm.weight"):
            out[k] = mx.ones(v.shape, dtype=v.dtype)
        else:
            out[k] = (0.02 * mx.random.normal(v.shape)).astype(v.dtype)
    save(a.out, a.src, out, cfg)


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("deep")
    d.add_argument("src")
    d.add_argument("out")
    d.add_argument("--extra", type=int, required=True)
    d.add_argument("--scale", type=float, default=0.02)
    r = sub.add_parser("random")
    r.add_argument("src")
    r.add_argument("out")
    r.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    {"deep": deep, "random": random}[a.cmd](a)


if __name__ == "__main__":
    main()
