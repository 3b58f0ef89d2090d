"""megatron's RowParallelLinear, handed its own tensor-parallel group.

megatron-core 0.19.2's ``RowParallelLinear.forward`` calls its linear with ``tp_group=None``
(the all-reduce comes after, with the layer's group), and the linear then asks
``get_tensor_model_parallel_group_if_none``, which on rank 0 issues a DeprecationWarning
through ``warnings.warn`` and returns the default group. Eager, that is one filtered warning;
inside ``torch.compile`` it is a graph break in every row-parallel linear (attention's output
projection and the MLP's fc2: two per block, replayed under recompute), since Dynamo cannot
trace ``warnings.warn`` with a warning class. Passing the layer's own group (the same group
the lookup returns) skips that path; nothing else changes, the weights and their names
included.
"""

from __future__ import annotations

from megatron.core.tensor_parallel import RowParallelLinear


class RowLinear(RowParallelLinear):
    """RowParallelLinear whose linear gets ``self.tp_group`` instead of None."""

    def _forward_impl(self, input, weight, *args, **kwargs):
        if kwargs.get("tp_group", self.tp_group) is None:
            kwargs["tp_group"] = self.tp_group
        return super()._forward_impl(input, weight, *args, **kwargs)
