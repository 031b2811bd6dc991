#!/usr/bin/env python3
"""Check a converted directory against gguf-py: every tensor of the GGUF, dequantized by
`gguf.quants.dequantize`, with transformers' Q/K un-permutation for llama and Gemma's `norm - 1`,
must equal the f32 safetensors `convert gguf --dtype f32` wrote, bit for bit.

    pip install gguf numpy safetensors
    cargo run --release -p mlx-convert --example convert -- gguf M.gguf /tmp/m --dtype f32
    python3 scripts/check_gguf_convert.py M.gguf /tmp/m
"""
import re
import sys

import numpy as np
import gguf
from safetensors.numpy import load_file

NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
GEMMA = {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
         "post_ffw_norm": "post_feedforward_layernorm"}


def reverse_permute(w, n_head):
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def main():
    path, out = sys.argv[1], sys.argv[2]
    r = gguf.GGUFReader(path)
    arch = r.fields["general.architecture"].contents()
    n_head = r.fields[f"{arch}.attention.head_count"].contents()
    n_kv = r.fields[f"{arch}.attention.head_count_kv"].contents()
    ours = load_file(f"{out}/model.safetensors")
    top = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
    checked = 0
    for t in r.tensors:
        if t.name in top:
            hf = top[t.name]
        else:
            m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", t.name)
            stem = m.group(2)
            mapped = GEMMA.get(stem) if arch == "gemma3" else None
            mapped = mapped or NAMES.get(stem) or ("post_attention_layernorm" if stem == "ffn_norm" else None)
            hf = f"model.layers.{m.group(1)}.{mapped}.{m.group(3)}"
        shape = tuple(int(d) for d in reversed(t.shape))
        w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        if arch == "llama" and t.name.endswith("attn_q.weight"):
            w = reverse_permute(w, n_head)
        if arch == "llama" and t.name.endswith("attn_k.weight"):
            w = reverse_permute(w, n_kv)
        if arch == "gemma3" and t.name.endswith("norm.weight"):
            w = w - np.float32(1)
        got = ours[hf]
        assert got.dtype == np.float32 and got.shape == w.shape, (hf, got.dtype, got.shape, w.shape)
        if not np.array_equal(got.view(np.uint32), w.view(np.uint32)):
            bad = np.argwhere(got.view(np.uint32) != w.view(np.uint32))
            sys.exit(f"{hf}: {len(bad)} values differ, first at {bad[0]}: {got[tuple(bad[0])]} vs {w[tuple(bad[0])]}")
        checked += 1
    assert checked == len(ours), (checked, len(ours))
    print(f"{path}: {checked} tensors bit-identical to gguf-py")


if __name__ == "__main__":
    main()
