"""Hyper-connections (baseline; Zhu et al. 2024, "Hyper-Connections"): n residual streams.

The hidden state is n streams H = (H_1 .. H_n) (expansion rate n = ``model.hc_rate``), all
starting as the embedding. Each sublayer j (attention and MLP of every block: j = 2 l and
2 l + 1 for global block l) reads one mix of the streams, runs Pre-Norm style, and writes its
output back into every stream with its own weight:

    h   = sum_i Am_i H_i                         # width connection (n weights)
    r   = F_j( N_j(h) )
    H_k = sum_i Ar_ik H_i  +  B_k r              # depth connections (n x n) and output (n)

Static (``hc_dynamic = false``): Am, Ar, B are learned vectors/matrices, initialised to
Am = e_(j mod n), Ar = I, B = 1, so every stream starts identical and the model starts as
Pre-Norm. Dynamic (the paper's DHC, the default): each token adds its own offsets, computed
from the normalised streams Hn = Nhc(H) with zero-initialised projections,

    Am += s_a tanh(Hn w_m),   Ar += s_a tanh(Hn W_r),   B += s_b tanh(Hn w_b)

with learned scalars s_a, s_b starting at 0.01. After the last block the streams are summed,
then the final norm (:class:`StreamSumNorm`). With n = 1 and the static form this is exactly
Pre-Norm (a test checks it). The streams cross megatron packed as [s, b, n h]
(``model.streams``).
"""

from __future__ import annotations

from functools import partial

import torch
from megatron.core.transformer.spec_utils import ModuleSpec, build_module

from kernels.norms import mark_sequence_parallel
from model import streams
from model.config import ModelConfig
from model.decay import Decay, declare
from model.layers.base import BranchInputs, LayerChoice, SchemeLayer

DYNAMIC_SCALE_INIT = 0.01


class HyperConnection(torch.nn.Module):
    """The connection weights of one sublayer (``index`` j among all 2 L sublayers)."""

    def __init__(self, config, rate: int, index: int, dynamic: bool, build_norm):
        super().__init__()
        dtype, hidden = config.params_dtype, config.hidden_size
        self.rate = rate
        width = torch.zeros(rate, dtype=dtype)
        width[index % rate] = 1.0
        mixing = Decay.MIXING  # static connection weights: never decayed
        self.width = declare(torch.nn.Parameter(width), mixing)                       # Am
        self.depth = declare(torch.nn.Parameter(torch.eye(rate, dtype=dtype)), mixing)  # Ar
        self.output = declare(torch.nn.Parameter(torch.ones(rate, dtype=dtype)), mixing)  # B
        self.dynamic = dynamic
        if dynamic:
            self.norm = build_norm()
            # rows: w_m, then the n columns of W_r, then w_b
            self.proj = declare(torch.nn.Parameter(torch.zeros(rate + 2, hidden, dtype=dtype)),
                                Decay.MATRIX)
            self.width_scale = declare(torch.nn.Parameter(
                torch.full((), DYNAMIC_SCALE_INIT, dtype=dtype)), Decay.SCALAR)
            self.output_scale = declare(torch.nn.Parameter(
                torch.full((), DYNAMIC_SCALE_INIT, dtype=dtype)), Decay.SCALAR)
        for param in self.parameters(recurse=False):
            # Under sequence parallelism each TP rank sees other tokens: partial gradients.
            mark_sequence_parallel(param, config)

    def weights(self, H: torch.Tensor):
        """(Am [.., n], Ar [.., n, n], B [.., n]) for streams H [s, b, n, h]."""
        if not self.dynamic:
            return self.width, self.depth, self.output
        n = self.rate
        offsets = torch.tanh(self.norm(H) @ self.proj.t())                       # [s, b, n, n+2]
        width = self.width + self.width_scale * offsets[..., 0]
        depth = self.depth + self.width_scale * offsets[..., 1:n + 1]
        output = self.output + self.output_scale * offsets[..., n + 1]
        return width, depth, output

    def read(self, H: torch.Tensor, width: torch.Tensor) -> torch.Tensor:
        """h = sum_i Am_i H_i."""
        return (width.unsqueeze(-1) * H).sum(-2)

    def write(self, H: torch.Tensor, depth: torch.Tensor, output: torch.Tensor,
              r: torch.Tensor) -> torch.Tensor:
        """H_k = sum_i Ar_ik H_i + B_k r."""
        mixed = torch.einsum("...ik,...ih->...kh", depth.expand(*H.shape[:-2], -1, -1), H)
        return mixed + output.unsqueeze(-1) * r.unsqueeze(-2)


class HyperConnectionLayer(SchemeLayer):
    """A Pre-Norm block whose two sublayers read and write the n streams through their
    hyper-connections."""

    def __init__(self, config, submodules, *args, rate: int = 4, dynamic: bool = True,
                 **kwargs):
        super().__init__(config, submodules, *args, **kwargs)
        self.rate = rate
        block = self.layer_number - 1  # global, so pipeline stages agree with one process
        self.attn_norm = self.build_norm(site="attention")
        self.mlp_norm = self.build_norm()
        self.attn_hc = HyperConnection(self.config, rate, 2 * block, dynamic,
                                       partial(self.build_norm, site="attention"))
        self.mlp_hc = HyperConnection(self.config, rate, 2 * block + 1, dynamic,
                                      self.build_norm)

    def sublayer(self, H: torch.Tensor, hc: HyperConnection, norm, branch) -> torch.Tensor:
        width, depth, output = hc.weights(H)
        r = branch(norm(hc.read(H, width)))
        return hc.write(H, depth, output, r)

    def compute(self, hidden_states: torch.Tensor, inputs: BranchInputs) -> torch.Tensor:
        if self.reads_embedding:  # the embedding: every stream starts as it
            H = streams.repeat(hidden_states, self.rate)
        else:
            H = streams.split(hidden_states, self.rate)
        H = self.sublayer(H, self.attn_hc, self.attn_norm,
                          lambda a: self.attention(a, inputs))
        H = self.sublayer(H, self.mlp_hc, self.mlp_norm,
                          lambda a: self.feed_forward(a, inputs))
        return streams.join(H)


class StreamSumNorm(torch.nn.Module):
    """The decoder's end: the sum of the n streams, then the final norm (``final_norm``)."""

    def __init__(self, config, hidden_size: int, eps: float, *, norm: ModuleSpec | type,
                 rate: int):
        super().__init__()
        self.rate = rate
        self.final_norm = build_module(norm, config=config, hidden_size=hidden_size, eps=eps)

    def forward(self, packed: torch.Tensor) -> torch.Tensor:
        return self.final_norm(streams.split(packed, self.rate).sum(-2))


def layer(model: ModelConfig, index: int) -> LayerChoice:
    return HyperConnectionLayer, {"rate": model.hc_rate, "dynamic": model.hc_dynamic}


def final_norm(model: ModelConfig, norm: ModuleSpec) -> ModuleSpec:
    """What closes the decoder for this scheme (``FinalNorm.SCHEME``)."""
    return ModuleSpec(module=StreamSumNorm, params={"norm": norm, "rate": model.hc_rate})


def _one_hot_width(model: ModelConfig, key: str, block: int | None,
                   shape: tuple[int, ...]) -> torch.Tensor:
    """Am = e_(j mod n) for sublayer j = 2 l (attention) or 2 l + 1 (MLP) of global block l."""
    width = torch.zeros(shape)
    width[(2 * block + (0 if ".attn_hc." in key else 1)) % model.hc_rate] = 1.0
    return width


def _identity(model: ModelConfig, key: str, block: int | None,
              shape: tuple[int, ...]) -> torch.Tensor:
    return torch.eye(model.hc_rate)


START = {
    "_hc.width": _one_hot_width,                # Am = e_(j mod n)
    "_hc.depth": _identity,                     # Ar = I
    "_hc.output": 1.0,                          # B = 1
    "_hc.proj": 0.0,                            # the dynamic projections
    "_hc.width_scale": DYNAMIC_SCALE_INIT,      # s_a
    "_hc.output_scale": DYNAMIC_SCALE_INIT,     # s_b
}
"""Where the connection weights start (model/init.py): every stream alike, the model starts
as Pre-Norm."""
