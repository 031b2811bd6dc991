#!/usr/bin/env python3
"""Learning rates of transformers' warm-up schedules, for crates/training's schedule test.

For each case, the rate each optimizer update uses, update 0 first, as transformers' Trainer
applies them (the optimizer steps with the scheduler's current rate, then the scheduler steps):
`get_constant_schedule_with_warmup`, `get_cosine_schedule_with_warmup` and
`get_cosine_with_min_lr_schedule_with_warmup` (min_lr), each a LambdaLR over one parameter.
Their warm-up is `lr * step / warmup`, so update 0 runs at rate 0 (torch's LinearLR cannot start
at 0: its start_factor must be positive).

Writes crates/training/tests/fixtures/schedule_reference.json.
Run: python3 scripts/make_schedule_reference.py   (torch and transformers installed)
"""
import json
import os

import torch
import transformers
from transformers import (get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup,
                          get_cosine_with_min_lr_schedule_with_warmup)

CASES = [
    # name, lr, warmup, total, min_lr (None: constant after warm-up)
    ("constant_warmup4", 1e-3, 4, 10, None),
    ("constant_warmup1", 2e-5, 1, 5, None),
    ("cosine_warmup3", 1e-3, 3, 12, 0.0),
    ("cosine_nowarmup", 5e-4, 0, 7, 0.0),
    ("cosine_min_lr", 1e-2, 2, 9, 1e-3),
]


def rates(lr, warmup, total, min_lr):
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=lr)
    if min_lr is None:
        sched = get_constant_schedule_with_warmup(opt, warmup)
    elif min_lr == 0.0:
        sched = get_cosine_schedule_with_warmup(opt, warmup, total)
    else:
        sched = get_cosine_with_min_lr_schedule_with_warmup(opt, warmup, total, min_lr=min_lr)
    out = []
    for _ in range(total):  # updates 0 .. total - 1
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def main():
    cases = [{"name": n, "lr": lr, "warmup_steps": w, "total_steps": t, "min_lr": m, "rates": rates(lr, w, t, m)} for n, lr, w, t, m in CASES]
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "crates", "training", "tests", "fixtures", "schedule_reference.json")
    doc = {"generator": "scripts/make_schedule_reference.py", "torch": torch.__version__, "transformers": transformers.__version__, "cases": cases}
    tmp = out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
