#!/usr/bin/env python3
"""Qwen3.5 MTP-head fixtures: random MTP weights for the tiny dense and MoE Qwen3.5 checkpoints
and the head's logits from a torch re-implementation, for `tests/mtp.rs`.

The head follows vLLM's `qwen3_next_mtp.py` (`Qwen3NextMultiTokenPredictor.forward`): for target
position i, x = fc(cat[pre_fc_norm_embedding(embed(t_{i+1})), pre_fc_norm_hidden(h_i)]), one
full-attention decoder layer at rope position i (its own causal attention over the pairs so
far), then `norm` and the target's lm_head. h_i is the target's final-normed hidden state. Depth
d > 1 re-applies the head to its own normed output and the drafted token at the next position.
The layer, norms and rotary are transformers 5.17's Qwen3.5 classes (a full-attention
`Qwen3_5DecoderLayer` / `Qwen3_5MoeDecoderLayer`, `(1 + w)` RMSNorms); the target hidden states
come from transformers' `Qwen3_5ForCausalLM` on the committed tiny checkpoint.

Writes, per model, crates/speculative/tests/fixtures/mtp/<name>/:
  mtp-drafter/model.safetensors   the mtp.* tensors (the loader reads this sidecar directory)
  reference.safetensors           tokens, step-0 logits [L-1, V], chained tokens and logits
Run: python3 crates/speculative/scripts/make_mtp_fixture.py  (torch, transformers==5.17, safetensors)
"""
import os

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
TINY = os.path.join(ROOT, "crates/models/tests/fixtures/tiny")
OUT = os.path.join(ROOT, "crates/speculative/tests/fixtures/mtp")
TOKENS = [17, 230, 5, 99, 41, 17, 410, 88, 3, 230, 64, 301]
CHAIN = 4  # drafts after the first: depth 5 in all


class MtpHead(torch.nn.Module):
    """vLLM's Qwen3NextMultiTokenPredictor with one layer, in transformers 5.17 parts."""

    def __init__(self, cfg, moe):
        super().__init__()
        if moe:
            from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeDecoderLayer as Layer, Qwen3_5MoeRMSNorm as Norm
        else:
            from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer as Layer, Qwen3_5RMSNorm as Norm
        h = cfg.hidden_size
        full = cfg.layer_types.index("full_attention")
        self.fc = torch.nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = Norm(h, eps=cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = Norm(h, eps=cfg.rms_norm_eps)
        self.layers = torch.nn.ModuleList([Layer(cfg, full)])
        self.norm = Norm(h, eps=cfg.rms_norm_eps)

    def forward(self, embed, rotary, tokens, hidden):
        """tokens [1, n], hidden [1, n, H]: pairs at positions 0..n-1 -> normed output [1, n, H]."""
        e = self.pre_fc_norm_embedding(embed(tokens))
        x = self.fc(torch.cat([e, self.pre_fc_norm_hidden(hidden)], dim=-1))
        n = tokens.shape[1]
        pos = torch.arange(n)[None, :]
        cos_sin = rotary(x, pos[None].expand(3, 1, n))
        mask = torch.full((n, n), torch.finfo(torch.float32).min).triu(1)[None, None]
        x = self.layers[0](x, position_embeddings=cos_sin, attention_mask=mask, position_ids=pos)
        return self.norm(x)


def make(name, moe, seed):
    d = os.path.join(TINY, name)
    cfg = AutoConfig.from_pretrained(d)
    cfg._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_pretrained(d, config=cfg, dtype=torch.float32).eval()
    torch.manual_seed(seed)
    head = MtpHead(cfg, moe).float()
    with torch.no_grad():
        for n, p in head.named_parameters():
            # norms hold deltas (the module adds 1); everything else small normals
            p.copy_(torch.randn_like(p) * (0.1 if p.ndim == 1 else 0.08))
    state = {f"mtp.{k}": v.detach().contiguous() for k, v in head.state_dict().items()}
    out = os.path.join(OUT, name)
    os.makedirs(os.path.join(out, "mtp-drafter"), exist_ok=True)
    save_file(state, os.path.join(out, "mtp-drafter", "model.safetensors"))

    inner = model.model
    with torch.no_grad():
        ids = torch.tensor([TOKENS])
        hidden = inner(input_ids=ids).last_hidden_state  # final-normed
        # step 0 over every pair (h_i, t_{i+1}), i = 0 .. L-2
        toks = ids[:, 1:]
        hs = hidden[:, :-1]
        y = head(inner.embed_tokens, inner.rotary_emb, toks, hs)
        logits0 = model.lm_head(y)[0]
        chain_tokens, chain_logits = [], []
        last = logits0[-1]
        for _ in range(CHAIN):
            t = int(last.argmax())
            chain_tokens.append(t)
            toks = torch.cat([toks, torch.tensor([[t]])], dim=1)
            hs = torch.cat([hs, y[:, -1:]], dim=1)
            y = head(inner.embed_tokens, inner.rotary_emb, toks, hs)
            last = model.lm_head(y)[0, -1]
            chain_logits.append(last)
    save_file(
        {
            "tokens": ids[0].to(torch.int32),
            "hidden": hidden[0].contiguous(),
            "logits0": logits0.contiguous(),
            "chain_tokens": torch.tensor(chain_tokens, dtype=torch.int32),
            "chain_logits": torch.stack(chain_logits).contiguous(),
        },
        os.path.join(out, "reference.safetensors"),
    )
    print(name, {k: tuple(v.shape) for k, v in state.items() if "experts" in k or k.endswith("fc.weight")})


if __name__ == "__main__":
    make("qwen3_5", False, 1)
    make("qwen3_5_moe", True, 2)
