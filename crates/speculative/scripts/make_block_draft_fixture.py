#!/usr/bin/env python3
"""Block-draft fixtures (DSpark and DFlash) for `tests/block.rs`: a tiny random checkpoint of each
layout and the draft logits a torch re-implementation computes for fixed contexts.

The re-implementation is written from the published reference code, independently of the Rust
one:
  * DFlash: z-lab/dflash `dflash/model.py` (`DFlashDraftModel`, `Qwen3DFlashAttention`,
    `dflash_generate`): context = hidden_norm(fc(concat of the target's hidden_states[i + 1] for
    i in target_layer_ids)); the block [anchor, mask x (B - 1)] embedded with the target's
    embedding table times `input_embedding_scale`; Qwen3-style layers whose keys and values are
    the projected context followed by the block's own (k_norm and RoPE on both), no mask; the
    final norm; the target's head on the mask rows times `output_multiplier`, soft-capped; row j
    drafts the token at its own position.
  * DSpark: deepseek-ai/DeepSpec's Gemma 4 DSpark as mlx-node `models/gemma4/dspark.rs` ports it:
    own embedding times sqrt(hidden); Gemma sandwich-norm layers with a layer scalar; keys =
    RoPE(k_norm(k_proj x)), values = the same projection RMS-normed without a scale (K = V);
    proportional RoPE (the first partial_rotary_factor of the head rotates), attention scale 1,
    no mask over context + block; final norm; own head, soft-capped; row j drafts the token after
    it, plus the Markov bias markov_w2 @ markov_w1[prev] (prev: the anchor, then the previous
    greedy draft); keep-probabilities sigmoid(proj [h_j, markov_w1[prev_j]] + b).

The targets are the committed tiny checkpoints (crates/models/tests/fixtures/tiny/qwen3 for
DFlash, gemma4_text for DSpark), run by transformers 5.17 with output_hidden_states.

The random weights are written by the Rust loader's expected-keys writer (the
`random_block_draft` example), so the checkpoint layout is the loader's; this script reads them.

Writes crates/speculative/tests/fixtures/block/{dflash,dspark}/:
  config.json, model.safetensors       the draft (DFlash f32, DSpark bf16)
  reference.safetensors                for each case NAME: NAME_tokens (the history; its last
                                       token is the anchor), NAME_draft_tokens [k],
                                       NAME_draft_logits [k, V] f32, and for DSpark
                                       NAME_keep [k]
Run (torch, transformers==5.17, safetensors; the example is built by cargo):
  python3 crates/speculative/scripts/make_block_draft_fixture.py
"""
import json
import math
import os
import subprocess

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
TINY = os.path.join(ROOT, "crates/models/tests/fixtures/tiny")
OUT = os.path.join(ROOT, "crates/speculative/tests/fixtures/block")

DFLASH = {
    "architectures": ["DFlashDraftModel"],
    "model_type": "qwen3",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 4096,
    "hidden_act": "silu",
    "num_target_layers": 3,
    "layer_types": ["full_attention", "full_attention"],
    "dflash_config": {
        "block_size": 8,
        "target_layer_ids": [0, 1],
        "mask_token_id": 5,
        "input_embedding_scale": 1.5,
        "output_multiplier": 0.5,
        "final_logit_softcapping": 20.0,
    },
}

DSPARK = {
    "architectures": ["Gemma4DSparkModel"],
    "model_type": "gemma4_text",
    "block_size": 7,
    "mask_token_id": 4,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "global_head_dim": 32,
    "num_global_key_value_heads": 1,
    "rms_norm_eps": 1e-6,
    "final_logit_softcapping": 30.0,
    "vocab_size": 1024,
    "target_layer_ids": [1, 4],
    "num_target_layers": 6,
    "markov_rank": 8,
    "markov_head_type": "vanilla",
    "enable_confidence_head": True,
    "attention_k_eq_v": True,
    "rope_parameters": {"full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0, "rope_type": "proportional"}},
}

# (name, history, drafts): a long context with a full block, and a short one with a short block
CASES = {
    "dflash": [("full", [11, 42, 7, 300, 5, 77, 140, 9, 260, 33, 481, 12, 64], 7), ("short", [3, 99, 17, 250], 3)],
    "dspark": [("full", [2, 17, 230, 5, 99, 41, 17, 410, 88, 3, 230, 64, 301], 7), ("short", [2, 640, 123, 9], 3)],
}


def rms(x, w, eps):
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x if w is None else x * w


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def rope(x, positions, inv_freq):
    """x [1, H, L, D], NeoX halves; inv_freq [D / 2] (0: a pair that does not rotate)."""
    ang = positions[:, None].double() * inv_freq[None, :].double()
    cos = torch.cat([ang.cos(), ang.cos()], -1).float()
    sin = torch.cat([ang.sin(), ang.sin()], -1).float()
    return x * cos + rotate_half(x) * sin


def attend(q, k, v, scale):
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    w = torch.softmax((q @ k.transpose(-1, -2)) * scale, dim=-1)
    return w @ v


def heads(x, n, d):
    return x.view(1, x.shape[1], n, d)


def taps_of(target, tokens, ids):
    with torch.no_grad():
        out = target(input_ids=torch.tensor([tokens]), output_hidden_states=True)
    return torch.cat([out.hidden_states[i + 1] for i in ids], dim=-1).float()


def dflash(target, W, c, history, k):
    d, nh, nkv, eps = c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"], c["rms_norm_eps"]
    f = c["dflash_config"]
    n = len(history)
    inv = 1.0 / (c["rope_theta"] ** (torch.arange(0, d, 2).double() / d))
    ctx = rms(taps_of(target, history[:-1], f["target_layer_ids"]) @ W["fc.weight"].T, W["hidden_norm.weight"], eps)
    block = torch.tensor([[history[-1]] + [f["mask_token_id"]] * k])
    table = target.get_input_embeddings().weight.float()
    x = table[block] * f["input_embedding_scale"]
    cpos, bpos = torch.arange(0, n - 1), torch.arange(n - 1, n + k)
    for i in range(c["num_hidden_layers"]):
        p = f"layers.{i}."
        h = rms(x, W[p + "input_layernorm.weight"], eps)
        q = rope(rms(heads(h @ W[p + "self_attn.q_proj.weight"].T, nh, d), W[p + "self_attn.q_norm.weight"], eps).transpose(1, 2), bpos, inv)

        def kv(z, pos):
            kk = rms(heads(z @ W[p + "self_attn.k_proj.weight"].T, nkv, d), W[p + "self_attn.k_norm.weight"], eps).transpose(1, 2)
            vv = heads(z @ W[p + "self_attn.v_proj.weight"].T, nkv, d).transpose(1, 2)
            return rope(kk, pos, inv), vv

        (kc, vc), (kb, vb) = kv(ctx, cpos), kv(h, bpos)
        a = attend(q, torch.cat([kc, kb], 2), torch.cat([vc, vb], 2), d ** -0.5)
        x = x + a.transpose(1, 2).reshape(1, k + 1, nh * d) @ W[p + "self_attn.o_proj.weight"].T
        m = rms(x, W[p + "post_attention_layernorm.weight"], eps)
        gate, up = m @ W[p + "mlp.gate_proj.weight"].T, m @ W[p + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ W[p + "mlp.down_proj.weight"].T
    hid = rms(x, W["norm.weight"], eps)[0, 1:]
    logits = (hid @ target.lm_head.weight.float().T) * f["output_multiplier"]
    cap = f["final_logit_softcapping"]
    logits = torch.tanh(logits / cap) * cap
    return logits.argmax(-1).tolist(), logits, None


def dspark(target, W, c, history, k):
    d, nh, nkv, eps, hsz = c["global_head_dim"], c["num_attention_heads"], c["num_global_key_value_heads"], c["rms_norm_eps"], c["hidden_size"]
    r = c["rope_parameters"]["full_attention"]
    rot = int(d * r["partial_rotary_factor"])
    inv = torch.zeros(d // 2, dtype=torch.float64)
    inv[: rot // 2] = 1.0 / (r["rope_theta"] ** (torch.arange(0, rot, 2).double() / d))
    n = len(history)
    ctx = rms(taps_of(target, history[:-1], c["target_layer_ids"]) @ W["fc.weight"].T, W["hidden_norm.weight"], eps)
    block = torch.tensor([[history[-1]] + [c["mask_token_id"]] * (k - 1)])
    x = W["embed_tokens.weight"][block] * math.sqrt(hsz)
    cpos, bpos = torch.arange(0, n - 1), torch.arange(n - 1, n - 1 + k)
    for i in range(c["num_hidden_layers"]):
        p = f"layers.{i}."
        h = rms(x, W[p + "input_layernorm.weight"], eps)
        q = rope(rms(heads(h @ W[p + "self_attn.q_proj.weight"].T, nh, d), W[p + "self_attn.q_norm.weight"], eps).transpose(1, 2), bpos, inv)

        def kv(z, pos):
            raw = heads(z @ W[p + "self_attn.k_proj.weight"].T, nkv, d)
            kk = rope(rms(raw, W[p + "self_attn.k_norm.weight"], eps).transpose(1, 2), pos, inv)
            return kk, rms(raw, None, eps).transpose(1, 2)

        (kc, vc), (kb, vb) = kv(ctx, cpos), kv(h, bpos)
        a = attend(q, torch.cat([kc, kb], 2), torch.cat([vc, vb], 2), 1.0)
        a = a.transpose(1, 2).reshape(1, k, nh * d) @ W[p + "self_attn.o_proj.weight"].T
        x = x + rms(a, W[p + "post_attention_layernorm.weight"], eps)
        m = rms(x, W[p + "pre_feedforward_layernorm.weight"], eps)
        gate, up = m @ W[p + "mlp.gate_proj.weight"].T, m @ W[p + "mlp.up_proj.weight"].T
        y = (torch.nn.functional.gelu(gate, approximate="tanh") * up) @ W[p + "mlp.down_proj.weight"].T
        x = (x + rms(y, W[p + "post_feedforward_layernorm.weight"], eps)) * W[p + "layer_scalar"]
    hid = rms(x, W["norm.weight"], eps)[0]
    cap = c["final_logit_softcapping"]
    base = torch.tanh((hid @ W["lm_head.weight"].T) / cap) * cap
    w1, w2 = W["markov_head.markov_w1.weight"], W["markov_head.markov_w2.weight"]
    prev, toks, rows, prevs = history[-1], [], [], []
    for j in range(k):
        row = base[j] + w2 @ w1[prev]
        prevs.append(prev)
        prev = int(row.argmax())
        toks.append(prev)
        rows.append(row)
    feats = torch.cat([hid, w1[torch.tensor(prevs)]], -1)
    keep = torch.sigmoid(feats @ W["confidence_head.proj.weight"].T + W["confidence_head.proj.bias"])[:, 0]
    return toks, torch.stack(rows), keep


def main():
    torch.manual_seed(0)
    for name, cfg, target_name, dtype, fn in (
        ("dflash", DFLASH, "qwen3", "f32", dflash),
        ("dspark", DSPARK, "gemma4_text", "bf16", dspark),
    ):
        out = os.path.join(OUT, name)
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
        subprocess.run(
            ["cargo", "run", "-q", "-p", "mlx-speculative", "--example", "random_block_draft", "--", out, "--seed", "22", "--dtype", dtype],
            check=True, cwd=ROOT,
        )
        W = {k: v.float() for k, v in load_file(os.path.join(out, "model.safetensors")).items()}
        target = AutoModelForCausalLM.from_pretrained(os.path.join(TINY, target_name), dtype=torch.float32).eval()
        refs, info = {}, {}
        with torch.no_grad():
            for case, history, k in CASES[name]:
                toks, logits, keep = fn(target, W, cfg, history, k)
                refs[f"{case}_tokens"] = torch.tensor(history, dtype=torch.int32)
                refs[f"{case}_draft_tokens"] = torch.tensor(toks, dtype=torch.int32)
                refs[f"{case}_draft_logits"] = logits.float().contiguous()
                if keep is not None:
                    refs[f"{case}_keep"] = keep.float().contiguous()
                info[case] = toks
        save_file(refs, os.path.join(out, "reference.safetensors"))
        print(name, json.dumps(info))


if __name__ == "__main__":
    main()
