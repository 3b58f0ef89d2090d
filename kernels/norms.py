"""Norm modules usable anywhere in a megatron-core spec, with sequence parallelism.

megatron's ``WrappedTorchNorm`` refuses sequence parallelism because nothing marks its weight
for the tensor-parallel all-reduce. Under SP each TP rank normalises a different slice of the
sequence, so the weight gradient is partial on every rank; megatron's ``finalize_model_grads``
sums the grads of parameters tagged ``sequence_parallel=True`` across TP. :class:`Norm` tags
its parameters that way, which makes it valid with and without SP.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from kernels import reference
from kernels.backend import NormBackend


def mark_sequence_parallel(param: torch.nn.Parameter, config: TransformerConfig) -> None:
    """Tag a TP-replicated parameter whose gradient is partial per rank under SP."""
    param.sequence_parallel = config.sequence_parallel


class Norm(torch.nn.Module):
    """RMSNorm or LayerNorm over the last dimension, chosen by ``config.normalization``.

    Follows megatron's norm builder signature ``(config=, hidden_size=, eps=)``; the spec adds
    ``backend`` (torch or triton, already resolved) and ``bias`` (``model.norm_bias``: whether
    a LayerNorm has a learnable bias), and the function computing the norm is bound here,
    once. Weights start at 1 (and biases at 0), as every norm in SiameseNorm must.
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, *,
                 backend: NormBackend = NormBackend.TORCH, bias: bool = True):
        super().__init__()
        if config.normalization not in ("RMSNorm", "LayerNorm"):
            raise ValueError(
                f"model.normalization ({config.normalization}) must be RMSNorm or LayerNorm"
            )
        if backend not in (NormBackend.TORCH, NormBackend.TRITON):
            raise ValueError(f"Norm computes with torch or triton, not {backend}")
        self.is_rms = config.normalization == "RMSNorm"
        self.eps = eps
        self.backend = backend
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.bias = None
        if bias and not self.is_rms:
            self.bias = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        for param in self.parameters():
            mark_sequence_parallel(param, config)
        if backend is NormBackend.TRITON:
            # compiled, or interpreted, as decided at its import; a registered op inside a
            # compiled block (kernels.compile)
            from kernels import norm_library

            self._norm, self._add_norm = norm_library.norm, norm_library.add_norm
        else:
            self._norm, self._add_norm = reference.norm, reference.add_norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._norm(x, self.weight, self.bias, self.eps, self.is_rms)

    def add_norm(self, h: torch.Tensor, r: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
        """N(alpha h + r): one pass with triton (the sum is never stored)."""
        return self._add_norm(h, r, alpha, self.weight, self.bias, self.eps, self.is_rms)

    def extra_repr(self) -> str:
        kind = "RMSNorm" if self.is_rms else "LayerNorm"
        return f"{kind}({self.weight.numel()}, eps={self.eps}, backend={self.backend})"


def residual_norm(norm: torch.nn.Module, h: torch.Tensor, r: torch.Tensor,
                  alpha: float = 1.0) -> torch.Tensor:
    """``norm(alpha h + r)``, fused where ``norm`` is a :class:`Norm` (other norm modules, such
    as Transformer Engine's, compose it)."""
    if isinstance(norm, Norm):
        return norm.add_norm(h, r, alpha)
    return norm(reference.residual_sum(h, r, alpha))
