#!/usr/bin/env python3
"""Tiny Parquet datasets for crates/training/tests/parquet.rs, written with pyarrow, and the JSON
lines pyarrow reads from them (`Table.to_pylist()`, NaN as null) as the expected conversion.

  prompt_completion.parquet  snappy; prompt/completion strings, a struct column with a NaN and
                             a null, a list of floats, a map with string keys, a binary column
  ids.parquet                uncompressed; prompt_ids/completion_ids lists of int32 (pre-tokenised)
  messages.parquet           snappy; messages: list<struct<role, content>>
  gzip.parquet               gzip pages (a codec the reader does not include)

Run: python3 scripts/make_parquet_fixtures.py   (pyarrow installed)
"""
import json
import math
import os

import pyarrow as pa
import pyarrow.parquet as pq

OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "crates/training/tests/fixtures/parquet")


def clean(v, t):
    """A pyarrow value of type t as JSON: NaN as null, UTF-8 bytes as text, maps with string keys
    (pyarrow gives lists of (key, value) tuples) as objects."""
    if v is None:
        return None
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, bytes):
        return v.decode("utf-8")
    if pa.types.is_map(t):
        return {k: clean(x, t.item_type) for k, x in v}
    if pa.types.is_struct(t):
        return {t.field(i).name: clean(v[t.field(i).name], t.field(i).type) for i in range(t.num_fields)}
    if pa.types.is_list(t):
        return [clean(x, t.value_type) for x in v]
    return v


def write(name, table, compression):
    path = os.path.join(OUT, name + ".parquet")
    pq.write_table(table, path, compression=compression)
    back = pq.read_table(path)
    rows = [{f.name: clean(r[f.name], f.type) for f in back.schema} for r in back.to_pylist()]
    with open(os.path.join(OUT, name + ".jsonl"), "w") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def main():
    os.makedirs(OUT, exist_ok=True)
    write("prompt_completion", pa.table({
        "prompt": ["What is 2+2?", "Say hi", "Übersetze: cat"],
        "completion": [" 4", " hi!", " Katze"],
        "meta": pa.array([{"source": "math", "score": 0.5}, {"source": None, "score": float("nan")}, {"source": "de", "score": -1.25}],
                         pa.struct([("source", pa.string()), ("score", pa.float64())])),
        "weights": [[1.0, 2.5], [], [3.0]],
        "tags": pa.array([[("a", 1)], [], [("b", 2), ("c", 3)]], pa.map_(pa.string(), pa.int64())),
        "raw": pa.array([b"x", b"y\xc3\xa9", b""], pa.binary()),
    }), "snappy")
    write("ids", pa.table({
        "prompt_ids": pa.array([[3, 17, 99, 4], [40, 41, 42], [5, 6]], pa.list_(pa.int32())),
        "completion_ids": pa.array([[250, 8, 61], [300, 301, 7], [11, 12, 13, 14]], pa.list_(pa.int32())),
    }), "none")
    write("messages", pa.table({
        "messages": [
            [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi there"}],
            [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
        ],
    }), "snappy")
    write("gzip", pa.table({"prompt": ["a"], "completion": ["b"]}), "gzip")


if __name__ == "__main__":
    main()
