#!/usr/bin/env python3
"""mlx-lm's index of a sharded quantized checkpoint, for the shard-layout test of `quantize`.

    python3 scripts/make_sharded_index_reference.py    (mlx-lm 0.32.2, mlx[cpu] 0.32.4)

mlx-lm loads the tiny Llama fixture, casts it to f32, quantizes it with `quantize_model`
(affine, 4 bits, groups of 64: the `llama_q4` fixture's settings) and writes it with its own
`save_model`, whose `make_shards` is given a 16 KiB limit instead of its 5 GiB default (its
`max_file_size_gb << 30` is all that changes). Only the index is kept:
crates/convert/tests/fixtures/llama_q4_sharded_16k.index.json.
"""
import shutil
import tempfile
from pathlib import Path

import mlx.core as mx
import mlx_lm.utils as mlx_lm_utils
from mlx.utils import tree_map
from mlx_lm.utils import load_model, quantize_model, save_model

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "crates/models/tests/fixtures/tiny/llama"
OUT = ROOT / "crates/convert/tests/fixtures/llama_q4_sharded_16k.index.json"
LIMIT = 16 * 1024


class Bytes(int):
    """A shard limit in bytes where mlx-lm expects gigabytes (`gb << 30`)."""

    def __lshift__(self, _shift):
        return int(self)


_make_shards = mlx_lm_utils.make_shards
mlx_lm_utils.make_shards = lambda weights, max_file_size_gb=None: _make_shards(weights, Bytes(LIMIT))

mx.set_default_device(mx.cpu)
model, config = load_model(SOURCE)
model.update(tree_map(lambda v: v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v, model.parameters()))
model, config = quantize_model(model, config, 64, 4, mode="affine")
with tempfile.TemporaryDirectory() as d:
    save_model(d, model)
    shutil.copyfile(Path(d) / "model.safetensors.index.json", OUT)
    print(sorted(p.name for p in Path(d).iterdir()))
print(f"wrote {OUT}")
