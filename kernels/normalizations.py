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

Each kind also says what one of its norms keeps for backward (:class:`Kept`), the one place
the dry run's activation estimate reads it from (``pretrain.report.dry_run``), held byte for
byte to what autograd keeps by ``tests/bench/test_saved_activations.py`` for every scheme.
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
class Kept:
    """What one norm keeps for backward per normalised row of n values, as it runs on the GPU
    path (the fused Triton kernels for a kind they compute, the reference otherwise).

    ``input``: whether it keeps its input tensor itself, a storage other operations may keep
    too (the estimate counts it once); ``row_bytes`` and ``value_bytes``: what it keeps of its
    own per row and per value (statistics, an fp32 copy, an fp32 intermediate)."""

    input: bool
    row_bytes: int = 0
    value_bytes: int = 0

    def bytes(self, rows: int, values: int, width: int, input_kept: bool) -> int:
        """Bytes for ``rows`` rows of ``values`` values in an activation dtype of ``width``
        bytes; ``input_kept``: another operation keeps the input anyway."""
        own = rows * (self.row_bytes + values * self.value_bytes)
        return own + (rows * values * width if self.input and not input_kept else 0)


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
    kept: Callable[[int], Kept]
    """``kept(width)``: what one norm keeps for backward in an activation dtype of ``width``
    bytes (:class:`Kept`)."""
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


def _kernel_kept(_width: int) -> Kept:
    """The Triton kernels keep a norm's input and two fp32 statistics per row."""
    return Kept(input=True, row_bytes=8)


def _dyt_kept(width: int) -> Kept:
    """The reference's autograd keeps the fp32 input alpha multiplies (the input itself when it
    is fp32, else a copy) and the fp32 tanh the weight multiplies: its own 8 bytes per value
    in bf16, 4 more than its input in fp32."""
    fp32 = width == 4
    return Kept(input=fp32, value_bytes=4 if fp32 else 8)


WEIGHT = NormParameter("weight", "hidden", 1.0, "norm")
KINDS: dict[str, NormKind] = {kind.name: kind for kind in (
    NormKind("rmsnorm", "RMSNorm", (WEIGHT,), _rms, fused_kernels=True,
             transformer_engine=True, kept=_kernel_kept),
    NormKind("layernorm", "LayerNorm",
             (WEIGHT, NormParameter("bias", "hidden", 0.0, "norm", optional=True)), _layer,
             fused_kernels=True, transformer_engine=True, kept=_kernel_kept),
    NormKind("dyt", "DyT",
             (NormParameter("alpha", "scalar", "dyt_alpha", "scalar"), WEIGHT,
              NormParameter("bias", "hidden", 0.0, "norm")), _dyt,
             fused_kernels=False, transformer_engine=False, kept=_dyt_kept, eps=False),
)}
"""Every normalization ``model.normalization`` can name."""


def kind(name: str) -> NormKind:
    return KINDS[str(name)]
