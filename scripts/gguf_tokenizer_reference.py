#!/usr/bin/env python3
"""Token ids that transformers' own GGUF tokenizer import gives for a fixed set of texts.

    pip install gguf numpy transformers tokenizers
    python3 scripts/gguf_tokenizer_reference.py MODEL.gguf OUT.json [--dump-tokenizer PATH]

Reads the metadata with gguf-py and builds the tokenizer with transformers'
`integrations.gguf.gguf_tokenizer_mapping.convert_gguf_tokenizer` (the part of its GGUF import
that needs no torch), then writes `{"texts": [...], "ids": [[...], ...], "decoded": [...]}`
(ids without special tokens added; `decoded` is the ids decoded back).
"""
import argparse
import json

import gguf

TEXTS = [
    "The capital of France is Paris.",
    "Hello, world!  Two spaces,\ttab, and\nnewlines\n\n.",
    "héllo wörld — naïve café, 日本語のテキスト, emoji 🎉🚀",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<start_of_turn>user\nhi<end_of_turn>\n<bos>",
    "   leading spaces and trailing   ",
    "numbers 1234567 3.14159 -42 0x1F",
    "def f(x):\n    return x ** 2  # comment",
    "",
]


def field(reader, name):
    f = reader.fields.get(name)
    if f is None:
        return None
    v = f.contents()
    return v


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("gguf")
    ap.add_argument("out")
    ap.add_argument("--dump-tokenizer")
    a = ap.parse_args()
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer

    r = gguf.GGUFReader(a.gguf)
    arch = field(r, "general.architecture")
    tok = {}
    for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items():
        v = field(r, f"tokenizer.{key}")
        if v is not None:
            tok[name] = v
    backend, _ = convert_gguf_tokenizer(arch, tok)
    if a.dump_tokenizer:
        backend.save(a.dump_tokenizer)
    ids = [backend.encode(t, add_special_tokens=False).ids for t in TEXTS]
    decoded = [backend.decode(i, skip_special_tokens=False) for i in ids]
    with open(a.out, "w") as f:
        json.dump({"texts": TEXTS, "ids": ids, "decoded": decoded}, f, ensure_ascii=False, indent=0)


if __name__ == "__main__":
    main()
