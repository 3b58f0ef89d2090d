"""Normalizations, registered as residual schemes are: each kind declared once, here.

A kind says what a norm module of it holds and computes, and what the rest of the framework
needs to know of it: its parameters (shape, start value, weight-decay role: every one is
marked for sequence parallelism and computed in fp32), its reference computation, whether the
fused Triton kernels compute it (a norm they do not is computed by its reference under the
triton backend too, norm by norm: ``kernels.fused`` asks each norm, never the layer), whether
Transformer Engine has it. ``model.normalization`` takes any registered name; the Hugging
Face remote code computes each kind by the same name (``pretrain/hf/remote``).

- ``rmsnorm``: w * x / sqrt(mean(x^2) + eps).
- ``layernorm``: w * (x - mean) / sqrt(var + eps) (+ b with ``model.norm_bias``).
- ``dyt``: Dynamic Tanh ("Transformers without Normalization", Zhu et al., CVPR 2025),
  w * tanh(alpha x) + b, alpha one learned scalar per norm starting at ``model.dyt_alpha``;
  no statistics, so nothing to fuse across a row, and no eps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the config's checks read the registry without importing torch
    import torch


@dataclass(frozen=True)
class NormParameter:
    """One parameter of a norm module: ``shape`` "hidden" ([hidden_size]) or "scalar" ([]);
    ``start`` the value it starts at (``dyt_alpha``: the model's ``model.dyt_alpha``); ``role``
    its weight-decay role (a ``model.decay.Decay`` value)."""

    name: str
    shape: str
    start: float | str
    role: str
    optional: bool = False  # present only with model.norm_bias


@dataclass(frozen=True)
class NormKind:
    name: str
    megatron_name: str
    """megatron's ``TransformerConfig.normalization`` (Transformer Engine's norms read it)."""
    parameters: tuple[NormParameter, ...]
    compute: Callable[..., torch.Tensor]
    """``compute(x, params, eps)``: the norm of the last dimension in fp32, cast back to x's
    dtype; ``params`` maps each parameter's name to its tensor (None: an absent bias)."""
    fused_kernels: bool
    """Whether the Triton kernels (``kernels.triton_ops``) compute it."""
    transformer_engine: bool
    """Whether Transformer Engine has it (``kernels.norm_backend te``, TE's fused linears)."""
    eps: bool = True
    """Whether ``model.norm_eps`` enters its computation."""


def _rms(x: torch.Tensor, p: dict, eps: float) -> torch.Tensor:
    from kernels import reference  # the ground truth the fused kernels are held to

    return reference.rms_norm(x, p["weight"], eps)


def _layer(x: torch.Tensor, p: dict, eps: float) -> torch.Tensor:
    from kernels import reference

    return reference.layer_norm(x, p["weight"], p.get("bias"), eps)


def _dyt(x: torch.Tensor, p: dict, eps: float) -> torch.Tensor:
    y = (p["alpha"].float() * x.float()).tanh() * p["weight"].float() + p["bias"].float()
    return y.to(x.dtype)


WEIGHT = NormParameter("weight", "hidden", 1.0, "norm")
KINDS: dict[str, NormKind] = {kind.name: kind for kind in (
    NormKind("rmsnorm", "RMSNorm", (WEIGHT,), _rms, fused_kernels=True,
             transformer_engine=True),
    NormKind("layernorm", "LayerNorm",
             (WEIGHT, NormParameter("bias", "hidden", 0.0, "norm", optional=True)), _layer,
             fused_kernels=True, transformer_engine=True),
    NormKind("dyt", "DyT",
             (NormParameter("alpha", "scalar", "dyt_alpha", "scalar"), WEIGHT,
              NormParameter("bias", "hidden", 0.0, "norm")), _dyt,
             fused_kernels=False, transformer_engine=False, eps=False),
)}
"""Every normalization ``model.normalization`` can name."""


def kind(name: str) -> NormKind:
    return KINDS[str(name)]
