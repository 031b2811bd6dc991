#!/usr/bin/env python3
"""Reference gradients of the MoE fixtures for crates/training/tests/moe_gradients.rs, computed
with torch + transformers (f32, eager attention).

For each tiny MoE fixture (LFM2-MoE, Qwen3.5-MoE, Gemma 4 MoE under
crates/models/tests/fixtures/tiny) and the fixed pre-tokenised examples below: the SFT loss (mean
cross-entropy over every completion token of the batch; each sequence runs alone, which equals a
right-padded causal batch) and, for every parameter by its checkpoint name, the gradient's norm
and its dot product with the probe `cos(0.37 i)` over the flattened (row-major) tensor, in float64.
transformers holds the experts of LFM2-MoE and Qwen3.5-MoE fused (`experts.gate_up_proj`,
`experts.down_proj`); their gradients are cut into the checkpoint's per-expert tensors, each slice
located by matching the loaded weights. The full gradients would be megabytes; norms and probe
products pin each tensor's gradient (a relative error e of the gradient moves the probe product
by at most e ||g|| ||probe||).

Writes crates/training/tests/fixtures/moe_grad_reference.json.
Run: python3 scripts/make_moe_gradient_reference.py   (torch, transformers >= 5.17, safetensors)
"""
import json
import math
import os
import re

import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "crates/models/tests/fixtures/tiny")
OUT = os.path.join(ROOT, "crates/training/tests/fixtures/moe_grad_reference.json")
FIXTURES = ["lfm2_moe", "qwen3_5_moe", "gemma4_text_moe"]
EXAMPLES = [
    ([3, 17, 99, 4], [250, 8, 61, 7, 12]),
    ([40, 41], [30, 31, 7, 9]),
    ([5, 6, 7, 8, 9, 10], [11, 12, 300, 301, 302, 303, 20]),
]


def probe(n):
    i = torch.arange(n, dtype=torch.float64)
    return torch.cos(0.37 * i)


def stats(g):
    g = g.detach().to(torch.float64).reshape(-1)
    return {"norm": g.norm().item(), "probe": (g * probe(g.numel())).sum().item()}


def checkpoint_tensors(name):
    with safe_open(os.path.join(TINY, name, "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k).to(torch.float32) for k in f.keys()}


def expert_slices(model, ckpt):
    """Checkpoint per-expert key -> (fused parameter name, index tuple) by matching weights."""
    params = dict(model.named_parameters())
    out = {}
    pat = re.compile(r"^(.*\.experts)\.(\d+)\.(\w+)\.weight$")
    for key, w in ckpt.items():
        m = pat.match(key)
        if not m or key in params:
            continue
        prefix, e = m.group(1), int(m.group(2))
        found = None
        for fused in ("gate_up_proj", "down_proj"):
            p = params.get(f"{prefix}.{fused}")
            if p is None:
                continue
            rows = p.shape[1]
            cands = [(e,), (e, slice(0, rows // 2)), (e, slice(rows // 2, rows))] if fused == "gate_up_proj" else [(e,)]
            for idx in cands:
                part = p.detach()[idx]
                if part.shape == w.shape and torch.equal(part, w):
                    found = (f"{prefix}.{fused}", idx)
                    break
            if found:
                break
        assert found, f"no fused slice holds {key}"
        out[key] = found
    return out


def reference(name):
    model = AutoModelForCausalLM.from_pretrained(os.path.join(TINY, name), dtype=torch.float32, attn_implementation="eager")
    model.train()
    ckpt = checkpoint_tensors(name)
    slices = expert_slices(model, ckpt)
    total = sum(len(c) for _, c in EXAMPLES)
    loss = 0.0
    for prompt, completion in EXAMPLES:
        ids = torch.tensor([prompt + completion])
        logits = model(input_ids=ids).logits[0].float()
        n = len(prompt)
        pred = logits[n - 1 : n - 1 + len(completion)]
        ce = torch.nn.functional.cross_entropy(pred, torch.tensor(completion), reduction="sum") / total
        ce.backward()
        loss += ce.item()
    params = dict(model.named_parameters())
    grads = {}
    for n, p in params.items():
        if n in ckpt and p.grad is not None:
            grads[n] = stats(p.grad)
    for key, (fused, idx) in slices.items():
        grads[key] = stats(params[fused].grad[idx])
    flat = [p.grad.detach().to(torch.float64).reshape(-1) for p in params.values() if p.grad is not None]
    global_norm = torch.cat(flat).norm().item()
    assert all(math.isfinite(v["norm"]) for v in grads.values())
    return {"loss": loss, "global_norm": global_norm, "gradients": grads}


def main():
    import transformers

    out = {
        "generator": "scripts/make_moe_gradient_reference.py",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "probe": "cos(0.37 i) over the flattened gradient, float64",
        "examples": [[p, c] for p, c in EXAMPLES],
        "models": {name: reference(name) for name in FIXTURES},
    }
    with open(OUT + ".tmp", "w") as f:
        json.dump(out, f, indent=1, sort_keys=True)
    os.replace(OUT + ".tmp", OUT)
    for name, r in out["models"].items():
        print(f"{name}: loss {r['loss']:.6f}, global norm {r['global_norm']:.6f}, {len(r['gradients'])} tensors")


if __name__ == "__main__":
    main()
