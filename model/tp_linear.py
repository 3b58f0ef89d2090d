"""megatron's tensor-parallel linears, as our blocks use them (``model/spec.py``).

Row-parallel: megatron-core 0.19.2's ``RowParallelLinear.forward`` calls its linear with
``tp_group=None`` (the all-reduce comes after, with the layer's group), and the linear then
asks ``get_tensor_model_parallel_group_if_none``, which on rank 0 issues a DeprecationWarning
through ``warnings.warn`` and returns the default group. Eager, that is one filtered warning;
inside ``torch.compile`` it is a graph break in every row-parallel linear (attention's output
projection and the MLP's fc2: two per block, replayed under recompute), since Dynamo cannot
trace ``warnings.warn`` with a warning class. Passing the layer's own group (the same group
the lookup returns) skips that path.

Column-parallel: megatron's linear is one autograd Function whose backward overlaps its
collectives with the matrix products by hand (``async_op=True`` handles, a global gather
buffer, ``torch.cuda.current_device()`` allocations), which Dynamo refuses: a graph break in
every column-parallel linear at TP > 1 (QKV and fc1). Inside a compiled block the same
computation is composed instead of megatron's own traceable pieces: its sequence-parallel
gather (all-gather forward, reduce-scatter backward) or its copy to the tensor-parallel region
(all-reduce of the input's gradient), then the matrix product, whose gradients autograd
computes; inductor schedules the collectives. The weight gradient then reaches ``main_grad``
through megatron DDP's hook (no fused accumulation into it: an add per weight and step more).
Eager runs keep megatron's Function. Weights and their names are unchanged either way.
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)


class RowLinear(RowParallelLinear):
    """RowParallelLinear whose linear gets ``self.tp_group`` instead of None."""

    def _forward_impl(self, input, weight, *args, **kwargs):
        if kwargs.get("tp_group", self.tp_group) is None:
            kwargs["tp_group"] = self.tp_group
        return super()._forward_impl(input, weight, *args, **kwargs)


class ColumnLinear(ColumnParallelLinear):
    """ColumnParallelLinear whose linear, inside a compiled block, is composed of megatron's
    traceable collectives and a matrix product (see the module docstring)."""

    def _forward_impl(self, input, weight, *args, **kwargs):
        if not (torch.compiler.is_compiling() and weight.requires_grad and not args
                and kwargs.get("grad_output_buffer") is None
                and kwargs.get("gtp_remat_size", 1) == 1):
            return super()._forward_impl(input, weight, *args, **kwargs)
        group = kwargs.get("tp_group") or self.tp_group
        if kwargs["sequence_parallel"]:
            input = gather_from_sequence_parallel_region(input, True, group=group)
        elif kwargs["allreduce_dgrad"]:
            input = copy_to_tensor_model_parallel_region(input, group=group)
        output = torch.matmul(input, weight.t())
        bias = kwargs.get("bias")
        return output if bias is None else output + bias
