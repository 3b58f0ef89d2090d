"""SiameseNorm, hybrid_pre variant (the published language-model form).

The x stream follows HybridNorm (QKV-norm attention, Post-Norm around the MLP); y stays
Pre-Norm. For global block l, with c_l = sqrt(2 (l + 1)):

    attention:  a = x * g + Npre_attn(y)             # g: per-channel gate, init 1, fp32
                r = Attn(a)                          # per-head norms on Q, K, V
                x = x + r / c_l ;  y = y + r
    MLP:        u = Npost_mlp(x)                     # x is replaced by its normalised value
                r = MLP( Nin_mlp( u + Npre_mlp(y) ) )
                x = u + r / c_l ;  y = y + r

HybridNorm* (``model.hybrid_first_block``, model.schemes.FirstBlock) changes block 0 only, as
the official code's flag ``{0: {'attn_norm': True, 'ffn_residual': False}}`` does:

    attention:  a = Nx_attn(x) + Npre_attn(y)        # x normalised alone; no gate
    MLP:        r = MLP( Nin_mlp( Nx_mlp(x) + Npre_mlp(y) ) )
                x = x + r / c_0 ;  y = y + r         # x keeps its un-normalised residual

(``prenorm``); ``prenorm_literal``, SIAMESENORM.md's wording, has no Nx_mlp.

Fusion (triton backend): the gated attention entry is one pass (the gate's product in fp32,
also when megatron's Float16Module has made g bf16), which past block 0 reads the packed input
and writes its gradient whole; the attention's update and the MLP's entry are one pass; the
MLP's update is one pass writing the packed output. HybridNorm*'s block 0 (one block of the
model) stays plain torch.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.identity_op import IdentityOp

from kernels.fused import fuse_gate
from kernels.norms import mark_sequence_parallel
from model import streams
from model.config import ModelConfig
from model.decay import Decay, declare
from model.layers.base import BranchInputs, LayerChoice
from model.layers.two_stream import TwoStreamLayer, siamese_params
from model.schemes import FirstBlock


class _ScaleFunction(torch.autograd.Function):
    """x * g computed in fp32 and rounded to x's dtype, keeping x itself for backward.

    Autograd of ``(x.float() * g).to(x.dtype)`` would keep the fp32 copy of x: two values' worth
    of bf16 activations per token and layer, for an x that is a half of the layer input, which
    the attention keeps anyway. The math is the same, in the same precision."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, g)
        return (x.float() * g).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, g = ctx.saved_tensors
        grad = grad.float()
        dx = (grad * g).to(x.dtype) if ctx.needs_input_grad[0] else None
        dg = (grad * x.float()).reshape(-1, g.numel()).sum(0) if ctx.needs_input_grad[1] else None
        return dx, dg


class ChannelGate(torch.nn.Module):
    """A learnable per-channel scale g, kept in fp32 whatever the parameter dtype."""

    def __init__(self, config, hidden_size: int):
        super().__init__()
        self.weight = declare(torch.nn.Parameter(torch.ones(hidden_size, dtype=torch.float32)),
                              Decay.GATE)
        mark_sequence_parallel(self.weight, config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ScaleFunction.apply(x, self.weight)


class SiameseHybridLayer(TwoStreamLayer):
    def __init__(self, config, submodules, *args, **kwargs):
        super().__init__(config, submodules, *args, **kwargs)
        self.attn_gate = ChannelGate(self.config, self.config.hidden_size)
        self.attn_pre_norm = self.build_norm(site="attention")
        self.attn_fused = fuse_gate(self.backend, self.attn_gate, self.attn_pre_norm)
        self.mlp_norms = self.sublayer_norms()

    def gated_entry(self, hidden_states: torch.Tensor):
        """(x, y, a) with a = x * g + Npre_attn(y), from the layer input."""
        if self.attn_fused is None:
            x, y = self.streams_in(hidden_states)
            return x, y, self.attn_gate(x) + self.attn_pre_norm(y)
        if self.reads_embedding:
            x, y = streams.start(hidden_states)
            return x, y, self.attn_fused.entry(x, y)[1]
        _, x, y, a = self.attn_fused.entry_packed(hidden_states, streams.unpack)
        return x, y, a

    def compute(self, hidden_states: torch.Tensor, inputs: BranchInputs) -> torch.Tensor:
        x, y, a = self.gated_entry(hidden_states)
        r = self.attention(a, inputs)
        u, y, s = self.mlp_norms.update_entry(x, y, r, self.c_operand)  # x += r/c, y += r; entry
        r = self.feed_forward(s, inputs)
        return self.streams_out(u, y, r)                          # x = u + r/c, y += r; packed


class HybridNormStarFirstBlock(TwoStreamLayer):
    """Block 0 under HybridNorm*: Pre-Norm-style reads of x, whose residual is never replaced.
    ``mlp_x_norm``: whether the MLP reads Nx_mlp(x) (the official code) or x itself."""

    def __init__(self, config, submodules, *args, mlp_x_norm: bool = True, **kwargs):
        super().__init__(config, submodules, *args, **kwargs)
        self.attn_x_norm = self.build_norm(site="attention")
        self.attn_pre_norm = self.build_norm(site="attention")
        self.mlp_x_norm = self.build_norm() if mlp_x_norm else IdentityOp()
        self.mlp_pre_norm = self.build_norm()
        self.mlp_in_norm = self.build_norm() if self.input_norm else IdentityOp()

    def compute(self, hidden_states: torch.Tensor, inputs: BranchInputs) -> torch.Tensor:
        x, y = self.streams_in(hidden_states)
        r = self.attention(self.attn_x_norm(x) + self.attn_pre_norm(y), inputs)
        x, y = x + r / self.c, y + r
        r = self.feed_forward(self.mlp_in_norm(self.mlp_x_norm(x) + self.mlp_pre_norm(y)),
                              inputs)
        return self.streams_out(x, y, r)


def layer(model: ModelConfig, index: int) -> LayerChoice:
    """SiameseHybridLayer everywhere but HybridNorm*'s block 0."""
    params = siamese_params(model)
    if index == 0 and model.hybrid_first_block is not FirstBlock.HYBRID:
        literal = model.hybrid_first_block is FirstBlock.PRENORM_LITERAL
        return HybridNormStarFirstBlock, {**params, "mlp_x_norm": not literal}
    return SiameseHybridLayer, params


START = {"attn_gate.weight": 1.0}
"""The channel gate g starts at 1 (model/init.py): x enters the attention as it is."""
