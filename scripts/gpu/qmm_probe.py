"""Quantized products of few rows on the GPU against the CPU (MLX's own kernels on both).

    PYTHONPATH=RT python3 scripts/gpu/qmm_probe.py [--repeats N] [--only gather|dense|narrow]
    PYTHONPATH=RT python3 scripts/gpu/qmm_probe.py --race N
    PYTHONPATH=RT python3 scripts/gpu/qmm_probe.py --checkpoint DIR [--rows 1,2,8,33] [--repeats N]

RT holds the mlx wheel's python package with the CUDA libmlx swapped in (as gpu_spec_bench.sh
unpacks it). For each shape, `mx.quantized_matmul` and `mx.gather_qmm` (unsorted and sorted
rows, as the MoE layers call them) run on the default device `--repeats` times and once on the
CPU; a line per case gives the largest |gpu - cpu|, whether the GPU gave non-finite values, and
whether its repeats differ from each other. Shapes cover the tiny test checkpoints (64-wide
hidden, 32-wide expert MLPs, 4 experts, groups of 32 and 64) and wider ones. `--checkpoint`
instead takes the quantized layers of an MLX checkpoint (each distinct shape and mode once, scales
and biases in bf16 as the loader keeps them on a GPU) with bf16 inputs of `--rows` rows (tokens,
for expert layers: top-2 of their experts, sorted and unsorted).
"""

import argparse
import itertools

import mlx.core as mx


def quantize(w, gs, bits):
    return mx.quantize(w, group_size=gs, bits=bits)


def check(label, fn, repeats, dt):
    """Run `fn` on the default device `repeats` times and once on the CPU, print `label` with the
    largest |gpu - cpu|, finiteness and the spread between repeats; True when the case is bad."""
    outs = []
    for _ in range(repeats):
        y = fn(mx.default_stream(mx.default_device()))
        mx.eval(y)
        outs.append(y)
    ref = fn(mx.cpu)
    mx.eval(ref)
    finite = all(bool(mx.all(mx.isfinite(o)).item()) for o in outs)
    inf = float("inf")
    err = max(float(mx.max(mx.abs(o - ref)).item()) for o in outs) if finite else inf
    spread = max(float(mx.max(mx.abs(o - outs[0])).item()) for o in outs) if finite else inf
    scale = float(mx.max(mx.abs(ref)).item())
    tol = 1e-2 if dt == mx.float32 else 5e-2
    bad = not (finite and err <= tol * max(scale, 1.0) and spread == 0)
    flag = "  <-- BAD" if bad else ""
    print(f"{label}: max|gpu-cpu| {err:.3e} (|y| {scale:.2e}) finite {finite} repeat spread {spread:.1e}{flag}", flush=True)
    return bad


def race(rounds):
    """Bitwise repeatability of one product run many times with launches queued back to back:
    a race inside the kernel shows as results that differ from the first."""
    x = mx.random.normal((16, 2048)).astype(mx.bfloat16)
    for gs in (64, 32):
        w, s, b = quantize(mx.random.normal((2048, 2048)).astype(mx.bfloat16), gs, 4)
        ref = mx.quantized_matmul(x, w, s, b, transpose=True, group_size=gs, bits=4)
        mx.eval(ref)
        bad = 0
        for _ in range(rounds):
            ys = [mx.quantized_matmul(x, w, s, b, transpose=True, group_size=gs, bits=4) for _ in range(8)]
            mx.eval(ys)
            bad += sum(not bool(mx.array_equal(y, ref).item()) for y in ys)
        cpu = mx.quantized_matmul(x, w, s, b, transpose=True, group_size=gs, bits=4, stream=mx.cpu)
        err = float(mx.max(mx.abs(ref.astype(mx.float32) - cpu.astype(mx.float32))).item())
        print(f"race gs={gs}: {bad} of {8 * rounds} products differ from the first; first vs cpu {err:.3e}", flush=True)


def checkpoint(path, rows, repeats):
    """The quantized layers of the MLX checkpoint at `path` with inputs of each row count."""
    import json
    import pathlib
    path = pathlib.Path(path)
    q = json.loads((path / "config.json").read_text())["quantization"]
    ws = {}
    for f in sorted(path.glob("model*.safetensors")):
        ws.update(mx.load(str(f)))
    seen, bad = set(), 0
    for name in sorted(k[: -len(".scales")] for k in ws if k.endswith(".scales")):
        mode = q.get(name, q)
        gs, bits = mode["group_size"], mode["bits"]
        w = ws[name + ".weight"]
        s, b = (ws[name + x].astype(mx.bfloat16) for x in (".scales", ".biases"))
        k = w.shape[-1] * 32 // bits
        key = (w.shape, gs, bits)
        if key in seen:
            continue
        seen.add(key)
        for m in rows:
            x = mx.random.normal((m, k)).astype(mx.bfloat16)
            if w.ndim == 2:
                fn = lambda st, x=x: mx.quantized_matmul(x, w, s, b, transpose=True, group_size=gs, bits=bits, stream=st)
                bad += check(f"{name} {tuple(w.shape)} gs={gs} bits={bits} rows={m}", fn, repeats, mx.bfloat16)
                continue
            ids = mx.random.randint(0, w.shape[0], (m, 2)).astype(mx.uint32)
            flat = ids.reshape(-1)
            order = mx.argsort(flat)
            for sort, xs, idx in ((False, x.reshape(m, 1, 1, k), ids), (True, mx.take(x, order // 2, axis=0).reshape(2 * m, 1, k), mx.take(flat, order))):
                fn = lambda st, xs=xs, idx=idx, sort=sort: mx.gather_qmm(xs, w, s, b, rhs_indices=idx, transpose=True, group_size=gs, bits=bits, sorted_indices=sort, stream=st)
                bad += check(f"{name} {tuple(w.shape)} gs={gs} bits={bits} tokens={m} sorted={sort}", fn, repeats, mx.bfloat16)
    print(f"{bad} bad case(s)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, help="GPU runs of each product (default 4; not with --race)")
    what = ap.add_mutually_exclusive_group()
    what.add_argument("--only", choices=["gather", "dense", "narrow"],
                      help="one kind of product only (narrow: dense products whose output rows are a few elements wide, as MoE routers of few experts)")
    what.add_argument("--race", type=int, default=0, metavar="N",
                      help="instead: N rounds of 8 queued bf16 4-bit products of 16 rows (the qmm_sm80 kernel on sm_90), each checked bit for bit against the first")
    what.add_argument("--checkpoint", metavar="DIR", help="instead: the quantized layers of this MLX checkpoint")
    ap.add_argument("--rows", help="with --checkpoint: the row (token) counts (default 1,2,3,8,9,16,17,24,33,40,64)")
    args = ap.parse_args()
    if args.rows is not None and not args.checkpoint:
        ap.error("--rows needs --checkpoint")
    if args.race and args.repeats is not None:
        ap.error("--race runs its own rounds: no --repeats")
    repeats = 4 if args.repeats is None else args.repeats
    print("device", mx.default_device(), flush=True)
    mx.random.seed(0)
    if args.checkpoint:
        checkpoint(args.checkpoint, [int(r) for r in (args.rows or "1,2,3,8,9,16,17,24,33,40,64").split(",")], repeats)
        return
    if args.race:
        race(args.race)
        return
    bad = 0
    if args.only == "narrow":
        # out * itemsize not a multiple of 16 bytes for some dtypes (the sm90 kernel stores its
        # output rows by TMA); in = group = 64 as the fixtures' routers
        for dt, m, n, bits in itertools.product([mx.bfloat16, mx.float16, mx.float32], [1, 2, 3, 8, 17, 40], [4, 8, 12, 16, 128], [8, 4]):
            x = mx.random.normal((m, 64)).astype(dt)
            w, s, b = quantize((mx.random.normal((n, 64)) * 0.1).astype(dt), 64, bits)
            fn = lambda st: mx.quantized_matmul(x, w, s, b, transpose=True, group_size=64, bits=bits, stream=st)
            bad += check(f"qmm {dt} rows={m} out={n} in=64 gs=64 bits={bits}", fn, repeats, dt)
        print(f"{bad} bad case(s)")
        return
    # gathered: x [T, 1, 1, in] with ids [T, k] (unsorted), or [T*k, 1, in] with sorted ids
    # the tiny fixtures' shapes first (f32), then bf16 and wider ones
    experts = sorted(itertools.product([1, 2, 3, 4, 6, 8, 16, 32], [(32, 64), (64, 32), (128, 256)], [32, 64], [4, 8], [mx.float32, mx.bfloat16]), key=lambda c: (c[4] != mx.float32, c[1][1] > 64))
    for t, (n, k), gs, bits, dt in experts:
        if k % gs or args.only == "dense":
            continue
        e, topk = 4, 2
        w, s, b = quantize((mx.random.normal((e, n, k)) * 0.1).astype(dt), gs, bits)
        ids = mx.random.randint(0, e, (t, topk)).astype(mx.uint32)
        x = mx.random.normal((t, k)).astype(dt)
        for sort in (False, True):
            if sort:
                flat = ids.reshape(-1)
                order = mx.argsort(flat)
                xs = mx.take(x, order // topk, axis=0).reshape(t * topk, 1, k)
                idx = mx.take(flat, order)
            else:
                xs, idx = x.reshape(t, 1, 1, k), ids
            fn = lambda st, xs=xs, idx=idx, sort=sort: mx.gather_qmm(xs, w, s, b, rhs_indices=idx, transpose=True, group_size=gs, bits=bits, sorted_indices=sort, stream=st)
            bad += check(f"gather_qmm {dt} tokens={t} top2 of 4 out={n} in={k} gs={gs} bits={bits} sorted={sort}", fn, repeats, dt)
    # (rows, out, in, group, bits)
    dense = sorted(itertools.product([1, 2, 3, 4, 5, 8, 16], [4, 32, 64, 192, 512], [32, 64, 128], [32, 64], [4, 8], [mx.float32, mx.bfloat16]), key=lambda c: (c[5] != mx.float32, c[2] > 64))
    for m, n, k, gs, bits, dt in dense:
        if k % gs or args.only == "gather":
            continue
        x = mx.random.normal((m, k)).astype(dt)
        w, s, b = quantize((mx.random.normal((n, k)) * 0.1).astype(dt), gs, bits)
        fn = lambda st: mx.quantized_matmul(x, w, s, b, transpose=True, group_size=gs, bits=bits, stream=st)
        bad += check(f"qmm {dt} rows={m} out={n} in={k} gs={gs} bits={bits}", fn, repeats, dt)
    print(f"{bad} bad case(s)")


if __name__ == "__main__":
    main()
