"""Multi-tensor gradient norm and scaling for megatron's optimizer without TE or apex.

megatron's optimizer step computes the global gradient norm, clips, and copies the fp32 main
weights into the model's bf16 ones through apex/TE multi-tensor kernels. Without either package
it falls back to Python loops: the norm takes one ``torch.norm`` per tensor and then builds a
tensor from their Python values (``megatron.core.utils.local_multi_tensor_l2_norm``), which is
a host synchronisation per parameter tensor (about 150 per step at 16 layers), and scaling and
copying launch one kernel per tensor.

:func:`l2_norm` and :func:`scale` are drop-in replacements with the same signatures built on
torch's multi-tensor (``foreach``) ops: a handful of launches per step and no synchronisation
(megatron itself still reads the final norm once). :func:`foreach_kernels` swaps them in for
megatron's fallbacks for the duration of a block (the optimizer step), and only where megatron
is on its fallback: with TE or apex their kernels stay.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def l2_norm(_chunk_size, _noop_flag, tensor_lists, _per_tensor, *_args):
    """The 2-norm of all tensors of ``tensor_lists[0]`` together, as a [1] fp32 tensor on their
    device (amp_C.multi_tensor_l2norm's result; no per-tensor norms)."""
    [tensors] = tensor_lists
    total = torch.nn.utils.get_total_norm(tensors, 2.0, foreach=True)
    return total.reshape(1).float(), None


def scale(_chunk_size, _noop_flag, tensor_lists, factor):
    """dst = src * factor for the pairs of ``tensor_lists`` (in place when they are the same
    tensors, as in gradient clipping; a dtype-converting copy when factor is 1)."""
    src, dst = tensor_lists
    if all(s is d for s, d in zip(src, dst, strict=True)):
        torch._foreach_mul_(dst, factor)
    elif factor == 1.0:
        torch._foreach_copy_(dst, src)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, factor))


def _targets() -> list[tuple[object, str, object]]:
    """(module, attribute, replacement) for each megatron fallback in use."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer

    fallbacks = {utils.local_multi_tensor_l2_norm: l2_norm, utils.local_multi_tensor_scale: scale}
    names = [(clip_grads, "l2_norm_impl"), (clip_grads, "multi_tensor_scale_impl"),
             (optimizer, "multi_tensor_scale_impl")]
    return [(module, name, fallbacks[getattr(module, name)]) for module, name in names
            if getattr(module, name) in fallbacks]


@contextlib.contextmanager
def foreach_kernels() -> Iterator[None]:
    """Run a block with megatron's multi-tensor fallbacks replaced by :func:`l2_norm` and
    :func:`scale`; the originals are back on exit."""
    targets = _targets()
    saved = [(module, name, getattr(module, name)) for module, name, _ in targets]
    for module, name, replacement in targets:
        setattr(module, name, replacement)
    try:
        yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)
