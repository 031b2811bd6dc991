#!/usr/bin/env python3
"""Pillow `Image.resize` references for `media::resize` (crates/models/tests/media_resize.rs).

    python3 scripts/make_pillow_resize_fixture.py [OUT_DIR]
        (default crates/models/tests/fixtures/pillow_resize; needs numpy, pillow, safetensors)

Six random-noise RGB images (including 7x30 and its transpose, and a 1-pixel-wide one) are each
resized to a fixed list of sizes and to sizes drawn from a seeded generator: shrinking and
growing each side, one side kept, one side up and the other down, alternating BICUBIC and
BILINEAR. The pass order matters in many of them: Pillow 13 (`ImagingResampleInner`) runs the
vertical pass first when the height shrinks by more than twice as many pixels as the width,
the horizontal one first otherwise (Pillow 12 always ran the horizontal one first).
`reference.safetensors` holds `in{i}` (`[h, w, 3]` u8) and `out{j}` (`[H, W, 3]` u8);
`cases.json` lists each case's input, target width and height and filter, with the Pillow
version that made them.
"""
import json
import os
import sys

import numpy as np
import PIL
from PIL import Image
from safetensors.numpy import save_file

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

INPUTS = [(7, 30), (30, 7), (13, 13), (40, 25), (1, 9), (23, 11)]  # (width, height)
FIXED = {0: [(32, 136), (3, 50), (14, 12)], 1: [(136, 32)], 2: [(13, 40), (40, 13), (5, 5)], 4: [(6, 2)]}
RANDOM_PER_INPUT = 3
FILTERS = {"bicubic": Image.Resampling.BICUBIC, "bilinear": Image.Resampling.BILINEAR}


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(REPO, "crates/models/tests/fixtures/pillow_resize")
    os.makedirs(out, exist_ok=True)
    rs = np.random.RandomState(2024)
    tensors, cases = {}, []
    for i, (w, h) in enumerate(INPUTS):
        px = rs.randint(0, 256, size=(h, w, 3), dtype=np.uint8)
        tensors[f"in{i}"] = px
        sizes = list(FIXED.get(i, []))
        for _ in range(RANDOM_PER_INPUT):
            sizes.append((int(rs.randint(1, 3 * w + 2)), int(rs.randint(1, 3 * h + 2))))
        for (tw, th) in sizes:
            name = ["bicubic", "bilinear"][len(cases) % 2]
            res = np.asarray(Image.fromarray(px).resize((tw, th), FILTERS[name]))
            tensors[f"out{len(cases)}"] = res
            cases.append(dict(input=i, width=tw, height=th, filter=name))
    tmp = os.path.join(out, "reference.safetensors.tmp")
    save_file(tensors, tmp)
    os.replace(tmp, os.path.join(out, "reference.safetensors"))
    meta = dict(pillow=PIL.__version__, cases=cases)
    tmp = os.path.join(out, "cases.json.tmp")
    json.dump(meta, open(tmp, "w"), indent=1)
    os.replace(tmp, os.path.join(out, "cases.json"))
    print(f"{len(cases)} cases, {os.path.getsize(os.path.join(out, 'reference.safetensors'))} bytes")


if __name__ == "__main__":
    main()
