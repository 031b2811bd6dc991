#!/usr/bin/env python3
"""An independent numpy forward of a Llama checkpoint directory (f32 safetensors, plain rope):
the chat prompt "What is the capital of France?" through the checkpoint's own chat template
(transformers' tokenizer), its top-5 next-token logits and 10 greedy tokens (full recompute).

    pip install numpy safetensors transformers tokenizers jinja2
    python3 scripts/llama_numpy_reference.py HF_DIR [OUT.json]

With OUT.json, writes {"prompt_ids", "top5", "greedy_ids"}.
"""
import json, sys, numpy as np
from safetensors.numpy import load_file
from transformers import AutoTokenizer
d = sys.argv[1]
cfg = json.load(open(f"{d}/config.json"))
W = {k: v.astype(np.float32) for k, v in load_file(f"{d}/model.safetensors").items()}
tok = AutoTokenizer.from_pretrained(d)
text = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}], tokenize=False, add_generation_prompt=True)
ids = tok(text, add_special_tokens=False)["input_ids"]
print(len(ids), ids[:12])
H, nh, nkv, hd = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
def rms(x, w): return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w
def rope(x, pos):  # x [h, L, d], neox halves
    inv = 1.0 / theta ** (np.arange(0, hd, 2) / hd)
    ang = pos[:, None] * inv[None]
    cos, sin = np.cos(ang), np.sin(ang)
    x1, x2 = x[..., :hd // 2], x[..., hd // 2:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)
def forward(ids):
    L = len(ids); pos = np.arange(L, dtype=np.float64)
    x = W["model.embed_tokens.weight"][ids]
    mask = np.triu(np.full((L, L), -np.inf), 1)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms(x, W[p + "input_layernorm.weight"])
        q = (h @ W[p + "self_attn.q_proj.weight"].T).reshape(L, nh, hd).transpose(1, 0, 2)
        k = (h @ W[p + "self_attn.k_proj.weight"].T).reshape(L, nkv, hd).transpose(1, 0, 2)
        v = (h @ W[p + "self_attn.v_proj.weight"].T).reshape(L, nkv, hd).transpose(1, 0, 2)
        q, k = rope(q, pos), rope(k, pos)
        k = np.repeat(k, nh // nkv, 0); v = np.repeat(v, nh // nkv, 0)
        s = q @ k.transpose(0, 2, 1) / np.sqrt(hd) + mask
        s = np.exp(s - s.max(-1, keepdims=True)); s /= s.sum(-1, keepdims=True)
        a = (s @ v).transpose(1, 0, 2).reshape(L, nh * hd)
        x = x + a @ W[p + "self_attn.o_proj.weight"].T
        h = rms(x, W[p + "post_attention_layernorm.weight"])
        g = h @ W[p + "mlp.gate_proj.weight"].T; u = h @ W[p + "mlp.up_proj.weight"].T
        x = x + ((g / (1 + np.exp(-g))) * u) @ W[p + "mlp.down_proj.weight"].T
    x = rms(x, W["model.norm.weight"])
    head = W.get("lm_head.weight", W["model.embed_tokens.weight"])
    return x[-1] @ head.T
lg = forward(ids)
top = np.argsort(-lg)[:5]
print("top5", [(int(t), tok.decode([t]), round(float(lg[t]), 3)) for t in top])
p = np.exp((lg - lg.max()) / 0.2); p /= p.sum()
print("p at T=0.2", [(tok.decode([t]), round(float(p[t]), 3)) for t in top])
seq = list(ids)
for _ in range(10):
    seq.append(int(np.argmax(forward(seq))))
print("greedy", seq[len(ids):], repr(tok.decode(seq[len(ids):])))
if len(sys.argv) > 2:
    with open(sys.argv[2], "w") as f:
        json.dump({"prompt_ids": ids, "top5": [[int(t), float(lg[t])] for t in top], "greedy_ids": seq[len(ids):]}, f)
