#!/usr/bin/env python3
"""Gemma 4 assistant-draft fixture: a tiny random `gemma4_assistant` checkpoint drafting for the
committed tiny Gemma 4 target (crates/models/tests/fixtures/tiny/gemma4_text), and the draft
logits transformers 5.17 computes for a fixed context, for `tests/gemma4_assistant.rs`.

The drafting loop is transformers' `SinglePositionMultiTokenCandidateGenerator.get_candidates`:
after the target has run over the context t_0..t_{n-2}, the assistant takes
inputs_embeds = cat[target.embed_tokens(t_{n-1}) (scaled), h_{n-2}] at position n-1 with the
target's K/V of its last non-shared sliding and full layers (`shared_kv_states`), returns logits
and a projected hidden state; each further draft feeds back its argmax and that hidden state at
the same position. h is `hidden_states[-1]` of the target's forward.

Writes crates/speculative/tests/fixtures/gemma4_assistant/:
  assistant/config.json, assistant/model.safetensors   the draft checkpoint
  reference.safetensors   for a 13-token context and a 27-token one (`long_`, past the sliding
                          window): tokens, draft tokens [DEPTH], draft logits [DEPTH, V]; and
                          the 27-token one with the sliding K/V cut to the target's last
                          `sliding_window` positions (`long_window_`), as our cache holds them.
                          transformers' own mask (`create_bidirectional_sliding_window_mask`,
                          distance <= window, flipped) lets the query see `sliding_window + 1`
                          of them; its logits are kept for the record (`long_draft_logits`).
Run: python3 crates/speculative/scripts/make_gemma4_assistant_fixture.py
     (torch, transformers==5.17, safetensors)
"""
import json
import os

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, Gemma4AssistantConfig, Gemma4AssistantForCausalLM

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
TARGET = os.path.join(ROOT, "crates/models/tests/fixtures/tiny/gemma4_text")
OUT = os.path.join(ROOT, "crates/speculative/tests/fixtures/gemma4_assistant")
TOKENS = [2, 17, 230, 5, 99, 41, 17, 410, 88, 3, 230, 64, 301]
# longer than the sliding window (16): the sliding layer's K/V is the target's last window
LONG = TOKENS + [7, 512, 33, 901, 45, 18, 260, 77, 5, 640, 123, 9, 300, 54]
DEPTH = 4


def main():
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    with open(os.path.join(TARGET, "config.json")) as f:
        tc = json.load(f)
    text = {
        "model_type": "gemma4_text",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": tc["num_key_value_heads"],
        "head_dim": tc["head_dim"],
        "global_head_dim": tc["global_head_dim"],
        "layer_types": ["sliding_attention", "full_attention"],
        "num_kv_shared_layers": 2,
        "hidden_size_per_layer_input": 0,
        "vocab_size_per_layer_input": 0,
        "use_double_wide_mlp": False,
        "enable_moe_block": False,
        "attention_k_eq_v": False,
        "vocab_size": tc["vocab_size"],
        "sliding_window": tc["sliding_window"],
        "rope_parameters": tc["rope_parameters"],
        "final_logit_softcapping": tc["final_logit_softcapping"],
        "rms_norm_eps": tc["rms_norm_eps"],
        "hidden_activation": tc["hidden_activation"],
        "max_position_embeddings": tc["max_position_embeddings"],
        "tie_word_embeddings": True,
        "initializer_range": 0.1,
    }
    cfg = Gemma4AssistantConfig(text_config=text, backbone_hidden_size=tc["hidden_size"], use_ordered_embeddings=False)
    cfg.architectures = ["Gemma4AssistantForCausalLM"]
    assistant = Gemma4AssistantForCausalLM(cfg).eval()
    with torch.no_grad():
        # random norms and scalars too, so a missed weight shows in the logits
        for name, p in assistant.named_parameters():
            if "norm" in name or "layer_scalar" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.1 * torch.randn_like(p))
    os.makedirs(os.path.join(OUT, "assistant"), exist_ok=True)
    assistant.save_pretrained(os.path.join(OUT, "assistant"), safe_serialization=True)

    refs, info = {}, {}
    window = tc["sliding_window"]
    for name, tokens, keep in (("", TOKENS, None), ("long_", LONG, None), ("long_window_", LONG, window)):
        toks, logits, kv = drafts(target, assistant, tokens, keep)
        refs[name + "tokens"] = torch.tensor(tokens, dtype=torch.int32)
        refs[name + "draft_tokens"] = torch.tensor(toks, dtype=torch.int32)
        refs[name + "draft_logits"] = logits
        info[name + "draft_tokens"] = toks
        info[name + "shared_kv"] = kv
    save_file(refs, os.path.join(OUT, "reference.safetensors"))
    print(json.dumps(info))


def drafts(target, assistant, tokens, keep):
    """DEPTH greedy drafts after `tokens` (the target has run over all but the last); `keep`:
    the sliding layer's K/V cut to its last `keep` positions first."""
    ctx = torch.tensor([tokens[:-1]])
    with torch.no_grad():
        out = target(input_ids=ctx, output_hidden_states=True, return_shared_kv_states=True, use_cache=True)
        shared = dict(out.shared_kv_states)
        if keep is not None:
            k, v = shared["sliding_attention"]
            shared["sliding_attention"] = (k[:, :, -keep:], v[:, :, -keep:])
        hidden = out.hidden_states[-1][:, -1:]
        embed = target.get_input_embeddings()
        last = torch.tensor([[tokens[-1]]])
        pos = torch.tensor([[len(tokens) - 1]])
        toks, logits = [], []
        for _ in range(DEPTH):
            x = torch.cat([embed(last), hidden], dim=-1)
            o = assistant(inputs_embeds=x, position_ids=pos, shared_kv_states=shared, use_cache=False)
            logits.append(o.logits[0, -1])
            last = o.logits.argmax(-1)
            toks.append(int(last[0, 0]))
            hidden = o.last_hidden_state
    kv = {k: list(v[0].shape) for k, v in shared.items()}
    return toks, torch.stack(logits).float().contiguous(), kv


if __name__ == "__main__":
    main()
