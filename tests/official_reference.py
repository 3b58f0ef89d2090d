"""The official SiameseNorm language-model code, transcribed for comparison.

A plain-PyTorch, float64 transcription of the computation in the official repository
(Qwen-Applications/SiameseNorm): ``OLMo_model_hybrid_pre.py`` for siamese_hybrid (its OLMo
sequential block with the per-block ``attn_norm`` / ``ffn_residual`` flags HybridNorm* sets on
block 0, and the ``ln_f`` / ``ln_y_f`` / ``ln_final_f`` merge), the DeiT/DiT ``Block`` for the
post_pre form (siamese), and OLMo's Pre-Norm block for pre. It keeps that code's own
structure and conventions, not ours: separate q/k/v slices of one fused projection in
[q | k | v] order, per-head Q/K/V norms applied before RoPE, OLMo's SwiGLU that reads its
projection as [up | gate], norms with or without bias as configured.

:func:`official_params` renames and re-lays-out a model's parameters into that code's names, so
the comparison is between the two computations, weight for weight.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def official_params(cfg, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our parameters under the official code's names (float64)."""
    p = {k: v.detach().cpu().double() for k, v in params.items()}
    nh, ng = cfg.num_attention_heads, cfg.kv_heads
    hd, per = cfg.hidden_size // nh, nh // ng
    out = {"wte": p["embedding.word_embeddings.weight"], "ff_out": p["output_layer.weight"]}
    norm_names = {  # ours -> official, per block
        "siamese": {"attn_norms.post": "post_norm1", "attn_norms.pre": "pre_norm1",
                    "attn_norms.inp": "input_norm1", "mlp_norms.post": "post_norm2",
                    "mlp_norms.pre": "pre_norm2", "mlp_norms.inp": "input_norm2"},
        "siamese_hybrid": {"attn_gate": "c1", "attn_x_norm": "attn_norm",
                           "attn_pre_norm": "attn_y_norm", "mlp_norms.post": "ff_norm",
                           "mlp_x_norm": "ff_norm", "mlp_norms.pre": "ff_y_norm",
                           "mlp_pre_norm": "ff_y_norm", "mlp_norms.inp": "ff_input_norm",
                           "mlp_in_norm": "ff_input_norm",
                           "self_attention.q_layernorm": "q_norm",
                           "self_attention.k_layernorm": "k_norm",
                           "self_attention.v_layernorm": "v_norm"},
        "pre": {"input_layernorm": "attn_norm", "pre_mlp_layernorm": "ff_norm"},
    }[cfg.residual_scheme]
    for i in range(cfg.num_layers):
        ours = f"decoder.layers.{i}."
        qkv = p[ours + "self_attention.linear_qkv.weight"].view(ng, (per + 2) * hd, -1)
        q = qkv[:, : per * hd].reshape(nh * hd, -1)
        k = qkv[:, per * hd: (per + 1) * hd].reshape(ng * hd, -1)
        v = qkv[:, (per + 1) * hd:].reshape(ng * hd, -1)
        gate, up = p[ours + "mlp.linear_fc1.weight"].chunk(2)
        block = {"att_proj": torch.cat([q, k, v]),
                 "attn_out": p[ours + "self_attention.linear_proj.weight"],
                 "ff_proj": torch.cat([up, gate]),
                 "ff_out": p[ours + "mlp.linear_fc2.weight"]}
        for name, value in p.items():
            for mine, theirs in norm_names.items():
                if name.startswith(ours + mine + "."):
                    block[theirs + name[len(ours + mine):]] = value
        out.update({f"blocks.{i}.{k}": v for k, v in block.items()})
    merge = "decoder.final_layernorm."
    for mine, theirs in (("x_norm", "ln_f"), ("y_norm", "ln_y_f"), ("final_norm", "ln_final_f")):
        out.update({theirs + n[len(merge + mine):]: v for n, v in p.items()
                    if n.startswith(merge + mine + ".")})
    if cfg.residual_scheme == "pre":
        out.update({"ln_f" + n[len("decoder.final_layernorm"):]: v for n, v in p.items()
                    if n.startswith("decoder.final_layernorm.")})
    return out


class OfficialModel:
    """Forward of the official code over ``official_params``; ``first_block`` is HybridNorm*'s
    flag for block 0: None, or {'attn_norm': True, 'ffn_residual': False}."""

    def __init__(self, cfg, params: dict[str, torch.Tensor], first_block: dict | None = None):
        self.cfg, self.p = cfg, params
        self.flags = {i: {"attn_norm": False, "ffn_residual": True}
                      for i in range(cfg.num_layers)}
        if first_block:
            self.flags[0].update(first_block)

    def norm(self, name: str, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.p[name + ".weight"], self.p.get(name + ".bias")
        if self.cfg.normalization == "rmsnorm":
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg.norm_eps) * weight
        return F.layer_norm(x, (x.shape[-1],), weight, bias, self.cfg.norm_eps)

    def rotary(self, t: torch.Tensor) -> torch.Tensor:  # [B, heads, T, hs]
        hs, T = t.shape[-1], t.shape[-2]
        inv_freq = 1.0 / (self.cfg.rotary_base ** (torch.arange(0, hs, 2).double() / hs))
        freqs = torch.outer(torch.arange(T).double(), inv_freq)
        pos = torch.cat((freqs, freqs), dim=-1)
        x1, x2 = t.chunk(2, dim=-1)
        return t * pos.cos() + torch.cat((-x2, x1), dim=-1) * pos.sin()

    def attention(self, b: str, h: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        B, T, C = h.shape
        nh, nkv = cfg.num_attention_heads, cfg.kv_heads
        hs = C // nh
        q, k, v = (h @ self.p[b + "att_proj"].T).split((C, nkv * hs, nkv * hs), dim=-1)
        q = q.view(B, T, nh, hs).transpose(1, 2)
        k = k.view(B, T, nkv, hs).transpose(1, 2)
        v = v.view(B, T, nkv, hs).transpose(1, 2)
        if b + "q_norm.weight" in self.p:
            q, k, v = (self.norm(b + n, t) for n, t in (("q_norm", q), ("k_norm", k),
                                                        ("v_norm", v)))
        q, k = self.rotary(q), self.rotary(k)
        k, v = (t.repeat_interleave(nh // nkv, dim=1) for t in (k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return att.transpose(1, 2).reshape(B, T, C) @ self.p[b + "attn_out"].T

    def ff(self, b: str, h: torch.Tensor) -> torch.Tensor:
        x, gate = (h @ self.p[b + "ff_proj"].T).chunk(2, dim=-1)  # OLMo's SwiGLU
        return (F.silu(gate) * x) @ self.p[b + "ff_out"].T

    def depth_constant(self, i: int) -> float:
        return math.sqrt((i + 1) * 2) if self.cfg.siamese_depth_constant else 1.0

    def hybrid_pre_block(self, i: int, x, y):
        """OLMoSequentialBlock.forward of OLMo_model_hybrid_pre.py."""
        b, flags = f"blocks.{i}.", self.flags[i]
        normed_y = self.norm(b + "attn_y_norm", y)
        if flags["attn_norm"]:
            h = self.norm(b + "attn_norm", x) + normed_y
        else:
            h = x * self.p[b + "c1.weight"] + normed_y
        res = self.attention(b, h)
        c = self.depth_constant(i)
        x, y = x + res / c, y + res
        if not flags["ffn_residual"]:
            og_x = x
        x = self.norm(b + "ff_norm", x)
        if flags["ffn_residual"]:
            og_x = x
        ff_in = x + self.norm(b + "ff_y_norm", y)
        if b + "ff_input_norm.weight" in self.p:
            ff_in = self.norm(b + "ff_input_norm", ff_in)
        r = self.ff(b, ff_in)
        return og_x + r / c, y + r

    def post_pre_block(self, i: int, x, y):
        """The DeiT/DiT ``Block.forward(x, y)``, with this model's attention and MLP."""
        b, c = f"blocks.{i}.", self.depth_constant(i)
        for k, branch in (("1", self.attention), ("2", self.ff)):
            x = self.norm(b + "post_norm" + k, x)
            z = branch(b, self.norm(b + "input_norm" + k, x + self.norm(b + "pre_norm" + k, y)))
            x, y = x + z / c, y + z
        return x, y

    def pre_block(self, i: int, x):
        b = f"blocks.{i}."
        x = x + self.attention(b, self.norm(b + "attn_norm", x))
        return x + self.ff(b, self.norm(b + "ff_norm", x))

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.p["wte"][tokens]
        scheme = self.cfg.residual_scheme
        if scheme == "pre":
            for i in range(self.cfg.num_layers):
                x = self.pre_block(i, x)
            return self.norm("ln_f", x) @ self.p["ff_out"].T
        y = x
        block = self.hybrid_pre_block if scheme == "siamese_hybrid" else self.post_pre_block
        for i in range(self.cfg.num_layers):
            x, y = block(i, x, y)
        x = self.norm("ln_final_f", self.norm("ln_f", x) + self.norm("ln_y_f", y))
        return x @ self.p["ff_out"].T
