#!/usr/bin/env python3
"""Reference values for crates/training's tests, computed with torch + transformers.

Loads the tiny Qwen3 fixture (crates/models/tests/fixtures/tiny/qwen3) in float32 and, on fixed
pre-tokenised batches (right-padded, loss on completion tokens only):

* one SFT step: the loss (mean cross-entropy over the batch's loss tokens, with and without label
  smoothing) and the gradient of every parameter (tied embeddings: one tensor, the sum of both uses);
* the trainable parameters after three AdamW steps (torch.optim.AdamW, betas 0.9/0.999, eps 1e-8,
  weight decay 0.01) with gradient clipping by global norm (torch.nn.utils.clip_grad_norm_), and
  after three SGD steps with momentum 0.9 and clipping by value (clip_grad_value_), training the
  attention projections and norms only (embeddings and MLPs frozen).

LoRA (lora_reference.*): adapters as mlx-lm's LoRALinear computes them, `y = W x + scale (x A) B`
(A `[in, r]`, B `[r, out]`), on LORA["keys"] of the last LORA["num_layers"] layers, from fixed
initial A and B (B non-zero so that both get gradients), base weights frozen: the loss and the
adapters' gradients on the first batch, and the adapters after three AdamW steps with clipping.

Writes crates/training/tests/fixtures/reference.safetensors and reference.json, and
lora_reference.safetensors and lora_reference.json.
Run: python3 scripts/make_training_reference.py   (torch, transformers and safetensors installed)

`--check-state OUT_DIR` instead reads a checkpoint the `sft` example wrote with Python's
safetensors reader and checks mlx-node's optimizer state layout: `{param}.m` and `{param}.v`
(AdamW) or `{param}.momentum` (SGD) for every trained parameter, shaped like it, and metadata
`step` and `format`, consistent with trainer_state.json.
"""
import sys
import json
import os

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.path.join(ROOT, "crates/models/tests/fixtures/tiny/qwen3")
OUT = os.path.join(ROOT, "crates/training/tests/fixtures")
PAD = 486

# Pre-tokenised examples: (prompt_ids, completion_ids).
BATCHES = [
    [([3, 17, 99, 4], [250, 8, 61, 7, 12]), ([40, 41, 42], [300, 301, 7])],
    [([5, 6, 7, 8, 9, 10], [11, 12]), ([100, 200], [300, 400, 500, 20, 21, 22])],
]
LABEL_SMOOTHING = 0.1
ADAMW = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, max_grad_norm=30.0, steps=3)
SGD = dict(lr=0.5, momentum=0.9, clip_value=0.02, steps=3)
LORA = dict(rank=4, scale=2.0, num_layers=2, keys=["self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"],
            lr=1e-2, max_grad_norm=1.0, steps=3)


def trainable(name):
    return "self_attn" in name or "norm" in name


def batch_tensors(batch):
    seqs = [p + c for p, c in batch]
    masks = [[0] * len(p) + [1] * len(c) for p, c in batch]
    width = max(len(s) for s in seqs)
    ids = torch.tensor([s + [PAD] * (width - len(s)) for s in seqs])
    mask = torch.tensor([m + [0] * (width - len(m)) for m in masks], dtype=torch.bool)
    return ids, mask


def loss_of(model, batch, label_smoothing=0.0):
    ids, mask = batch_tensors(batch)
    logits = model(input_ids=ids[:, :-1]).logits.float()
    targets, weights = ids[:, 1:], mask[:, 1:]
    return torch.nn.functional.cross_entropy(logits[weights], targets[weights], label_smoothing=label_smoothing)


def load():
    model = AutoModelForCausalLM.from_pretrained(FIXTURE, dtype=torch.float32)
    model.eval()  # no dropout (the fixture has none anyway)
    return model


def named(model):
    # tied embeddings: one parameter under the checkpoint's name
    return {n: p for n, p in model.named_parameters()}


def unit_optimizers():
    p0 = [0.5, -1.25, 2.0, 0.0, 3e-3, -0.75]
    grads = [[0.1, -0.2, 0.3, 1e-6, -2.0, 0.05], [-0.3, -0.1, 0.25, 0.0, 1.5, 0.05], [0.2, 0.4, -0.5, -1e-6, 0.5, -0.05]]
    out = {"p0": p0, "grads": grads}
    for tag, make in [
        ("adamw", lambda ps: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.01)),
        ("adamw_wd0.1", lambda ps: torch.optim.AdamW(ps, lr=0.05, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)),
        ("sgd", lambda ps: torch.optim.SGD(ps, lr=0.1)),
        ("sgd_momentum", lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01)),
    ]:
        p = torch.nn.Parameter(torch.tensor(p0))
        opt = make([p])
        for g in grads:
            p.grad = torch.tensor(g)
            opt.step()
        out[tag] = p.detach().tolist()
    return out


def main():
    torch.manual_seed(0)
    tensors, meta = {}, {"batches": BATCHES, "pad": PAD, "label_smoothing": LABEL_SMOOTHING, "adamw": ADAMW, "sgd": SGD}

    model = load()
    params = named(model)
    for ls, tag in [(0.0, "plain"), (LABEL_SMOOTHING, "smoothed")]:
        model.zero_grad()
        loss = loss_of(model, BATCHES[0], ls)
        loss.backward()
        meta[f"loss_{tag}"] = loss.item()
        if tag == "plain":
            norms = {n: p.grad.norm().item() for n, p in params.items()}
            meta["grad_norms"] = norms
            meta["grad_global_norm"] = torch.sqrt(sum(p.grad.pow(2).sum() for p in params.values())).item()
            for n, p in params.items():
                tensors[f"grad.{n}"] = p.grad.detach().clone().contiguous()
    meta["loss_batch1"] = loss_of(model, BATCHES[1]).item()

    # AdamW with clipping by global norm; batches alternate
    model = load()
    ps = {n: p for n, p in named(model).items() if trainable(n)}
    for n, p in named(model).items():
        p.requires_grad_(trainable(n))
    opt = torch.optim.AdamW(ps.values(), lr=ADAMW["lr"], betas=ADAMW["betas"], eps=ADAMW["eps"], weight_decay=ADAMW["weight_decay"])
    pre = []
    for s in range(ADAMW["steps"]):
        opt.zero_grad()
        loss_of(model, BATCHES[s % len(BATCHES)]).backward()
        pre.append(torch.nn.utils.clip_grad_norm_(ps.values(), ADAMW["max_grad_norm"]).item())
        opt.step()
    meta["adamw_grad_norms"] = pre
    for n, p in ps.items():
        tensors[f"adamw.{n}"] = p.detach().clone().contiguous()

    # SGD with momentum and clipping by value
    model = load()
    ps = {n: p for n, p in named(model).items() if trainable(n)}
    for n, p in named(model).items():
        p.requires_grad_(trainable(n))
    opt = torch.optim.SGD(ps.values(), lr=SGD["lr"], momentum=SGD["momentum"])
    for s in range(SGD["steps"]):
        opt.zero_grad()
        loss_of(model, BATCHES[s % len(BATCHES)]).backward()
        torch.nn.utils.clip_grad_value_(ps.values(), SGD["clip_value"])
        opt.step()
    for n, p in ps.items():
        tensors[f"sgd.{n}"] = p.detach().clone().contiguous()
    meta["trainable"] = sorted(ps)

    # The optimizers alone on fixed gradients (no model): 3 steps on a vector
    meta["unit"] = unit_optimizers()

    os.makedirs(OUT, exist_ok=True)
    save_file(tensors, os.path.join(OUT, "reference.safetensors"))
    with open(os.path.join(OUT, "reference.json"), "w") as f:
        json.dump(meta, f, indent=1, sort_keys=True)
        f.write("\n")
    lora_reference()


class LoRALinear(torch.nn.Module):
    """mlx-lm's LoRALinear (no dropout): base(x) + scale * (x @ lora_a) @ lora_b."""

    def __init__(self, base, a, b, scale):
        super().__init__()
        self.base, self.scale = base, scale
        self.lora_a = torch.nn.Parameter(a.clone())
        self.lora_b = torch.nn.Parameter(b.clone())

    def forward(self, x):
        return self.base(x) + self.scale * ((x @ self.lora_a) @ self.lora_b)


def lora_model(init):
    model = load()
    for p in model.parameters():
        p.requires_grad_(False)
    layers = model.model.layers
    for i in range(len(layers) - LORA["num_layers"], len(layers)):
        for key in LORA["keys"]:
            parent, leaf = key.split(".")
            prefix = f"model.layers.{i}.{key}"
            holder = getattr(layers[i], parent)
            setattr(holder, leaf, LoRALinear(getattr(holder, leaf), init[f"{prefix}.lora_a"], init[f"{prefix}.lora_b"], LORA["scale"]))
    # checkpoint names: model.layers.i.<key>.lora_a (the LoRALinear's base is "base")
    return model, {n: p for n, p in model.named_parameters() if p.requires_grad}


def lora_reference():
    g = torch.Generator().manual_seed(21)
    model = load()
    init = {}
    layers = model.model.layers
    for i in range(len(layers) - LORA["num_layers"], len(layers)):
        for key in LORA["keys"]:
            lin = layers[i].get_submodule(key)
            out_dim, in_dim = lin.weight.shape
            bound = 1 / in_dim ** 0.5
            init[f"model.layers.{i}.{key}.lora_a"] = (torch.rand(in_dim, LORA["rank"], generator=g) * 2 - 1) * bound
            init[f"model.layers.{i}.{key}.lora_b"] = torch.randn(LORA["rank"], out_dim, generator=g) * 0.05
    tensors = {f"init.{n}": t.contiguous() for n, t in init.items()}
    meta = {"lora": LORA}

    model, ps = lora_model(init)
    assert sorted(ps) == sorted(init), (sorted(ps), sorted(init))
    loss = loss_of(model, BATCHES[0])
    loss.backward()
    meta["loss"] = loss.item()
    meta["grad_global_norm"] = torch.sqrt(sum(p.grad.pow(2).sum() for p in ps.values())).item()
    for n, p in ps.items():
        tensors[f"grad.{n}"] = p.grad.detach().clone().contiguous()

    model, ps = lora_model(init)
    opt = torch.optim.AdamW(ps.values(), lr=LORA["lr"], betas=ADAMW["betas"], eps=ADAMW["eps"], weight_decay=ADAMW["weight_decay"])
    norms = []
    for s in range(LORA["steps"]):
        opt.zero_grad()
        loss_of(model, BATCHES[s % len(BATCHES)]).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(ps.values(), LORA["max_grad_norm"]).item())
        opt.step()
    meta["adamw_grad_norms"] = norms
    for n, p in ps.items():
        tensors[f"adamw.{n}"] = p.detach().clone().contiguous()
    save_file(tensors, os.path.join(OUT, "lora_reference.safetensors"))
    with open(os.path.join(OUT, "lora_reference.json"), "w") as f:
        json.dump(meta, f, indent=1, sort_keys=True)
        f.write("\n")


def check_state(out_dir):
    from safetensors import safe_open

    with open(os.path.join(out_dir, "trainer_state.json")) as f:
        trainer = json.load(f)
    with safe_open(os.path.join(out_dir, "optimizer.safetensors"), "pt") as opt:
        meta = opt.metadata()
        names = set(opt.keys())
        fmt = {"adamw": "adamw_optimizer_state", "sgd": "sgd_momentum_optimizer_state"}[trainer["optimizer"]]
        assert meta["format"] == fmt, meta
        assert int(meta["step"]) == trainer["step"], (meta, trainer["step"])
        suffixes = ["m", "v"] if trainer["optimizer"] == "adamw" else ["momentum"]
        want = {f"{p}.{s}" for p in trainer["trainable"] for s in suffixes}
        assert names == want, sorted(names ^ want)[:5]
        with safe_open(os.path.join(out_dir, "model.safetensors"), "pt") as model:
            for p in trainer["trainable"]:
                for s in suffixes:
                    t = opt.get_tensor(f"{p}.{s}")
                    assert t.dtype == torch.float32 and list(t.shape) == list(model.get_slice(p).get_shape()), p
    print(f"{out_dir}: {len(names)} tensors, format {meta['format']}, step {meta['step']}: layout ok")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--check-state":
        check_state(sys.argv[2])
    else:
        main()
