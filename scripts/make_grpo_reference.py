#!/usr/bin/env python3
"""Reference values for crates/training's GRPO tests, computed with torch, transformers and TRL.

One GRPO step on the tiny Qwen3 fixture (crates/models/tests/fixtures/tiny/qwen3, float32) for
every loss type (grpo, dapo, dr_grpo, bnpo) at both importance-sampling levels (token, sequence):

* advantages from fixed rewards as TRL's GRPOTrainer._generate_and_score_completions computes them
  (group mean; std per group, of the batch, or none; `(r - mean) / (std + 1e-4)`), with TRL's
  `nanstd`;
* the loss by TRL's own `GRPOTrainer._compute_loss`, called on fixed inputs through an instance
  made without `__init__` (the attributes `_compute_loss` reads are set by hand; its per-token
  log-prob helper is replaced by a plain `log_softmax` of the model's logits, since TRL's helper
  needs its fused-head model patch; temperature 1);
* gradient accumulation over two micro-batches where a case says so (TRL's
  `current_gradient_accumulation_steps` = 2; dapo's `num_items_in_batch` = completion tokens of
  both micro-batches);
* the gradients of the trained subset (all norms and the attention value/output projections;
  embeddings, query/key projections and MLPs frozen), their global norm, and the parameters after
  clipping the global norm to 1.0 and one torch.optim.AdamW step (lr 1e-4, betas 0.9/0.999,
  eps 1e-8, weight decay 0.01).

Cases with `beta > 0` use a frozen reference model: the fixture with every `*norm.weight`
multiplied by 1.1 (the k3 estimator then has a non-zero gradient). Cases with `old` perturbed give
`_compute_loss` old log-probs = current - delta (fixed, away from the clipping boundaries), so
clipping is active; the others use TRL's default (the current log-probs, detached).

Writes crates/training/tests/fixtures/grpo_reference.json and grpo_<case>.safetensors.
Run: python3 scripts/make_grpo_reference.py   (torch, transformers, trl and safetensors installed;
the reference was made with torch 2.11, transformers 5.17 and trl 1.16)
"""
import json
import os
import types
from collections import defaultdict

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM
from trl.trainer.grpo_trainer import GRPOTrainer
from trl.trainer.utils import nanstd

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.path.join(ROOT, "crates/models/tests/fixtures/tiny/qwen3")
OUT = os.path.join(ROOT, "crates/training/tests/fixtures")
PAD = 486
GROUP = 4
# Two groups of four completions; every prompt has four tokens (TRL left-pads prompts and the
# fixture's positions would then shift: equal lengths keep both sides' layouts identical).
PROMPTS = [[3, 17, 99, 4], [40, 41, 42, 43]]
COMPLETIONS = [
    [250, 8, 61, 7, 12], [300, 301], [5, 6, 7, 8, 9, 10], [11, 12, 13],
    [100, 200, 300], [400, 500, 20, 21, 22], [23], [24, 25, 26, 27],
]
REWARDS = [0.5, 1.0, 0.25, 0.75, 2.0, -1.0, 0.0, 0.5]
# Per-token perturbation of the old log-probs (cycled over each completion's tokens).
DELTAS = [-0.3, 0.25, 0.05, -0.1, 0.35, 0.0, -0.4]
ADAMW = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, max_grad_norm=1.0)

CASES = [
    dict(name="grpo_token", loss_type="grpo", level="token", beta=0.0, old=True, scale="group", ga=1),
    dict(name="grpo_sequence", loss_type="grpo", level="sequence", beta=0.05, old=False, scale="batch", ga=1),
    dict(name="dapo_token", loss_type="dapo", level="token", beta=0.04, old=True, scale="group", ga=2),
    dict(name="dapo_sequence", loss_type="dapo", level="sequence", beta=0.0, old=True, scale="none", ga=1, epsilon_high=0.28),
    dict(name="dr_grpo_token", loss_type="dr_grpo", level="token", beta=0.0, old=False, scale="group", ga=1, max_completion_length=8),
    dict(name="dr_grpo_sequence", loss_type="dr_grpo", level="sequence", beta=0.1, old=True, scale="group", ga=2, max_completion_length=7),
    dict(name="bnpo_token", loss_type="bnpo", level="token", beta=0.0, old=True, scale="batch", ga=2),
    dict(name="bnpo_sequence", loss_type="bnpo", level="sequence", beta=0.0, old=False, scale="group", ga=1),
]
EPSILON = 0.2


def trainable(name):
    return "norm" in name or "v_proj" in name or "o_proj" in name


def load(reference=False):
    model = AutoModelForCausalLM.from_pretrained(FIXTURE, dtype=torch.float32)
    if reference:
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n.endswith("norm.weight"):
                    p.mul_(1.1)
    return model


def advantages(rewards, scale):
    r = torch.tensor(rewards, dtype=torch.float32)
    mean = torch.nanmean(r.view(-1, GROUP), dim=1).repeat_interleave(GROUP)
    if scale in ("group", "none"):
        std = nanstd(r.view(-1, GROUP), dim=1).repeat_interleave(GROUP)
    else:
        std = nanstd(r).expand_as(r)
    adv = r - mean
    if scale != "none":
        adv = adv / (std + 1e-4)
    return adv


def per_token_logps(self, model, input_ids, attention_mask, logits_to_keep, compute_entropy=False, compute_aux_loss=False, **_):
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, -logits_to_keep - 1 : -1].float()
    logp = torch.log_softmax(logits, dim=-1)
    ids = input_ids[:, -logits_to_keep:]
    token = logp.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1) if compute_entropy else None
    return token, entropy, None


class Accel:
    num_processes = 1
    sync_gradients = True

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x


def trl_trainer(case, model, ga):
    t = GRPOTrainer.__new__(GRPOTrainer)
    t.model = model
    t.args = types.SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=ga)
    t.accelerator = Accel()
    t.loss_type = case["loss_type"]
    t.importance_sampling_level = case["level"]
    t.beta = case["beta"]
    t.epsilon_low = EPSILON
    t.epsilon_high = case.get("epsilon_high", EPSILON)
    t.max_completion_length = case.get("max_completion_length", 512)
    t.current_gradient_accumulation_steps = ga
    t.top_entropy_quantile = 1.0
    t.aux_loss_enabled = False
    t.off_policy_mask_threshold = None
    t.use_vllm = False
    t._entropy_bonus_enabled = False
    t._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    t._get_per_token_logps_and_entropies = types.MethodType(per_token_logps, t)
    return t


def tensors_of(rows):
    width = max(len(COMPLETIONS[i]) for i in rows)
    comp = torch.tensor([COMPLETIONS[i] + [PAD] * (width - len(COMPLETIONS[i])) for i in rows])
    mask = torch.tensor([[1] * len(COMPLETIONS[i]) + [0] * (width - len(COMPLETIONS[i])) for i in rows])
    prompts = torch.tensor([PROMPTS[i // GROUP] for i in rows])
    return prompts, torch.ones_like(prompts), comp, mask


def run_case(case):
    model = load()
    model.train()
    for n, p in model.named_parameters():
        p.requires_grad_(trainable(n))
    ref = load(reference=True) if case["beta"] > 0 else None
    adv = advantages(REWARDS, case["scale"])
    ga = case["ga"]
    micro = [list(range(k * len(COMPLETIONS) // ga, (k + 1) * len(COMPLETIONS) // ga)) for k in range(ga)]
    total_tokens = sum(len(c) for c in COMPLETIONS)
    t = trl_trainer(case, model, ga)
    old_all = [None] * len(COMPLETIONS)
    loss_total = 0.0
    for rows in micro:
        prompts, pmask, comp, cmask = tensors_of(rows)
        inputs = dict(prompt_ids=prompts, prompt_mask=pmask, completion_ids=comp, completion_mask=cmask, advantages=adv[rows],
                      num_items_in_batch=torch.tensor(float(total_tokens)))
        ids = torch.cat([prompts, comp], 1)
        am = torch.cat([pmask, cmask], 1)
        if case["old"]:
            with torch.no_grad():
                cur, _, _ = per_token_logps(t, model, ids, am, comp.size(1))
            delta = torch.tensor([[DELTAS[(i + j) % len(DELTAS)] for j in range(comp.size(1))] for i in rows])
            old = (cur - delta) * cmask
            inputs["old_per_token_logps"] = old
            for k, i in enumerate(rows):
                old_all[i] = old[k, : len(COMPLETIONS[i])].tolist()
            if case["level"] == "sequence":
                lw = (delta * cmask).sum(-1) / cmask.sum(-1)
                for v in lw.tolist():
                    for b in (torch.log(torch.tensor(1 - EPSILON)).item(), torch.log(torch.tensor(1 + t.epsilon_high)).item()):
                        assert abs(v - b) > 1e-3, "a sequence weight sits on a clipping boundary"
        if ref is not None:
            with torch.no_grad():
                inputs["ref_per_token_logps"], _, _ = per_token_logps(t, ref, ids, am, comp.size(1))
        loss = t._compute_loss(model, inputs)
        loss.backward()
        loss_total += loss.item()
    params = {n: p for n, p in model.named_parameters() if trainable(n)}
    grads = {n: p.grad.detach().clone() for n, p in params.items()}
    global_norm = torch.sqrt(sum(g.pow(2).sum() for g in grads.values())).item()
    opt = torch.optim.AdamW(params.values(), lr=ADAMW["lr"], betas=ADAMW["betas"], eps=ADAMW["eps"], weight_decay=ADAMW["weight_decay"])
    pre = torch.nn.utils.clip_grad_norm_(params.values(), ADAMW["max_grad_norm"]).item()
    opt.step()
    m = t._metrics["train"]
    meta = dict(case)
    meta.update(
        advantages=adv.tolist(),
        loss=loss_total,
        grad_global_norm=global_norm,
        pre_clip_norm=pre,
        grad_norms={n: g.norm().item() for n, g in grads.items()},
        old_logprobs=old_all if case["old"] else None,
        clip_ratio_region=m["clip_ratio/region_mean"],
        kl=m.get("kl"),
        epsilon=EPSILON,
    )
    tensors = {f"grad.{n}": g.contiguous() for n, g in grads.items()}
    tensors.update({f"param.{n}": p.detach().clone().contiguous() for n, p in params.items()})
    save_file(tensors, os.path.join(OUT, f"grpo_{case['name']}.safetensors"))
    return meta


def main():
    torch.manual_seed(0)
    meta = {"group_size": GROUP, "pad": PAD, "prompts": PROMPTS, "completions": COMPLETIONS, "rewards": REWARDS,
            "adamw": ADAMW, "trainable": sorted(n for n, _ in load().named_parameters() if trainable(n)), "cases": []}
    for case in CASES:
        meta["cases"].append(run_case(case))
    with open(os.path.join(OUT, "grpo_reference.json"), "w") as f:
        json.dump(meta, f, indent=1, sort_keys=True)
        f.write("\n")
    for c in meta["cases"]:
        print(f"{c['name']}: loss {c['loss']:.6g}, grad norm {c['grad_global_norm']:.4g}, clip ratio {c['clip_ratio_region']}, kl {c['kl']}")


if __name__ == "__main__":
    main()
