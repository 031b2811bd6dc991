#!/usr/bin/env python3
"""MLX quantization of a Hugging Face directory: mlx-convert's `convert quantize` against
`mlx_lm.convert(quantize=True)` (the Python API behind `mlx_lm.convert -q`) on the same input and
settings, each as a fresh process, alternating runs, medians. Prints one row per directory and
mode with the ratio (> 1: ours is faster).

    bash benches/setup_mlx_lm.sh        # mlx-lm venv, /tmp/mlxlm
    cargo build --release -p mlx-convert --example convert
    /tmp/mlxlm/bin/python benches/quantize.py DIR [DIR ...] [--runs 3] [--bits 4] [--group-size 64]
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

BIN = os.path.join(os.path.dirname(__file__), "..", "target", "release", "examples", "convert")


def timed(cmd):
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dirs", nargs="+")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=64)
    a = ap.parse_args()
    print(f"{'directory':40} {'mode':>10} {'ours s':>8} {'mlx-lm s':>9} {'ratio':>6}")
    for d in a.dirs:
        ours, theirs = [], []
        for _ in range(a.runs):
            with tempfile.TemporaryDirectory() as t:
                ours.append(timed([BIN, "quantize", d, os.path.join(t, "o"), "--bits", str(a.bits),
                                   "--group-size", str(a.group_size)]))
            with tempfile.TemporaryDirectory() as t:
                code = ("from mlx_lm import convert; import sys; "
                        f"convert({d!r}, {os.path.join(t, 'o')!r}, quantize=True, q_bits={a.bits}, q_group_size={a.group_size})")
                theirs.append(timed([sys.executable, "-c", code]))
        o, m = statistics.median(ours), statistics.median(theirs)
        mode = f"q{a.bits} g{a.group_size}"
        print(f"{os.path.basename(d.rstrip('/')):40} {mode:>10} {o:8.2f} {m:9.2f} {m / o:6.2f}")


if __name__ == "__main__":
    main()
