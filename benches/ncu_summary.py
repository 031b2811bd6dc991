#!/usr/bin/env python3
"""Summarise `ncu --metrics gpu__time_duration.sum --csv` logs of llm_bench decode steps.

    ncu_summary.py FULL_LAYERS LOG:LAYERS [LOG:LAYERS ...]

Each log is one llm_bench run on a checkpoint cut to LAYERS layers (benches/gpu_profile.sh).
Forward steps are split at the output-head matmul (the one kernel per step over 0.2 ms: it
reads the 1.2 GB lm_head); the last 3 steps are decode steps. Per log it prints the kernels of
one decode step (mean over those steps) by name, and with two logs at different layer counts
it extrapolates the device time of one decode step of the FULL_LAYERS model:
head_part + FULL_LAYERS * per_layer, per_layer = (t(L2) - t(L1)) / (L2 - L1).
"""
import csv, sys, collections, statistics


def load(path):
    rows = []
    with open(path, newline="") as f:
        lines = [l for l in f if l.startswith('"')]
    for r in csv.DictReader(lines):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        v = float(r["Metric Value"].replace(",", ""))
        unit = r.get("Metric Unit", "ns")
        us = v / 1000 if unit == "nsecond" or unit == "ns" else v if unit in ("usecond", "us") else v * 1000
        rows.append((r["Kernel Name"], us))
    return rows


def steps(rows):
    bounds = [i for i, (_, us) in enumerate(rows) if us > 200]
    return [rows[a + 1 : b + 1] for a, b in zip(bounds, bounds[1:])]


def short(name):
    n = name.split("(")[0]
    for p in ("void ", "mlx::core::", "cu::", "(anonymous namespace)::"):
        n = n.replace(p, "")
    return n[:70]


full = int(sys.argv[1])
per = []
for arg in sys.argv[2:]:
    path, layers = arg.rsplit(":", 1)
    rows = load(path)
    st = steps(rows)
    dec = st[-3:]
    tot = [sum(us for _, us in s) for s in dec]
    print(f"== {path}: {len(rows)} kernels, {len(st)} steps; decode step: {len(dec[-1])} kernels, "
          f"{statistics.mean(tot):.1f} us (steps {', '.join(f'{t:.1f}' for t in tot)})")
    agg = collections.OrderedDict()
    for s in dec:
        for name, us in s:
            k = short(name)
            c, t = agg.get(k, (0, 0.0))
            agg[k] = (c + 1, t + us)
    n = len(dec)
    print(f"{'kernel':70s} {'per step':>8s} {'us/step':>9s} {'us each':>8s}")
    for k, (c, t) in sorted(agg.items(), key=lambda kv: -kv[1][1]):
        print(f"{k:70s} {c / n:8.1f} {t / n:9.1f} {t / c:8.2f}")
    per.append((int(layers), statistics.mean(tot), len(dec[-1])))
if len(per) >= 2:
    (l1, t1, k1), (l2, t2, k2) = per[0], per[-1]
    pl, kl = (t2 - t1) / (l2 - l1), (k2 - k1) / (l2 - l1)
    head = t1 - l1 * pl
    est = head + full * pl
    print(f"per layer: {pl:.1f} us in {kl:.1f} kernels; outside the layers: {head:.1f} us in {k1 - l1 * kl:.0f} kernels")
    print(f"estimated device time of one {full}-layer decode step: {est / 1000:.3f} ms "
          f"({(k1 - l1 * kl) + full * kl:.0f} kernels)")
