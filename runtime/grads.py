"""Gradient finalisation after a forward-backward pass, for every scheme.

megatron's ``finalize_model_grads`` does the data-parallel reduction, the tied-embedding and
sequence-parallel norm all-reduces. Parameters that are replicated across TP but receive a
different partial gradient on each rank for another reason (the per-head V norm) carry
``tp_partial_grad`` and are summed here.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.distributed import finalize_model_grads
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


def finalize_grads(model, num_tokens=None, *args, **kwargs):
    finalize_model_grads(model, num_tokens, *args, **kwargs)
    group = parallel_state.get_tensor_model_parallel_group()
    if group.size() == 1:
        return
    grads = [
        param.main_grad if hasattr(param, "main_grad") else param.grad
        for chunk in model
        for param in chunk.parameters()
        if getattr(param, "tp_partial_grad", False) and param.requires_grad
    ]
    grads = [g for g in grads if g is not None]
    if not grads:
        return
    flat = _flatten_dense_tensors(grads)
    torch.distributed.all_reduce(flat, group=group)
    for grad, synced in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
        grad.copy_(synced)
