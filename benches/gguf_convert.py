#!/usr/bin/env python3
"""GGUF -> f32 safetensors: mlx-convert's `convert gguf` against the gguf-py + numpy path
(GGUFReader, gguf.quants.dequantize, the Q/K un-permutation, safetensors.numpy.save_file), same
input, alternating runs, medians. Prints one row per file with the ratio (> 1: ours is faster).

    pip install gguf numpy safetensors
    cargo build --release -p mlx-convert --example convert
    python3 benches/gguf_convert.py GGUF [GGUF ...] [--runs 3]
"""
import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import time

import numpy as np
import gguf
from safetensors.numpy import save_file

BIN = os.path.join(os.path.dirname(__file__), "..", "target", "release", "examples", "convert")


def reverse_permute(w, n_head):
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def python_path(path, out):
    r = gguf.GGUFReader(path)
    arch = r.fields["general.architecture"].contents()
    n_head = r.fields[f"{arch}.attention.head_count"].contents()
    n_kv = r.fields[f"{arch}.attention.head_count_kv"].contents()
    tensors = {}
    for t in r.tensors:
        shape = tuple(int(d) for d in reversed(t.shape))
        w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        if arch == "llama" and t.name.endswith("attn_q.weight"):
            w = reverse_permute(w, n_head)
        elif arch == "llama" and t.name.endswith("attn_k.weight"):
            w = reverse_permute(w, n_kv)
        tensors[t.name] = w
    save_file(tensors, os.path.join(out, "model.safetensors"))


def timed(f):
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("gguf", nargs="+")
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    print(f"{'file':40} {'ours s':>8} {'gguf-py s':>10} {'ratio':>6}")
    for path in a.gguf:
        ours, theirs = [], []
        for _ in range(a.runs):
            with tempfile.TemporaryDirectory() as d:
                ours.append(timed(lambda: subprocess.run([BIN, "gguf", path, os.path.join(d, "o"), "--dtype", "f32"],
                                                         check=True, stdout=subprocess.DEVNULL)))
            with tempfile.TemporaryDirectory() as d:
                theirs.append(timed(lambda: python_path(path, d)))
        o, t = statistics.median(ours), statistics.median(theirs)
        print(f"{os.path.basename(path):40} {o:8.2f} {t:10.2f} {t / o:6.2f}")


if __name__ == "__main__":
    main()
