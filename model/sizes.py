"""How many parameters a model has, and how many of them one token uses.

A dense model uses every parameter for every token. A mixture-of-experts block does not: its
router sends each token to ``moe_router_topk`` of its ``num_experts`` routed experts, so the
size that sets a token's cost (and that MoE models are named by, "15B total, 2B active") is the
total less the routed experts a token skips. Megatron-LM counts it the same way (its
``theoretical_memory_usage``: embeddings and output layer, attention, norms, the router, the
shared expert and top-k routed experts per MoE block, the dense MLP elsewhere).
The routed experts are whatever megatron's MoE layers hold under ``experts`` (SequentialMLP's
local experts or TEGroupedMLP's grouped weights alike); the router and the shared expert are
not among them, every token uses those.

The counts come from the built model, not from a formula, so every scheme's own parameters
(SiameseNorm's extra norms, hyper-connections' weights) are in them; only the split into routed
experts and the rest needs to know what an MoE layer is.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
from megatron.core.transformer.module import param_is_not_shared
from megatron.core.transformer.moe.moe_layer import MoELayer

from model.builder import count_parameters, model_parameter_parts
from model.config import ModelConfig


@dataclass(frozen=True)
class ParameterCount:
    """This rank's share of the model's parameters (``model.builder.count_parameters``'s
    rules: a tensor replicated over TP ranks or tied counts once), split into the routed
    experts' and the rest."""

    total: int
    routed: int  # the routed experts' parameters, in every MoE block

    @property
    def dense(self) -> int:
        """Every parameter outside the routed experts (embeddings, attention, norms, dense
        MLPs, routers, shared experts): split over TP and PP, replicated over data parallel."""
        return self.total - self.routed

    def active(self, model: ModelConfig) -> int:
        """Parameters one token uses: the total less, in each MoE block, the routed experts it
        is not sent to. Routed experts are all alike, so that is the routed share times
        ``(num_experts - topk) / num_experts``, an exact integer."""
        if not model.num_experts:
            return self.total
        skipped = model.num_experts - model.moe_router_topk
        return self.total - self.routed * skipped // model.num_experts


def parameter_count(chunks, where=None) -> ParameterCount:
    """This rank's :class:`ParameterCount`; summed over the TP and PP ranks (and, for the
    routed experts, the expert-parallel ranks) it is the whole model's. ``where``: count only
    the parameters it holds true for (e.g. those an optimizer steps)."""
    routed = {id(p): p for chunk in chunks for module in chunk.modules()
              if isinstance(module, MoELayer) for p in module.experts.parameters()}
    return ParameterCount(total=count_parameters(chunks, where), routed=sum(
        p.numel() for p in routed.values()
        if param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p)
        and (where is None or where(p))))


def whole_model_count(chunks) -> ParameterCount:
    """The whole model's :class:`ParameterCount`, the same under every layout (each part summed
    over the ranks that split it: ``model.builder.model_parameter_parts``). A collective:
    every rank calls it."""
    routed, dense = model_parameter_parts(chunks)
    return ParameterCount(total=routed + dense, routed=routed)
