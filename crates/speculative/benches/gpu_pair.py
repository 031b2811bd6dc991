#!/usr/bin/env python3
"""A high-agreement draft/target pair in real shapes: a random Qwen3-0.6B-shaped draft and a
Qwen3-8B-shaped target that computes the draft's function in the first 1024 of its 4096 residual
features, plus 8 layers of its own whose output projections are small (they add little).

Draft (hidden 1024, 28 layers, 16 query / 8 key-value heads of 128, MLP 3072, tied head): random
bf16, embeddings N(0, 1) (a sharp head: top-1 margins well above bf16 rounding), other weights
N(0, 0.02), norms 1. Target (hidden 4096, 36 layers, 32 / 8 heads of 128, MLP 12288, untied
head), the draft padded with zeros:
  * embeddings and head: the draft's table in features 0..1024;
  * layers 0..27: the draft's; query head h goes to head 4 (h // 2) + h % 2 (the same key-value
    head under 4-way grouping), the other heads' queries and output columns are zero; K/V and
    MLP rows and columns beyond the draft's are zero; norm weights halved (the RMS over 4096
    features of which 3072 are zero is half the draft's);
  * layers 28..35: N(0, 0.02), output projections (o_proj, down_proj) N(0, 2e-4).
So the target's greedy tokens are the draft's but where the extra layers' small additions flip a
choice, while each target step reads a Qwen3-8B's bytes.

Both models nearly repeat their input token (embeddings N(0, 1) dominate the residual stream and
the head is the token table), so greedy decoding repeats the prompt's last token: every draft is
accepted. OUT_DIR/useless is the draft with an untied head whose rows are the token table's rows
permuted: it proposes another token than the target's at almost every step (the pair for
adaptive depth's useless-draft case).

  python3 gpu_pair.py OUT_DIR     # writes OUT_DIR/draft, OUT_DIR/useless and OUT_DIR/target (bf16, sharded)
"""
import json
import os
import sys

import torch
from safetensors.torch import save_file

V, EPS, THETA = 151936, 1e-6, 1000000.0
DRAFT = dict(hidden=1024, inter=3072, layers=28, heads=16, kv=8, tied=True)
TARGET = dict(hidden=4096, inter=12288, layers=36, heads=32, kv=8, tied=False)
D = 128


def config(s):
    return {
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": s["hidden"],
        "intermediate_size": s["inter"], "num_hidden_layers": s["layers"], "num_attention_heads": s["heads"],
        "num_key_value_heads": s["kv"], "head_dim": D, "vocab_size": V, "rms_norm_eps": EPS,
        "rope_theta": THETA, "tie_word_embeddings": s["tied"], "max_position_embeddings": 40960,
        "hidden_act": "silu", "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16",
    }


def write(out, s, tensors):
    """Shards of about 4 GB, an index, the config."""
    os.makedirs(out, exist_ok=True)
    shards, cur, size = [], {}, 0
    for k, v in tensors.items():
        cur[k] = v.contiguous()
        size += v.numel() * v.element_size()
        if size > 4e9:
            shards.append(cur)
            cur, size = {}, 0
    if cur:
        shards.append(cur)
    index = {"metadata": {}, "weight_map": {}}
    for i, sh in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: v.cpu() for k, v in sh.items()}, os.path.join(out, name), metadata={"format": "pt"})
        index["weight_map"].update({k: name for k in sh})
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config(s), f, indent=1)


def main():
    out = sys.argv[1]
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=dev).manual_seed(0)
    bf = torch.bfloat16

    def rnd(*shape, std=0.02):
        return (torch.randn(*shape, generator=g, device=dev) * std).to(bf)

    h, i, nh, nkv = DRAFT["hidden"], DRAFT["inter"], DRAFT["heads"], DRAFT["kv"]
    d = {"model.embed_tokens.weight": rnd(V, h, std=1.0), "model.norm.weight": torch.ones(h, dtype=bf, device=dev)}
    for l in range(DRAFT["layers"]):
        p = f"model.layers.{l}."
        d.update({
            p + "input_layernorm.weight": torch.ones(h, dtype=bf, device=dev),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=bf, device=dev),
            p + "self_attn.q_proj.weight": rnd(nh * D, h), p + "self_attn.k_proj.weight": rnd(nkv * D, h),
            p + "self_attn.v_proj.weight": rnd(nkv * D, h), p + "self_attn.o_proj.weight": rnd(h, nh * D),
            p + "self_attn.q_norm.weight": torch.ones(D, dtype=bf, device=dev),
            p + "self_attn.k_norm.weight": torch.ones(D, dtype=bf, device=dev),
            p + "mlp.gate_proj.weight": rnd(i, h), p + "mlp.up_proj.weight": rnd(i, h), p + "mlp.down_proj.weight": rnd(h, i),
        })
    write(os.path.join(out, "draft"), DRAFT, d)

    H, I, NH, NKV = TARGET["hidden"], TARGET["inter"], TARGET["heads"], TARGET["kv"]

    def pad(w, rows, cols):
        z = torch.zeros(rows, cols, dtype=bf, device=dev)
        z[: w.shape[0], : w.shape[1]] = w
        return z

    def half(w, n):
        z = torch.zeros(n, dtype=bf, device=dev)
        z[: w.shape[0]] = (w.float() / 2).to(bf)
        return z

    t = {
        "model.embed_tokens.weight": pad(d["model.embed_tokens.weight"], V, H),
        "model.norm.weight": half(d["model.norm.weight"], H),
        "lm_head.weight": pad(d["model.embed_tokens.weight"], V, H),
    }
    heads = [4 * (k // 2) + k % 2 for k in range(nh)]
    for l in range(TARGET["layers"]):
        p = f"model.layers.{l}."
        if l < DRAFT["layers"]:
            q = torch.zeros(NH * D, H, dtype=bf, device=dev)
            o = torch.zeros(H, NH * D, dtype=bf, device=dev)
            for k, k2 in enumerate(heads):
                q[k2 * D:(k2 + 1) * D, :h] = d[p + "self_attn.q_proj.weight"][k * D:(k + 1) * D]
                o[:h, k2 * D:(k2 + 1) * D] = d[p + "self_attn.o_proj.weight"][:, k * D:(k + 1) * D]
            t.update({
                p + "input_layernorm.weight": half(d[p + "input_layernorm.weight"], H),
                p + "post_attention_layernorm.weight": half(d[p + "post_attention_layernorm.weight"], H),
                p + "self_attn.q_proj.weight": q, p + "self_attn.o_proj.weight": o,
                p + "self_attn.k_proj.weight": pad(d[p + "self_attn.k_proj.weight"], NKV * D, H),
                p + "self_attn.v_proj.weight": pad(d[p + "self_attn.v_proj.weight"], NKV * D, H),
                p + "self_attn.q_norm.weight": d[p + "self_attn.q_norm.weight"],
                p + "self_attn.k_norm.weight": d[p + "self_attn.k_norm.weight"],
                p + "mlp.gate_proj.weight": pad(d[p + "mlp.gate_proj.weight"], I, H),
                p + "mlp.up_proj.weight": pad(d[p + "mlp.up_proj.weight"], I, H),
                p + "mlp.down_proj.weight": pad(d[p + "mlp.down_proj.weight"], H, I),
            })
        else:
            t.update({
                p + "input_layernorm.weight": torch.ones(H, dtype=bf, device=dev),
                p + "post_attention_layernorm.weight": torch.ones(H, dtype=bf, device=dev),
                p + "self_attn.q_proj.weight": rnd(NH * D, H), p + "self_attn.k_proj.weight": rnd(NKV * D, H),
                p + "self_attn.v_proj.weight": rnd(NKV * D, H), p + "self_attn.o_proj.weight": rnd(H, NH * D, std=2e-4),
                p + "self_attn.q_norm.weight": torch.ones(D, dtype=bf, device=dev),
                p + "self_attn.k_norm.weight": torch.ones(D, dtype=bf, device=dev),
                p + "mlp.gate_proj.weight": rnd(I, H), p + "mlp.up_proj.weight": rnd(I, H),
                p + "mlp.down_proj.weight": rnd(H, I, std=2e-4),
            })
    write(os.path.join(out, "target"), TARGET, t)
    # drawn after the target's weights, which stay as they were without it
    perm = torch.randperm(V, generator=g, device=dev)
    write(os.path.join(out, "useless"), {**DRAFT, "tied": False}, {**d, "lm_head.weight": d["model.embed_tokens.weight"][perm]})


if __name__ == "__main__":
    main()
