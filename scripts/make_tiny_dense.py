#!/usr/bin/env python3
"""Tiny Llama / Qwen2 / Qwen3 (scaled rope) / Gemma 3 checkpoints and their transformers references,
for the parity tests.

    python3 scripts/make_tiny_dense.py OUT_DIR [NAME ...]   (needs torch, transformers, safetensors)

For each fixture: random weights (HF init, 1-D tensors perturbed, the final norm widened so greedy
top-1/top-2 gaps are not tiny), rounded to bf16 and saved with `save_pretrained`, then reloaded
in f32 with eager attention to compute `reference.safetensors`: `input_ids` (72 random ids),
`logits` (full prefill), `greedy_ids` (prompt + 16 greedy tokens through the cache) and
`decode_logits` (the logits each greedy step chose from). `reference.json` records the margins.
The layout is the one `crates/models/tests/common` reads.
"""
import json
import os
import shutil
import sys

import numpy as np
import torch
import transformers as T
from safetensors.torch import save_file

PROMPT_LEN, STEPS, V = 72, 16, 512


def fixtures():
    base = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, initializer_range=0.1,
                bos_token_id=1, eos_token_id=2)
    return {
        # SmolLM2's shape: tied embeddings, plain rope
        "llama": (T.LlamaForCausalLM, T.LlamaConfig(**base, tie_word_embeddings=True,
                                                     rope_parameters={"rope_type": "default", "rope_theta": 100000.0})),
        # Llama 3.x's: untied, llama3 rope scaling, and every optional bias
        "llama_scaled": (T.LlamaForCausalLM, T.LlamaConfig(
            **base, tie_word_embeddings=False, attention_bias=True, mlp_bias=True,
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
        "qwen2": (T.Qwen2ForCausalLM, T.Qwen2Config(**base, tie_word_embeddings=True,
                                                     rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
        # long-context Qwen3: YaRN over a 32-position original context (the prompt is 72)
        "qwen3_yarn": (T.Qwen3ForCausalLM, T.Qwen3Config(**{**base, "max_position_embeddings": 128}, head_dim=16,
                       tie_word_embeddings=True, rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                                                  "original_max_position_embeddings": 32})),
        # dynamic NTK past a 48-position context
        "llama_dynamic": (T.LlamaForCausalLM, T.LlamaConfig(**{**base, "max_position_embeddings": 48},
                          tie_word_embeddings=True, rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0,
                                                                     "factor": 2.0})),
        # Gemma 3 (270M's shape in miniature, untied head, logit softcap): sliding layers, 16-position window
        "gemma3_text": (T.Gemma3ForCausalLM, T.Gemma3TextConfig(**{**gemma3_text(), "tie_word_embeddings": False},
                                                                 final_logit_softcapping=30.0)),
        # Gemma3ForConditionalGeneration's language model (4B's linear-scaled global rope); the vision
        # tower is tiny and unused by a text prompt. No logit softcap: transformers' ConditionalGeneration
        # head ignores final_logit_softcapping (its CausalLM applies it; real Gemma 3 configs ship null)
        "gemma3": (T.Gemma3ForConditionalGeneration, T.Gemma3Config(
            text_config=dict(**gemma3_text(full_rope={"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}),
                             final_logit_softcapping=None),
            vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                               image_size=28, patch_size=14), mm_tokens_per_image=4)),
    }


def gemma3_text(full_rope=None):
    return dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=5, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=16,
                layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
                             "full_attention"],
                rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                 "full_attention": full_rope or {"rope_type": "default", "rope_theta": 1e6}},
                max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.1, bos_token_id=2,
                eos_token_id=1, pad_token_id=0, tie_word_embeddings=True)


def perturb(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in model.state_dict(keep_vars=True).items():
            if t.is_floating_point() and t.ndim <= 1:
                t.add_(torch.randn(t.shape, generator=g) * 0.1)
            if name == "model.norm.weight":
                t.mul_(4.0)
            if name.endswith("language_model.norm.weight") or (name == "model.norm.weight" and "Gemma" in type(model).__name__):
                t.add_(3.0)  # Gemma's norms scale by (1 + w)


@torch.no_grad()
def greedy(model, ids, steps):
    out = model(input_ids=ids, use_cache=True)
    past, logits = out.past_key_values, out.logits[:, -1]
    seq, step_logits = ids, []
    for _ in range(steps):
        step_logits.append(logits[0].clone())
        nxt = logits.argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], dim=1)
        out = model(input_ids=nxt, past_key_values=past, use_cache=True)
        past, logits = out.past_key_values, out.logits[:, -1]
    return seq, torch.stack(step_logits)


def margins(logits):
    top2 = torch.topk(logits, 2, dim=-1).values
    return (top2[..., 0] - top2[..., 1]).tolist()


def build(name, cls, cfg, out_root, seed):
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    perturb(model, seed + 1)
    model = model.to(torch.bfloat16)
    out = os.path.join(out_root, name)
    shutil.rmtree(out, ignore_errors=True)
    model.save_pretrained(out, safe_serialization=True)
    model = cls.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    ids = torch.tensor(np.random.RandomState(1234).randint(3, V - 12, size=(1, PROMPT_LEN)), dtype=torch.long)
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits.float()
        seq, step_logits = greedy(model, ids, STEPS)
        full = model(input_ids=seq, use_cache=False).logits[0, PROMPT_LEN - 1:-1].argmax(-1)
    ref = dict(input_ids=ids, logits=logits, greedy_ids=seq, decode_logits=step_logits.float())
    save_file({k: v.contiguous() for k, v in ref.items()}, os.path.join(out, "reference.safetensors"))
    meta = dict(family=name, model_class=cls.__name__, seed=seed, prompt_len=PROMPT_LEN, steps=STEPS,
                weights_dtype="bfloat16", reference_dtype="float32", attn_implementation="eager",
                torch=torch.__version__, transformers=T.__version__,
                cache_matches_full_recompute=bool((full == seq[0, PROMPT_LEN:]).all()),
                greedy_new_ids=seq[0, PROMPT_LEN:].tolist(),
                decode_top1_top2_margin_min=min(margins(step_logits)),
                prefill_top1_top2_margin_min=min(margins(logits[0])))
    with open(os.path.join(out, "reference.json"), "w") as f:
        json.dump(meta, f, indent=1)
    return meta


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "crates/models/tests/fixtures/tiny"
    only = set(sys.argv[2:])
    for i, (name, (cls, cfg)) in enumerate(fixtures().items()):
        if only and name not in only:
            continue
        m = build(name, cls, cfg, out, seed=10 + i)
        print(name, m["greedy_new_ids"], "min decode margin", round(m["decode_top1_top2_margin_min"], 4))


if __name__ == "__main__":
    main()
