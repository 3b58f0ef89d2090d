"""Which implementation computes attention and the linear layers: megatron's own modules,
torch's fused SDPA, or Transformer Engine (TE).

Three model fields choose, each resolved once per process:

- ``attention_backend`` (auto | sdpa | local | te): the core attention. ``local`` is megatron's
  DotProductAttention, which materialises the [b, heads, s, s] score matrix; ``sdpa`` runs
  torch's scaled_dot_product_attention (flash / cuDNN / memory-efficient kernels on GPU);
  ``te`` is megatron's TEDotProductAttention. ``auto``: te where TE can be used, else sdpa.
- ``transformer_impl`` (auto | local | te): the linear layers. ``te`` uses TE's linears and,
  where a scheme's norm sits directly before a projection (Pre-Norm), TE's fused norm+linear.
  ``auto``: te where TE can be used, else local.

- ``megatron_fusions`` (auto | on | off): megatron-core's own fused kernels
  (:func:`resolve_fusions`). ``auto``: on with CUDA, off on the CPU; the dry run's memory
  estimate resolves it as on the GPU nodes it plans for, wherever it runs.

Whether TE can be used is decided in one place, :func:`runtime.device.te_unavailable_reason`,
which never imports TE on a machine without CUDA.
"""

from __future__ import annotations

from enum import StrEnum

from runtime import device


class AttentionBackend(StrEnum):
    AUTO = "auto"
    SDPA = "sdpa"  # torch.nn.functional.scaled_dot_product_attention
    LOCAL = "local"  # megatron's DotProductAttention (explicit score matrix)
    TE = "te"  # megatron's TEDotProductAttention


class TransformerImpl(StrEnum):
    AUTO = "auto"
    LOCAL = "local"  # megatron's ColumnParallelLinear / RowParallelLinear
    TE = "te"  # TE linears; fused norm+linear where the scheme allows


class MegatronFusions(StrEnum):
    AUTO = "auto"
    ON = "on"
    OFF = "off"


def te_available() -> bool:
    return device.te_unavailable_reason() is None


def te_module(name: str):
    """A class from megatron's TE wrappers (e.g. ``TEDotProductAttention``)."""
    reason = device.te_unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"Transformer Engine requested but unavailable: {reason}")
    from megatron.core.extensions import transformer_engine as te_ext

    return getattr(te_ext, name)


def resolve_attention_backend(choice: AttentionBackend) -> AttentionBackend:
    if choice is AttentionBackend.AUTO:
        return AttentionBackend.TE if te_available() else AttentionBackend.SDPA
    return choice


def resolve_transformer_impl(choice: TransformerImpl) -> TransformerImpl:
    if choice is TransformerImpl.AUTO:
        return TransformerImpl.TE if te_available() else TransformerImpl.LOCAL
    return choice


def resolve_fusions(choice: MegatronFusions, cuda: bool | None = None) -> bool:
    """Whether megatron's fusions are on. They are ``torch.compile``d functions (megatron's
    ``jit_fuser``): Triton kernels on a GPU; on the CPU they would compile C++ for a small gain,
    so ``auto`` keeps them off there. ``cuda``: resolve for a machine with (or without) CUDA
    rather than this one (the dry run plans for GPU nodes from wherever it runs)."""
    if choice is MegatronFusions.AUTO:
        return device.uses_cuda() if cuda is None else cuda
    return choice is MegatronFusions.ON
