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

from kernels import normalizations, reference
from kernels.backend import NormBackend


def mark_sequence_parallel(param: torch.nn.Parameter, config: TransformerConfig) -> None:
    """Tag a TP-replicated parameter whose gradient is partial per rank under SP."""
    param.sequence_parallel = config.sequence_parallel


class Norm(torch.nn.Module):
    """A registered normalization (``kernels.normalizations``) over the last dimension.

    Follows megatron's norm builder signature ``(config=, hidden_size=, eps=)``; the spec adds
    ``backend`` (torch or triton, already resolved), ``bias`` (``model.norm_bias``: whether a
    kind with an optional bias has one), ``kind`` (``model.normalization``; without it,
    ``config.normalization``, megatron's name), ``starts`` (the start values a kind takes
    from the config, ``ModelConfig.norm_starts``) and ``site`` ("attention" for the norms of
    an attention sublayer and the head norms, whose DyT alpha starts higher by the DyT
    paper's rule: ``starts["<name>_<site>"]`` where given). Its parameters, their start
    values (weights 1, biases 0, as every norm in SiameseNorm must start) and roles are the
    kind's; the function
    computing it is bound here, once: the fused Triton kernels where the backend is triton and
    they compute this kind (:attr:`fused_kernels`), else the kind's fp32 reference.
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, *,
                 backend: NormBackend = NormBackend.TORCH, bias: bool = True,
                 kind: str | None = None, starts: dict | None = None, site: str = "other"):
        super().__init__()
        self.kind = normalizations.kind(kind) if kind is not None else _by_megatron_name(
            config.normalization)
        if backend not in (NormBackend.TORCH, NormBackend.TRITON):
            raise ValueError(f"Norm computes with torch or triton, not {backend}")
        self.is_rms = self.kind.name == "rmsnorm"
        self.eps = eps
        self.backend = backend
        self.fused_kernels = backend is NormBackend.TRITON and self.kind.fused_kernels
        self.parameter_roles = {}
        self.bias = None
        starts = {"dyt_alpha": 0.5, **(starts or {})}
        for spec in self.kind.parameters:
            if spec.optional and not bias:
                continue
            from_config = isinstance(spec.start, str)
            start = (starts.get(f"{spec.start}_{site}", starts[spec.start]) if from_config
                     else spec.start)
            shape = (hidden_size,) if spec.shape == "hidden" else ()
            param = torch.nn.Parameter(torch.full(shape, float(start),
                                                  dtype=config.params_dtype))
            mark_sequence_parallel(param, config)
            if from_config:  # model.init holds the built model to it
                param.norm_start = float(start)
            setattr(self, spec.name, param)
            self.parameter_roles[spec.name] = spec.role
        if self.fused_kernels:
            # compiled, or interpreted, as decided at its import; a registered op inside a
            # compiled block (kernels.compile)
            from kernels import norm_library

            self._norm, self._add_norm = norm_library.norm, norm_library.add_norm
        elif self.kind.name in ("rmsnorm", "layernorm"):
            self._norm, self._add_norm = reference.norm, reference.add_norm
        else:
            self._norm, self._add_norm = self._reference, self._reference_add

    def _params(self) -> dict:
        return {name: getattr(self, name) for name in self.parameter_roles} | (
            {"bias": None} if self.bias is None else {})

    def _reference(self, x, weight, bias, eps, is_rms):
        return self.kind.compute(x, self._params(), eps)

    def _reference_add(self, h, r, alpha, weight, bias, eps, is_rms):
        return self.kind.compute(reference.residual_sum(h, r, alpha), self._params(), eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._norm(x, self.weight, self.bias, self.eps, self.is_rms)

    def add_norm(self, h: torch.Tensor, r: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
        """N(alpha h + r): one pass with the fused kernels (the sum is never stored)."""
        return self._add_norm(h, r, alpha, self.weight, self.bias, self.eps, self.is_rms)

    def extra_repr(self) -> str:
        eps = f", eps={self.eps}" if self.kind.eps else ""
        return (f"{self.kind.megatron_name}({self.weight.numel()}{eps}, backend={self.backend}"
                + ("" if self.fused_kernels or self.backend is NormBackend.TORCH
                   else ", reference: the fused kernels do not compute it") + ")")


def _by_megatron_name(name: str):
    for kind in normalizations.KINDS.values():
        if kind.megatron_name == name:
            return kind
    names = ", ".join(k.megatron_name for k in normalizations.KINDS.values())
    raise ValueError(f"model.normalization ({name}) must be one of: {names}")


def residual_norm(norm: torch.nn.Module, h: torch.Tensor, r: torch.Tensor,
                  alpha: float = 1.0) -> torch.Tensor:
    """``norm(alpha h + r)``, fused where ``norm`` is a :class:`Norm` (other norm modules, such
    as Transformer Engine's, compose it)."""
    if isinstance(norm, Norm):
        return norm.add_norm(h, r, alpha)
    return norm(reference.residual_sum(h, r, alpha))
