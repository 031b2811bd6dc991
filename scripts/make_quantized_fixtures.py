#!/usr/bin/env python3
"""Quantized fixtures made by mlx-lm from the tiny transformers fixtures, with mlx-lm's outputs.

    python3 scripts/make_quantized_fixtures.py [OUT_DIR [NAME...]]    (needs mlx-lm 0.32.2 and mlx[cpu] 0.32.4: mlx-lm
    0.32.2 passes gather_qmm a global_scale that MLX 0.32.2 lacks)

For each entry below: mlx-lm loads the bf16 fixture, casts it to f32 as `mlx_lm.convert
--dtype float32` does (the model's `cast_predicate` keeps some tensors in their dtype), quantizes it with `quantize_model` (mlx-lm's layer choice, MLX's
`mx.quantize`) and saves it with `save_model` / `save_config` into OUT_DIR/<name> (default: the
fixtures directory, crates/models/tests/fixtures/tiny, which holds the sources); NAMEs, when
given, pick entries (default: all). Then, on
the CPU in f32, it records in `reference.safetensors`: `input_ids` (the source fixture's 72-token
prompt), `logits` (full prefill), `greedy_ids` (prompt + 16 greedy tokens through mlx-lm's KV
cache) and `decode_logits`; `reference.json` records the settings and margins. The parity tests
load these directories with our loader, and quantize the source fixtures with our `quantize`
to compare against mlx-lm's tensors bit for bit.
"""
import json
import os
import shutil
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map, tree_map_with_path
import numpy as np
from mlx_lm.convert import mixed_quant_predicate_builder
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model, quantize_model, save_config, save_model

STEPS = 16

# f32 compute throughout: MLX dequantizes mxfp4/mxfp8/nvfp4 embedding rows to bf16 by default, so
# the reference casts them to f32 (our loader computes in f32 on the CPU; affine rows already come
# out in the f32 scales' dtype).
_embed = nn.QuantizedEmbedding.__call__
nn.QuantizedEmbedding.__call__ = lambda self, x: _embed(self, x).astype(mx.float32)

# mlx-lm 0.32's gemma3_text reads neither layer_types nor rope_parameters nor a final softcap:
# give it a config it reads the way transformers does (every third layer full, flat rope keys).
GEMMA3_FOR_MLX_LM = {
    "sliding_window_pattern": 3,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
    "rope_theta": 1e6, "rope_local_base_freq": 1e4, "rope_parameters": None, "final_logit_softcapping": None,
}

# name: (source fixture, mode, group size, bits, mixed recipe, config overrides)
FIXTURES = {
    "llama_q4": ("llama", "affine", 64, 4, None, None),
    "qwen3_untied_q8g32": ("qwen3_untied", "affine", 32, 8, None, None),
    "gemma3_text_mxfp4": ("gemma3_text", "mxfp4", None, None, None, GEMMA3_FOR_MLX_LM),
    "llama_mixed_3_6": ("llama_scaled", "affine", 32, None, "mixed_3_6", None),
    # MoE: stacked switch_mlp experts through gather_qmm
    "lfm2_moe_q4": ("lfm2_moe", "affine", 32, 4, None, None),
    "qwen3_5_moe_vl_q8": ("qwen3_5_moe_vl", "affine", 32, 8, None, None),
    # Gemma 4 MoE (fused `experts.gate_up_proj` split into `experts.switch_glu.{gate,up,down}_proj`
    # by mlx-lm's sanitize; its predicate puts `router.proj` at 8 bits in groups of 64).
    # mlx_lm.convert -q's defaults (affine 4/64): the experts' down_proj (32 wide) stays float.
    "gemma4_text_moe_q4": ("gemma4_text_moe", "affine", None, None, None, None),
    # mxfp4 (groups of 32): every expert projection packed, the router affine 8-bit.
    "gemma4_text_moe_mxfp4": ("gemma4_text_moe", "mxfp4", None, None, None, None),
    # Gemma 4 dense with per-layer input embeddings (a quantized embed_tokens_per_layer) and
    # KV-shared layers, affine 4-bit in groups of 32
    "gemma4_text_q4g32": ("gemma4_text", "affine", 32, 4, None, None),
}


def margins(logits):
    top2 = np.sort(logits, axis=-1)[..., -2:]
    return (top2[..., 1] - top2[..., 0]).tolist()


SOURCES = Path(__file__).resolve().parent.parent / "crates/models/tests/fixtures/tiny"


def build(root, name, src, mode, group_size, bits, recipe, overrides):
    mx.set_default_device(mx.cpu)
    # mlx-lm 0.32 reads the hub's flat rope keys, not transformers 5's rope_parameters: spell them out.
    src_cfg = json.load(open(SOURCES / src / "config.json"))
    rp = src_cfg.get("rope_parameters")
    if isinstance(rp, dict) and "rope_theta" in rp:
        flat = {"rope_theta": rp["rope_theta"]}
        if rp.get("rope_type", "default") != "default":
            flat["rope_scaling"] = rp
        overrides = {**flat, **(overrides or {})}
    model, config = load_model(SOURCES / src, model_config=overrides or {})
    # as mlx_lm.convert --dtype float32: floats cast unless the model's cast_predicate keeps them
    # (Qwen3.5's A_log, LFM2-MoE's expert_bias)
    keep = getattr(model, "cast_predicate", lambda _: True)
    model.update(tree_map_with_path(lambda p, v: v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) and keep(p) else v,
                                    model.parameters()))
    pred = mixed_quant_predicate_builder(recipe, model, group_size) if recipe else None
    model, config = quantize_model(model, config, group_size, bits, mode=mode, quant_predicate=pred)
    out = Path(root) / name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    save_model(out, model)
    config["torch_dtype"] = "float32"
    config = {k: v for k, v in config.items() if v is not None or k not in (overrides or {})}
    save_config(config, out / "config.json")

    model, _ = load_model(out)
    ids = np.array(mx.load(str(SOURCES / src / "reference.safetensors"))["input_ids"]).astype(np.int32)
    x = mx.array(ids)
    logits = model(x).astype(mx.float32)
    cache = make_prompt_cache(model)
    step = model(x, cache=cache)[:, -1].astype(mx.float32)
    seq, step_logits = [int(t) for t in ids[0]], []
    for _ in range(STEPS):
        step_logits.append(step[0])
        nxt = int(mx.argmax(step[0]).item())
        seq.append(nxt)
        step = model(mx.array([[nxt]]), cache=cache)[:, -1].astype(mx.float32)
    dl = mx.stack(step_logits)
    mx.save_safetensors(str(out / "reference.safetensors"), {
        "input_ids": mx.array(ids), "logits": logits, "greedy_ids": mx.array([seq], dtype=mx.int32), "decode_logits": dl})
    meta = dict(family=name, source_fixture=src, mode=mode, group_size=group_size, bits=bits, recipe=recipe,
                quantization=config["quantization"], prompt_len=int(ids.shape[1]), steps=STEPS,
                compute_dtype="float32", greedy_new_ids=seq[ids.shape[1]:],
                decode_top1_top2_margin_min=min(margins(np.array(dl))),
                mlx=mx.__version__, mlx_lm=__import__("mlx_lm").__version__)
    with open(out / "reference.json", "w") as f:
        json.dump(meta, f, indent=1)
    return meta


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else str(SOURCES)
    names = sys.argv[2:] or list(FIXTURES)
    unknown = [n for n in names if n not in FIXTURES]
    if unknown:
        sys.exit(f"unknown fixture(s) {unknown}; known: {list(FIXTURES)}")
    for name in names:
        spec = FIXTURES[name]
        m = build(root, name, *spec)
        print(name, m["greedy_new_ids"], "min decode margin", round(m["decode_top1_top2_margin_min"], 4))


if __name__ == "__main__":
    main()
