#!/usr/bin/env python3
"""Tiny random OpenAI Privacy Filter checkpoint (`openai_privacy_filter`) and its transformers reference,
for crates/models/tests/privacy_filter.rs.

    python3 scripts/make_privacy_filter_fixture.py OUT_DIR [--tokenizer PATH]
    (needs torch, transformers >= 5.17 with models/openai_privacy_filter, tokenizers, numpy, safetensors)

OUT_DIR receives:
- `config.json`, `model.safetensors`: `OpenAIPrivacyFilterForTokenClassification` with random weights
  (3 bidirectional layers, 4 experts top-2, YaRN rope, a 6-token sliding window, non-zero attention sinks,
  expert gate/up projections large enough that the SwiGLU clamp at 7 is hit), rounded to bf16 and written
  with `save_pretrained` (the layout hub checkpoints ship).
- `tokenizer.json`: a byte-level BPE (by default the repository's tiny Qwen3 one).
- `viterbi_calibration.json`: `operating_points.default.biases` with six non-zero transition biases.
- `reference.safetensors`: `input_ids` `[1, T]` and `logits` `[1, T, 33]` of the checkpoint reloaded in
  float32 with eager attention, for `TEXT` tokenized without special tokens (`short_input_ids`,
  `short_logits`: the same for `SHORT_TEXT`, shorter than the window).
- `reference.json`: the text, the token ids and byte offsets (converted from the Python binding's
  character offsets), and the spans a plain NumPy BIOES Viterbi decoder (written here, independent of the
  Rust one) extracts from those logits under the file's calibration and under `OVERRIDE` (threshold 0:
  every span with its mean probability).
"""
import argparse
import json
import os
import shutil

import numpy as np
import torch
import transformers as T
from safetensors.torch import save_file
from tokenizers import Tokenizer
from transformers.models.openai_privacy_filter import (OpenAIPrivacyFilterConfig,
                                                     OpenAIPrivacyFilterForTokenClassification)

TEXT = ("Write to Zoë Müller at zoe.muller@example.com or call +49 30 1234567; she lives at 12 Rue de "
        "l’Église, Paris — born 1990-05-17 in 東京. Key: sk-9f8e7d6c5b4a.")
# shorter than the window: every key visible, no band mask
SHORT_TEXT = "Zoë 19"
SEED = 20
BIASES = {
    "transition_bias_background_stay": 0.3,
    "transition_bias_background_to_start": -0.2,
    "transition_bias_end_to_background": 0.15,
    "transition_bias_end_to_start": -0.4,
    "transition_bias_inside_to_continue": 0.25,
    "transition_bias_inside_to_end": -0.1,
}
# a per-call override that makes spans much more likely (entering and extending them is cheap)
OVERRIDE = {"transition_bias_background_stay": -2.0, "transition_bias_background_to_start": 2.0,
            "transition_bias_inside_to_continue": 1.5}


def config():
    return OpenAIPrivacyFilterConfig(
        vocab_size=512, hidden_size=64, intermediate_size=32, head_dim=16, num_attention_heads=4,
        num_key_value_heads=2, num_hidden_layers=3, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=6, max_position_embeddings=512, rms_norm_eps=1e-5, initializer_range=0.1,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64},
        pad_token_id=0, eos_token_id=0)


def perturb(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in model.state_dict(keep_vars=True).items():
            if not t.is_floating_point():
                continue
            if t.ndim <= 1:
                t.add_(torch.randn(t.shape, generator=g) * 0.1)
            if name.endswith("sinks"):
                t.copy_(torch.randn(t.shape, generator=g) * 1.5)
            if name.endswith("experts.gate_up_proj"):
                t.mul_(12.0)  # |gate|, |up| often past the clamp limit 7
            if name.endswith("experts.gate_up_proj_bias") or name.endswith("experts.down_proj_bias"):
                t.copy_(torch.randn(t.shape, generator=g) * 0.5)
            if name == "score.weight":
                t.mul_(4.0)  # peaked tag distributions: spans with mean probabilities on both sides of 0.5
            if name == "score.bias":
                t.copy_(torch.randn(t.shape, generator=g))
                t[0] += 6.0  # background (O) is the most common tag, as in real text


def parse_labels(id2label):
    tags = []
    for i in range(len(id2label)):
        lab = id2label[i]
        tags.append(("O", None) if lab == "O" else (lab[0], lab[2:]))
    return tags


def transitions(tags, b):
    n = len(tags)
    tr = np.full((n, n), -np.inf)
    for i, (p, pl) in enumerate(tags):
        for j, (q, ql) in enumerate(tags):
            if p == "O":
                if q == "O":
                    tr[i, j] = b["transition_bias_background_stay"]
                elif q in "BS":
                    tr[i, j] = b["transition_bias_background_to_start"]
            elif p in "BI":
                if q == "I" and ql == pl:
                    tr[i, j] = b["transition_bias_inside_to_continue"]
                elif q == "E" and ql == pl:
                    tr[i, j] = b["transition_bias_inside_to_end"]
            else:  # E, S
                if q == "O":
                    tr[i, j] = b["transition_bias_end_to_background"]
                elif q in "BS":
                    tr[i, j] = b["transition_bias_end_to_start"]
    return tr


def viterbi(logp, tags, b):
    t_len, n = logp.shape
    tr = transitions(tags, b)
    start = np.array([0.0 if p in "OBS" else -np.inf for p, _ in tags])
    end = np.array([0.0 if p in "OES" else -np.inf for p, _ in tags])
    score = start + logp[0]
    back = np.zeros((t_len, n), dtype=np.int64)
    for t in range(1, t_len):
        cand = score[:, None] + tr
        back[t] = cand.argmax(0)
        score = cand.max(0) + logp[t]
    score = score + end
    path = [int(score.argmax())]
    for t in range(t_len - 1, 0, -1):
        path.append(int(back[t, path[-1]]))
    return path[::-1]


def spans(text, path, probs, tags, offsets):
    out, cur = [], None
    for t, k in enumerate(path):
        p, lab = tags[k]
        if p in "BS":
            cur = (lab, t)
        if p in "ES" and cur is not None:
            a, z = cur[1], t
            s, e = offsets[a][0], offsets[z][1]
            score = float(np.mean([probs[i, path[i]] for i in range(a, z + 1)]))
            out.append(dict(label=lab, start=s, end=e, score=score,
                            text=text.encode()[s:e].decode(), tokens=[a, z + 1]))
            cur = None
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out_dir")
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--tokenizer", default=os.path.join(here, "../crates/models/tests/fixtures/tiny/qwen3/tokenizer.json"))
    args = ap.parse_args()
    out = args.out_dir

    torch.manual_seed(SEED)
    cls = OpenAIPrivacyFilterForTokenClassification
    model = cls(config()).eval()
    perturb(model, SEED + 1)
    model = model.to(torch.bfloat16)
    shutil.rmtree(out, ignore_errors=True)
    model.save_pretrained(out, safe_serialization=True)
    shutil.copyfile(args.tokenizer, os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "viterbi_calibration.json"), "w") as f:
        json.dump({"operating_points": {"default": {"biases": BIASES}}}, f, indent=1)

    model = cls.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    tok = Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
    enc = tok.encode(TEXT, add_special_tokens=False)
    byte_off = [(len(TEXT[:a].encode()), len(TEXT[:b].encode())) for a, b in enc.offsets]
    ids = torch.tensor([enc.ids], dtype=torch.long)

    clamp = []

    def hook(mod, inp, _out):  # fraction of gate/up pre-activations past the clamp, over all experts
        h = inp[0].float()
        gu = torch.einsum("th,ehf->etf", h, mod.gate_up_proj.float()) + mod.gate_up_proj_bias.float()[:, None]
        clamp.append(float((gu.abs() > mod.limit).float().mean()))

    for layer in model.model.layers:
        layer.mlp.experts.register_forward_hook(hook)
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
        text_clamp = list(clamp)  # the text's layers only
        short_ids = torch.tensor([tok.encode(SHORT_TEXT, add_special_tokens=False).ids], dtype=torch.long)
        assert short_ids.shape[1] <= model.config.sliding_window + 1
        short_logits = model(input_ids=short_ids).logits.float()
    save_file({"input_ids": ids.contiguous(), "logits": logits.contiguous(), "short_input_ids": short_ids.contiguous(),
               "short_logits": short_logits.contiguous()}, os.path.join(out, "reference.safetensors"))

    lg = logits[0].double().numpy()
    logp = lg - np.log(np.exp(lg - lg.max(-1, keepdims=True)).sum(-1, keepdims=True)) - lg.max(-1, keepdims=True)
    probs = np.exp(logp)
    tags = parse_labels(model.config.id2label)
    decoded = {}
    for name, b in (("default", BIASES), ("override", {**BIASES, **OVERRIDE})):
        path = viterbi(logp, tags, b)
        decoded[name] = dict(tags=[model.config.id2label[k] for k in path],
                             entities=spans(TEXT, path, probs, tags, byte_off))
    meta = dict(text=TEXT, short_text=SHORT_TEXT, input_ids=enc.ids, offsets=byte_off, seed=SEED, override=OVERRIDE,
                sliding_window=model.config.sliding_window, tokens=len(enc.ids),
                weights_dtype="bfloat16", reference_dtype="float32", attn_implementation="eager",
                torch=torch.__version__, transformers=T.__version__,
                clamp_fraction_per_layer=text_clamp, decoded=decoded)
    with open(os.path.join(out, "reference.json"), "w") as f:
        json.dump(meta, f, indent=1, ensure_ascii=False)
    for name, d in decoded.items():
        print(name, [(e["label"], e["text"], round(e["score"], 3)) for e in d["entities"]])
    print("tokens", len(enc.ids), "clamp fractions", [round(c, 3) for c in text_clamp])


if __name__ == "__main__":
    main()
