"""SiameseNorm-family causal language models for ``transformers`` (remote code).

Written from the equations of each residual scheme, with the parameter names of the training
framework's checkpoints (megatron's module tree: ``model.decoder.layers.<l>.self_attention
.linear_qkv.weight``, ...), so an export is a renaming of tensors and never a re-derivation.
Every scheme keeps its residual streams in a small state and shares one attention and one MLP:

- single stream (pre, post, deepnorm, hybridnorm, mixln, periln, olmo2): h
- SiameseNorm (siamese, siamese_hybrid): (x, y), both starting as the embedding; c_l =
  sqrt(2 (l + 1)) scales the x update of block l; merged at the end as Nfinal(Na(x) + Nb(y))
- hyper-connections (hc) and manifold-constrained ones (mhc): n streams [b, s, n, h], summed
  at the end, then a norm

With experts (``num_experts`` > 0) the MLP of each MoE block is megatron's MoE layer at
inference: its router (top-k of the fp32 logits, weights by the score function), the chosen
experts' SwiGLU (or GELU) MLPs scaled by their weights, and the shared expert; no token is ever
dropped (a model with a capacity factor is not exported), so every token's output is its own.

Conventions that matter for equality with the training framework: Q, K and V come from one
projection laid out per K/V group (that group's query heads, its key head, its value head);
per-head Q/K/V norms (siamese_hybrid, hybridnorm; Q/K only for olmo2) act before RoPE; RoPE
rotates halves; the SwiGLU projection holds [gate | up]; norms compute in fp32; the modules of
``FP32_MODULES`` (SiameseNorm's channel gate, mHC's mappings) and ``EXPERT_FP32_MODULES`` (the
router) keep fp32 weights. The KV cache
holds keys and values only: every other quantity is per token, so cached generation computes
exactly what a full forward does.
"""

import dataclasses
import inspect
import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_siamesenorm import (
    EXPERT_FP32_MODULES,
    FINAL_NORMS,
    FP32_MODULES,
    SiameseNormConfig,
)

# DynamicCache takes the model config (for per-layer cache types) since transformers 5.0
CACHE_TAKES_CONFIG = "config" in inspect.signature(DynamicCache.__init__).parameters

# The output's cache field: ``past_key_values`` until transformers 5.24 renamed it ``cache``
# (the old name still works there, with a deprecation warning at every load).
CACHE_FIELD = "cache" if "cache" in {f.name for f in dataclasses.fields(
    CausalLMOutputWithPast)} else "past_key_values"

# Arguments transformers may pass that leave the logits as they are: ``cache_position``
# restates the cache length, which the cache itself knows; the others are switched off.
IGNORED = {"cache_position"}
OFF_ONLY = {"output_attentions", "output_hidden_states"}


def refuse_unsupported(options: dict):
    """TypeError for an argument this model would otherwise ignore while it matters."""
    for name, value in options.items():
        if name in IGNORED or value is None or (name in OFF_ONLY and not value):
            continue
        raise TypeError(f"SiameseNormForCausalLM.forward does not support {name}={value!r}")


class Norm(nn.Module):
    """A norm over the last dim, computed in fp32: RMSNorm, LayerNorm (with a bias when
    ``norm_bias``), or DyT, ``weight * tanh(alpha x) + bias`` with one learned scalar alpha
    ("Transformers without Normalization", Zhu et al., 2025)."""

    def __init__(self, config, size: int):
        super().__init__()
        self.kind = config.normalization
        self.eps = config.norm_eps
        self.weight = nn.Parameter(torch.ones(size))
        self.alpha = nn.Parameter(torch.tensor(0.5)) if self.kind == "dyt" else None
        with_bias = self.kind == "dyt" or (config.norm_bias and self.kind == "layernorm")
        self.bias = nn.Parameter(torch.zeros(size)) if with_bias else None

    def forward(self, x):
        shape = (x.shape[-1],)
        if self.kind == "dyt":
            out = torch.tanh(self.alpha.float() * x.float()) * self.weight.float() \
                + self.bias.float()
        elif self.kind == "rmsnorm":
            out = F.rms_norm(x.float(), shape, self.weight.float(), self.eps)
        else:
            bias = None if self.bias is None else self.bias.float()
            out = F.layer_norm(x.float(), shape, self.weight.float(), bias, self.eps)
        return out.to(x.dtype)


class Context:
    """What every attention of one forward shares: RoPE's cos/sin, the mask, the cache."""

    def __init__(self, rope, mask, causal: bool, cache):
        self.rope, self.mask, self.causal, self.cache = rope, mask, causal, cache


def rope_tables(config, positions, dtype):
    """(cos, sin) of shape [b, 1, s, head_dim] for rotate-half RoPE."""
    dim = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, device=positions.device,
                                                      dtype=torch.float32) / dim))
    freqs = positions.float()[..., None] * inv
    angles = torch.cat((freqs, freqs), dim=-1)[:, None]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate(t, rope):
    cos, sin = rope
    first, second = t.chunk(2, dim=-1)
    return t * cos + torch.cat((-second, first), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, config, layer_idx: int, qkv_norm: bool, qk_norm: bool = False):
        super().__init__()
        self.layer_idx = layer_idx
        self.heads, self.groups = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.per_group = self.heads // self.groups
        bias = config.add_bias_linear
        self.linear_qkv = nn.Linear(config.hidden_size,
                                    self.groups * (self.per_group + 2) * self.head_dim, bias=bias)
        self.linear_proj = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=bias)
        self.qk_norm, self.qkv_norm = qk_norm or qkv_norm, qkv_norm
        if self.qk_norm:
            self.q_layernorm = Norm(config, self.head_dim)
            self.k_layernorm = Norm(config, self.head_dim)
        if qkv_norm:
            self.v_layernorm = Norm(config, self.head_dim)

    def forward(self, hidden, ctx: Context):
        b, s, _ = hidden.shape
        qkv = self.linear_qkv(hidden).view(b, s, self.groups, self.per_group + 2, self.head_dim)
        q = qkv[..., :self.per_group, :].reshape(b, s, self.heads, self.head_dim)
        k, v = qkv[..., self.per_group, :], qkv[..., self.per_group + 1, :]
        if self.qk_norm:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        if self.qkv_norm:
            v = self.v_layernorm(v)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if ctx.rope is not None:
            q, k = rotate(q, ctx.rope), rotate(k, ctx.rope)
        if ctx.cache is not None:
            k, v = ctx.cache.update(k, v, self.layer_idx)
        k = k.repeat_interleave(self.per_group, dim=1)  # query head i reads K/V group i // p
        v = v.repeat_interleave(self.per_group, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=ctx.mask, is_causal=ctx.causal)
        return self.linear_proj(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    """fc2(act(fc1(x))) of ``width`` (default ``intermediate_size``). As a routed expert it
    takes each token's router weight p, which scales the activation before fc2 and fc2's bias
    (megatron's experts: fc2(p act) + p b2)."""

    def __init__(self, config, width: int | None = None, bias: bool | None = None):
        super().__init__()
        width = width or config.intermediate_size
        bias = config.add_bias_linear if bias is None else bias
        self.swiglu = config.activation == "swiglu"
        self.linear_fc1 = nn.Linear(config.hidden_size, width * (2 if self.swiglu else 1),
                                    bias=bias)
        self.linear_fc2 = nn.Linear(width, config.hidden_size, bias=bias)

    def forward(self, x, probs=None):
        a = self.linear_fc1(x)
        if self.swiglu:
            gate, up = a.chunk(2, dim=-1)
            a = F.silu(gate) * up
        else:
            a = F.gelu(a)
        if probs is None:
            return self.linear_fc2(a)
        p = probs.unsqueeze(-1)
        out = F.linear((a * p).to(a.dtype), self.linear_fc2.weight)
        if self.linear_fc2.bias is not None:
            out = (out + self.linear_fc2.bias * p).to(out.dtype)
        return out


def moe_blocks(config) -> list:
    """Per block, whether its MLP is an MoE layer (megatron's ``moe_layer_freq``: every k-th
    block from block 0, or a 0/1 list); all False without experts."""
    freq, layers = config.moe_layer_freq, config.num_hidden_layers
    if not config.num_experts:
        return [False] * layers
    if isinstance(freq, list):
        return [bool(f) for f in freq]
    return [index % freq == 0 for index in range(layers)]


class Router(nn.Module):
    """megatron's top-k router (``TopKRouter`` with ``moe_router_dtype`` fp32), as it routes at
    inference: logits = x W^T (+ b) in fp32, then

    - softmax: the k largest logits, then the softmax over those k; with
      ``moe_router_pre_softmax``, the softmax over every expert's logit, then the k largest of
      those probabilities, unnormalised (the only softmax routing at k = 1);
    - sigmoid: scores sigmoid(logits); the k largest of scores + ``expert_bias`` (the
      auxiliary-loss-free balance's bias chooses but never weighs), weighted by their scores
      over the sum of the k (the score alone when k = 1).

    Returns (weights [t, k] fp32, experts [t, k])."""

    def __init__(self, config):
        super().__init__()
        experts = config.num_experts
        self.topk, self.score = config.moe_router_topk, config.moe_router_score_function
        self.pre_softmax = config.moe_router_pre_softmax
        self.weight = nn.Parameter(torch.zeros(experts, config.hidden_size))
        self.bias = nn.Parameter(torch.zeros(experts)) if config.add_bias_linear else None
        if config.moe_router_enable_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(experts))
        else:
            self.expert_bias = None

    def forward(self, x):
        bias = None if self.bias is None else self.bias.float()
        logits = F.linear(x.float(), self.weight.float(), bias)
        if self.score == "softmax" and self.pre_softmax:
            weights, chosen = torch.softmax(logits, dim=-1).topk(self.topk, dim=-1)
            return weights, chosen
        if self.score == "softmax":
            top, chosen = logits.topk(self.topk, dim=-1)
            return torch.softmax(top, dim=-1), chosen
        scores = torch.sigmoid(logits)
        ranked = scores if self.expert_bias is None else scores + self.expert_bias.float()
        chosen = ranked.topk(self.topk, dim=-1).indices
        weights = scores.gather(-1, chosen)
        if self.topk > 1:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights, chosen


class Experts(nn.Module):
    """The routed experts, by their number in the model (``local_experts.<e>``)."""

    def __init__(self, config):
        super().__init__()
        self.local_experts = nn.ModuleList(MLP(config, config.moe_ffn_hidden_size)
                                           for _ in range(config.num_experts))


class SharedExpert(MLP):
    """The MLP every token passes through beside its routed experts (no biases, as megatron's),
    scaled by sigmoid(x g^T) when it has megatron's gate."""

    def __init__(self, config):
        super().__init__(config, config.moe_shared_expert_intermediate_size, bias=False)
        self.gate_weight = (nn.Parameter(torch.zeros(1, config.hidden_size))
                            if config.moe_shared_expert_gate else None)

    def forward(self, x):
        out = super().forward(x)
        if self.gate_weight is not None:
            out = out * torch.sigmoid(F.linear(x, self.gate_weight))
        return out


class MoE(nn.Module):
    """megatron's MoE layer as F: each token's k routed experts, weighted, summed, plus the
    shared expert's output."""

    def __init__(self, config):
        super().__init__()
        self.router = Router(config)
        self.experts = Experts(config)
        if config.moe_shared_expert_intermediate_size:
            self.shared_experts = SharedExpert(config)

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        weights, chosen = self.router(flat)
        out = torch.zeros_like(flat)
        for index, expert in enumerate(self.experts.local_experts):
            token, slot = (chosen == index).nonzero(as_tuple=True)
            if token.numel():
                out.index_add_(0, token, expert(flat[token], weights[token, slot]))
        if hasattr(self, "shared_experts"):
            out = out + self.shared_experts(flat)
        return out.view(x.shape)


class Block(nn.Module):
    """One attention and one MLP; subclasses say how the residual streams use them."""

    def __init__(self, config, layer_idx: int, qkv_norm: bool = False, qk_norm: bool = False):
        super().__init__()
        self.self_attention = Attention(config, layer_idx, qkv_norm, qk_norm)
        self.mlp = MoE(config) if moe_blocks(config)[layer_idx] else MLP(config)


class PreNormBlock(Block):
    """h = h + Attn(N(h)); h = h + MLP(N(h))."""

    def __init__(self, config, layer_idx, qkv_norm=False):
        super().__init__(config, layer_idx, qkv_norm)
        self.input_layernorm = Norm(config, config.hidden_size)
        self.pre_mlp_layernorm = Norm(config, config.hidden_size)

    def forward(self, h, ctx):
        h = h + self.self_attention(self.input_layernorm(h), ctx)
        return h + self.mlp(self.pre_mlp_layernorm(h))


class PostNormBlock(Block):
    """h = N(alpha h + Attn(h)); h = N(alpha h + MLP(h)); alpha = 1 but for DeepNorm."""

    def __init__(self, config, layer_idx, alpha: float = 1.0):
        super().__init__(config, layer_idx)
        self.alpha = alpha
        self.attn_post_norm = Norm(config, config.hidden_size)
        self.mlp_post_norm = Norm(config, config.hidden_size)

    def forward(self, h, ctx):
        h = self.attn_post_norm(self.alpha * h + self.self_attention(h, ctx))
        return self.mlp_post_norm(self.alpha * h + self.mlp(h))


class HybridNormBlock(Block):
    """h = h + Attn(h) (Q/K/V norms); u = N(h); h = u + MLP(u)."""

    def __init__(self, config, layer_idx):
        super().__init__(config, layer_idx, qkv_norm=True)
        self.mlp_post_norm = Norm(config, config.hidden_size)

    def forward(self, h, ctx):
        h = h + self.self_attention(h, ctx)
        u = self.mlp_post_norm(h)
        return u + self.mlp(u)


class PeriLNBlock(Block):
    """Peri-LN: h = h + Nout(Attn(Nin(h))); h = h + Nout'(MLP(Nin'(h)))."""

    def __init__(self, config, layer_idx):
        super().__init__(config, layer_idx)
        for name in ("attn_in_norm", "attn_out_norm", "mlp_in_norm", "mlp_out_norm"):
            setattr(self, name, Norm(config, config.hidden_size))

    def forward(self, h, ctx):
        h = h + self.attn_out_norm(self.self_attention(self.attn_in_norm(h), ctx))
        return h + self.mlp_out_norm(self.mlp(self.mlp_in_norm(h)))


class OLMo2Block(Block):
    """OLMo 2: h = h + N(Attn(h)) (Q/K norms); h = h + N'(MLP(h))."""

    def __init__(self, config, layer_idx):
        super().__init__(config, layer_idx, qk_norm=True)
        self.attn_out_norm = Norm(config, config.hidden_size)
        self.mlp_out_norm = Norm(config, config.hidden_size)

    def forward(self, h, ctx):
        h = h + self.attn_out_norm(self.self_attention(h, ctx))
        return h + self.mlp_out_norm(self.mlp(h))


def depth_constant(config, layer_idx: int) -> float:
    """c_l = sqrt(2 (l + 1)), or 1 without SiameseNorm's depth constant."""
    return math.sqrt(2.0 * (layer_idx + 1)) if config.siamese_depth_constant else 1.0


def optional_norm(config, present: bool):
    return Norm(config, config.hidden_size) if present else nn.Identity()


class SiameseBlock(Block):
    """post_pre: per sublayer u = Npost(x); r = F(Nin(u + Npre(y))); x = u + r / c; y += r."""

    def __init__(self, config, layer_idx):
        super().__init__(config, layer_idx)
        self.c = depth_constant(config, layer_idx)
        for sub in ("attn", "mlp"):
            setattr(self, f"{sub}_post_norm", Norm(config, config.hidden_size))
            setattr(self, f"{sub}_pre_norm", Norm(config, config.hidden_size))
            setattr(self, f"{sub}_in_norm", optional_norm(config, config.siamese_input_norm))

    def forward(self, streams, ctx):
        x, y = streams
        for sub, branch in (("attn", lambda a: self.self_attention(a, ctx)), ("mlp", self.mlp)):
            u = getattr(self, f"{sub}_post_norm")(x)
            r = branch(getattr(self, f"{sub}_in_norm")(u + getattr(self, f"{sub}_pre_norm")(y)))
            x, y = u + r / self.c, y + r
        return x, y


class ChannelGate(nn.Module):
    """g, a per-channel scale kept in fp32 (``_keep_in_fp32_modules_strict``)."""

    def __init__(self, size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=torch.float32))

    def forward(self, x):
        return (x.float() * self.weight.float()).to(x.dtype)


class SiameseHybridBlock(Block):
    """hybrid_pre: attention reads x g + Npre(y) (Q/K/V norms), x += r / c, y += r; the MLP
    as post_pre's (x replaced by Npost(x))."""

    def __init__(self, config, layer_idx):
        super().__init__(config, layer_idx, qkv_norm=True)
        self.c = depth_constant(config, layer_idx)
        self.attn_gate = ChannelGate(config.hidden_size)
        self.attn_pre_norm = Norm(config, config.hidden_size)
        self.mlp_post_norm = Norm(config, config.hidden_size)
        self.mlp_pre_norm = Norm(config, config.hidden_size)
        self.mlp_in_norm = optional_norm(config, config.siamese_input_norm)

    def forward(self, streams, ctx):
        x, y = streams
        r = self.self_attention(self.attn_gate(x) + self.attn_pre_norm(y), ctx)
        x, y = x + r / self.c, y + r
        u = self.mlp_post_norm(x)
        r = self.mlp(self.mlp_in_norm(u + self.mlp_pre_norm(y)))
        return u + r / self.c, y + r


class HybridNormStarFirstBlock(Block):
    """siamese_hybrid's block 0 under HybridNorm*: Attn(Nx(x) + Npre(y)); then
    MLP(Nin(Nx'(x) + Npre'(y))) (no Nx' for ``prenorm_literal``); x never replaced."""

    def __init__(self, config, layer_idx):
        super().__init__(config, layer_idx, qkv_norm=True)
        self.c = depth_constant(config, layer_idx)
        self.attn_x_norm = Norm(config, config.hidden_size)
        self.attn_pre_norm = Norm(config, config.hidden_size)
        self.mlp_x_norm = optional_norm(config, config.hybrid_first_block == "prenorm")
        self.mlp_pre_norm = Norm(config, config.hidden_size)
        self.mlp_in_norm = optional_norm(config, config.siamese_input_norm)

    def forward(self, streams, ctx):
        x, y = streams
        r = self.self_attention(self.attn_x_norm(x) + self.attn_pre_norm(y), ctx)
        x, y = x + r / self.c, y + r
        r = self.mlp(self.mlp_in_norm(self.mlp_x_norm(x) + self.mlp_pre_norm(y)))
        return x + r / self.c, y + r


class HyperConnection(nn.Module):
    """One sublayer's connection weights: width Am [n], depth Ar [n, n], output B [n], and for
    the dynamic form per-token offsets s tanh(Nhc(H) proj^T)."""

    def __init__(self, config):
        super().__init__()
        n, hidden = config.hc_rate, config.hidden_size
        self.rate, self.dynamic = n, config.hc_dynamic
        self.width = nn.Parameter(torch.zeros(n))
        self.depth = nn.Parameter(torch.eye(n))
        self.output = nn.Parameter(torch.ones(n))
        if self.dynamic:
            self.norm = Norm(config, hidden)
            self.proj = nn.Parameter(torch.zeros(n + 2, hidden))
            self.width_scale = nn.Parameter(torch.zeros(()))
            self.output_scale = nn.Parameter(torch.zeros(()))

    def forward(self, H, norm, branch):
        """H_k = sum_i Ar_ik H_i + B_k F(N(sum_i Am_i H_i)) for streams H [b, s, n, h]."""
        width, depth, output = self.width, self.depth, self.output
        if self.dynamic:
            n = self.rate
            offsets = torch.tanh(self.norm(H) @ self.proj.t())
            width = width + self.width_scale * offsets[..., 0]
            depth = depth + self.width_scale * offsets[..., 1:n + 1]
            output = output + self.output_scale * offsets[..., n + 1]
        r = branch(norm((width.unsqueeze(-1) * H).sum(-2)))
        mixed = torch.einsum("...ik,...ih->...kh", depth.expand(*H.shape[:-2], -1, -1), H)
        return mixed + output.unsqueeze(-1) * r.unsqueeze(-2)


class HyperConnectionBlock(Block):
    def __init__(self, config, layer_idx):
        super().__init__(config, layer_idx)
        self.attn_norm = Norm(config, config.hidden_size)
        self.mlp_norm = Norm(config, config.hidden_size)
        self.attn_hc = HyperConnection(config)
        self.mlp_hc = HyperConnection(config)

    def forward(self, H, ctx):
        H = self.attn_hc(H, self.attn_norm, lambda a: self.self_attention(a, ctx))
        return self.mlp_hc(H, self.mlp_norm, self.mlp)


class ManifoldConnection(nn.Module):
    """One sublayer's mHC mappings: phi [n^2 + 2n, n h] (rows: pre, post, then H_res row by
    row), the static part b and the gates (a_pre, a_post, a_res). Per token, from the
    flattened streams normalised by their RMS: H_pre = sigmoid, H_post = 2 sigmoid, H_res =
    Sinkhorn-Knopp from exp (rows then columns, ``mhc_sinkhorn_iterations`` times each)."""

    def __init__(self, config):
        super().__init__()
        n = config.hc_rate
        self.rate, self.iterations, self.eps = n, config.mhc_sinkhorn_iterations, config.norm_eps
        self.phi = nn.Parameter(torch.zeros(n * n + 2 * n, n * config.hidden_size))
        self.static = nn.Parameter(torch.zeros(n * n + 2 * n))
        self.gates = nn.Parameter(torch.full((3,), 0.01))

    def forward(self, H, norm, branch):
        """H_k = sum_i H_res_ki H_i + H_post_k F(N(sum_i H_pre_i H_i)), streams H [b, s, n, h]."""
        n = self.rate
        flat = H.flatten(-2).float()
        x = flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + self.eps)
        mapped = x @ self.phi.float().t()
        gate, b = self.gates.float(), self.static.float()
        pre = torch.sigmoid(gate[0] * mapped[..., :n] + b[:n])
        post = 2 * torch.sigmoid(gate[1] * mapped[..., n:2 * n] + b[n:2 * n])
        res = (gate[2] * mapped[..., 2 * n:] + b[2 * n:]).unflatten(-1, (n, n)).exp()
        for _ in range(self.iterations):
            res = res / res.sum(-1, keepdim=True)
            res = res / res.sum(-2, keepdim=True)
        pre, post, res = pre.to(H.dtype), post.to(H.dtype), res.to(H.dtype)
        r = branch(norm((pre.unsqueeze(-1) * H).sum(-2)))
        return res @ H + post.unsqueeze(-1) * r.unsqueeze(-2)


class ManifoldConnectionBlock(Block):
    def __init__(self, config, layer_idx):
        super().__init__(config, layer_idx)
        self.attn_norm = Norm(config, config.hidden_size)
        self.mlp_norm = Norm(config, config.hidden_size)
        self.attn_mhc = ManifoldConnection(config)
        self.mlp_mhc = ManifoldConnection(config)

    def forward(self, H, ctx):
        H = self.attn_mhc(H, self.attn_norm, lambda a: self.self_attention(a, ctx))
        return self.mlp_mhc(H, self.mlp_norm, self.mlp)


def post_norm_blocks(config) -> int:
    """Mix-LN's P = floor(ratio L) Post-Norm blocks (rounded as the trainer rounds)."""
    return math.floor(round(config.mixln_post_ratio * config.num_hidden_layers, 9))


def build_block(config, index: int) -> nn.Module:
    scheme, first = config.residual_scheme, config.hybrid_first_block
    if scheme == "pre" or (scheme == "mixln" and index >= post_norm_blocks(config)):
        return PreNormBlock(config, index)
    if scheme in ("post", "mixln"):
        return PostNormBlock(config, index)
    if scheme == "deepnorm":
        return PostNormBlock(config, index, alpha=(2.0 * config.num_hidden_layers) ** 0.25)
    if scheme == "hybridnorm":
        if index == 0 and first == "prenorm":
            return PreNormBlock(config, index, qkv_norm=True)
        return HybridNormBlock(config, index)
    if scheme == "siamese":
        return SiameseBlock(config, index)
    if scheme == "siamese_hybrid":
        if index == 0 and first != "hybrid":
            return HybridNormStarFirstBlock(config, index)
        return SiameseHybridBlock(config, index)
    if scheme == "hc":
        return HyperConnectionBlock(config, index)
    if scheme == "periln":
        return PeriLNBlock(config, index)
    if scheme == "olmo2":
        return OLMo2Block(config, index)
    if scheme == "mhc":
        return ManifoldConnectionBlock(config, index)
    raise ValueError(f"residual_scheme ({scheme!r}) has no block in this remote code")


class MergeNorm(nn.Module):
    """SiameseNorm's end: Nfinal(Na(x) + Nb(y))."""

    def __init__(self, config):
        super().__init__()
        self.x_norm = Norm(config, config.hidden_size)
        self.y_norm = Norm(config, config.hidden_size)
        self.final_norm = Norm(config, config.hidden_size)

    def forward(self, streams):
        x, y = streams
        return self.final_norm(self.x_norm(x) + self.y_norm(y))


class StreamSumNorm(nn.Module):
    """Hyper-connections' end (hc and mhc): the sum of the streams, then a norm."""

    def __init__(self, config):
        super().__init__()
        self.final_norm = Norm(config, config.hidden_size)

    def forward(self, H):
        return self.final_norm(H.sum(-2))


OWN_ENDS = {"hc": StreamSumNorm, "mhc": StreamSumNorm}
"""The decoder ends of the schemes whose end is their own (``FINAL_NORMS`` "scheme")."""


def build_final(config) -> nn.Module:
    """The decoder's end by its kind, ``FINAL_NORMS`` (generated from the registry)."""
    scheme = config.residual_scheme
    kind = FINAL_NORMS.get(scheme)
    if kind == "none":
        return nn.Identity()  # every block already ends in a norm
    if kind == "merge":
        return MergeNorm(config)
    if kind == "norm":
        return Norm(config, config.hidden_size)
    if kind == "scheme" and scheme in OWN_ENDS:
        return OWN_ENDS[scheme](config)
    raise ValueError(f"residual_scheme ({scheme!r}) has no decoder end in this remote code")


class Embedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        if config.position_embedding == "learned_absolute":
            self.position_embeddings = nn.Embedding(config.max_position_embeddings,
                                                    config.hidden_size)

    def forward(self, input_ids, positions, inputs_embeds=None):
        h = self.word_embeddings(input_ids) if inputs_embeds is None else inputs_embeds
        if hasattr(self, "position_embeddings"):
            h = h + self.position_embeddings(positions)
        return h


class Decoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList(build_block(config, i)
                                    for i in range(config.num_hidden_layers))
        self.final_layernorm = build_final(config)


def causal_mask(padding, queries: int, past: int, device):
    """(mask, causal) for SDPA: None and is_causal when nothing is cached or padded, else a
    boolean [b or 1, 1, q, past + q] mask. A fully padded query row still sees itself, so its
    (discarded) output stays finite instead of NaN."""
    if padding is None and past == 0:
        return None, queries > 1
    keys = past + queries
    rows = torch.arange(queries, device=device)[:, None] + past
    mask = torch.arange(keys, device=device)[None, :] <= rows
    if padding is not None:
        mask = mask[None] & padding[:, None, -keys:].bool()
        mask = mask | (torch.arange(keys, device=device)[None, None, :] == rows[None])
        return mask[:, None], False
    return mask[None, None], False


class SiameseNormPreTrainedModel(PreTrainedModel):
    config_class = SiameseNormConfig
    base_model_prefix = "model"
    _no_split_modules = ["Block"]
    _supports_cache_class = True

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        # The scheme's fp32 modules (SiameseNorm's channel gate, mHC's mappings) and the MoE
        # router keep fp32 weights when the model loads in bf16 or fp16 ("strict": bf16 too).
        # Named only where the model has them: transformers 4.x refuses a name that is not
        # among the model's modules.
        kept = [*FP32_MODULES.get(config.residual_scheme, ()),
                *(EXPERT_FP32_MODULES if config.num_experts else ())]
        if kept:
            self._keep_in_fp32_modules_strict = kept

    def _init_weights(self, module):
        """Only for weights a checkpoint lacks: normal(0, initializer_range) matrices; norms,
        gates and hyper-connection weights keep the values their constructors set."""
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, 0.0, std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, 0.0, std)


class SiameseNormModel(SiameseNormPreTrainedModel):
    def __init__(self, config: SiameseNormConfig):
        super().__init__(config)
        self.embedding = Embedding(config)
        self.decoder = Decoder(config)
        self.post_init()

    def get_input_embeddings(self):
        return self.embedding.word_embeddings

    def set_input_embeddings(self, value):
        self.embedding.word_embeddings = value

    def start(self, h):
        """The residual state every scheme's blocks carry, from the embedding."""
        scheme = self.config.residual_scheme
        if scheme in ("siamese", "siamese_hybrid"):
            return h, h
        if scheme in ("hc", "mhc"):
            return h.unsqueeze(-2).expand(*h.shape[:-1], self.config.hc_rate, h.shape[-1])
        return h

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None,
                use_cache=False, inputs_embeds=None):
        """(final hidden states, cache). ``attention_mask`` is the 2-D padding mask over the
        cached and the new tokens; ``position_ids`` default to the cache length onwards."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        if attention_mask is not None and attention_mask.dim() != 2:
            raise ValueError("attention_mask must be the 2-D padding mask [batch, cached + new "
                             f"tokens], not a {attention_mask.dim()}-D one (a static cache's)")
        given = input_ids if input_ids is not None else inputs_embeds
        (b, s), device = given.shape[:2], given.device
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config) if CACHE_TAKES_CONFIG else DynamicCache()
        past = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past, past + s, device=device).expand(b, -1)
        h = self.embedding(input_ids, position_ids, inputs_embeds)
        rope = (rope_tables(self.config, position_ids, h.dtype)
                if self.config.position_embedding == "rope" else None)
        mask, causal = causal_mask(attention_mask, s, past, device)
        ctx = Context(rope, mask, causal, cache)
        state = self.start(h)
        for block in self.decoder.layers:
            state = block(state, ctx)
        return self.decoder.final_layernorm(state), cache


class SiameseNormForCausalLM(SiameseNormPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embedding.word_embeddings.weight"}

    def __init__(self, config: SiameseNormConfig):
        super().__init__(config)
        self.model = SiameseNormModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.get_input_embeddings()

    def set_input_embeddings(self, value):
        self.model.set_input_embeddings(value)

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None,
                inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0,
                return_dict=None, past_key_values=None, **options):
        """Logits (and the next-token loss with ``labels``). The cache comes as ``cache``
        (transformers >= 5.24) or ``past_key_values`` (earlier releases); any other argument
        that would change the result is refused, never dropped: a silently ignored cache
        decodes every step from an empty one."""
        refuse_unsupported(options)
        if cache is None:
            cache = past_key_values
        hidden, cache = self.model(input_ids, attention_mask, position_ids, cache,
                                   bool(use_cache), inputs_embeds)
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(),
                                   labels[:, 1:].flatten(), ignore_index=-100)
        output = CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_FIELD: cache})
        return output if return_dict is not False else output.to_tuple()
