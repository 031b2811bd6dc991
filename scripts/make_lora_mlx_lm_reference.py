#!/usr/bin/env python3
"""LoRA adapters made by mlx-lm, for crates/training/tests/lora_mlx_lm.rs, and a check of ours.

Reference mode (no arguments): for the tiny Qwen3 (float) and Llama q4 (quantized, QLoRA)
fixtures, loaded with mlx_lm.utils.load_model and cast to float32, applies mlx-lm's
linear_to_lora_layers (rank 4, scale 3, the last 2 layers, q_proj/v_proj/down_proj; for Llama
the default keys: every linear projection), sets every lora_b to seeded non-zero values, and
saves with mlx-lm's own code paths:
  crates/training/tests/fixtures/mlx_lm_lora/<fixture>/adapters.safetensors, adapter_config.json
  crates/training/tests/fixtures/mlx_lm_lora/<fixture>/logits.safetensors
    "adapted": logits of IDS through the LoRA model (mlx-lm's forward),
    "fused": logits of IDS after mlx-lm's LoRALinear.fuse() (requantized for the q4 base, as
    mlx_lm.fuse does without --dequantize).

Check mode: `--check FIXTURE_DIR ADAPTER_DIR LOGITS.safetensors` loads our adapters with
mlx_lm.tuner.utils.load_adapters over the fixture and compares its logits of IDS with the
"adapted" logits we computed; exits non-zero beyond 1e-4 relative to the largest logit.

Run with mlx-lm 0.32.2: /work/venvs/mlxlm/bin/python scripts/make_lora_mlx_lm_reference.py
"""
import json
import os
import sys
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.tuner.lora import LoRALinear
from mlx_lm.tuner.utils import linear_to_lora_layers, load_adapters
from mlx_lm.utils import load_model

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "crates/models/tests/fixtures/tiny"
OUT = ROOT / "crates/training/tests/fixtures/mlx_lm_lora"
IDS = [1, 5, 9, 17, 33, 2, 250, 100]
CASES = {
    "qwen3": {"rank": 4, "scale": 3.0, "dropout": 0.0, "keys": ["self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"]},
    "llama_q4": {"rank": 4, "scale": 3.0, "dropout": 0.0},
}
NUM_LAYERS = 2


def load_f32(path):
    model, _ = load_model(Path(path))
    model.set_dtype(mx.float32)
    return model


def logits(model):
    return model(mx.array([IDS])).astype(mx.float32)


def reference():
    for name, params in CASES.items():
        mx.random.seed(21)
        model = load_f32(FIXTURES / name)
        model.freeze()
        linear_to_lora_layers(model, NUM_LAYERS, params)
        for i, (n, m) in enumerate(model.named_modules()):
            if isinstance(m, LoRALinear):
                m.lora_b = mx.random.normal(m.lora_b.shape, key=mx.random.key(1000 + i)) * 0.05
        out = OUT / name
        out.mkdir(parents=True, exist_ok=True)
        adapters = dict(tree_flatten(model.trainable_parameters()))
        mx.save_safetensors(str(out / "adapters.safetensors"), adapters)
        # mlx_lm.lora writes vars(args); these are the fields its loader reads
        config = {"fine_tune_type": "lora", "num_layers": NUM_LAYERS, "lora_parameters": params}
        (out / "adapter_config.json").write_text(json.dumps(config, indent=4) + "\n")
        adapted = logits(model)
        fused = [(n, m.fuse(dequantize=False)) for n, m in model.named_modules() if isinstance(m, LoRALinear)]
        from mlx.utils import tree_unflatten
        model.update_modules(tree_unflatten(fused))
        fused_logits = logits(model)
        mx.save_safetensors(str(out / "logits.safetensors"), {"adapted": adapted, "fused": fused_logits})
        print(f"{name}: {len(adapters)} adapter tensors, fused moves logits by {mx.abs(fused_logits - adapted).max().item():.3e}")


def check(fixture, adapter_dir, logits_file):
    model = load_f32(fixture)
    load_adapters(model, adapter_dir)
    ours = mx.load(logits_file)["adapted"]
    theirs = logits(model)
    err = mx.abs(ours - theirs).max().item()
    scale = max(mx.abs(theirs).max().item(), 1.0)
    print(json.dumps({"max_abs_logit_diff": err, "max_abs_logit": scale}))
    sys.exit(0 if err <= 1e-4 * scale else 1)


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--check":
        check(*sys.argv[2:])
    else:
        reference()
