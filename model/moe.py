"""Mixture of experts: which blocks are MoE, and megatron-core's MoE layer as their MLP.

An MoE block is the scheme's own block with F = megatron's ``MoELayer`` (its top-k router, its
token dispatcher and its experts) in place of one MLP; the residual equations around F do not
change, so every scheme gets experts the same way, through the spec. The layer is megatron's
unchanged: the router's balancing and z losses join the gradient through megatron's
``MoEAuxLossAutoScaler`` (scaled by megatron's schedule), its all-to-all dispatcher carries
tokens across expert-parallel ranks, and its checkpoint keys number experts globally, so a
checkpoint reshards across expert-parallel sizes like any other.

The experts are megatron's ``SequentialMLP`` of our own tensor-parallel linears (one matrix
product per local expert), or with Transformer Engine its grouped GEMM (``TEGroupedMLP``).

The routed experts' parameters are expert parameters (megatron's ``allreduce`` False) under
every layout: :func:`mark_experts`.
"""

from __future__ import annotations

from functools import partial

from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP

from model.backends import TransformerImpl, resolve_transformer_impl, te_module
from model.config import ModelConfig


def is_moe_block(model: ModelConfig, index: int) -> bool:
    """Whether global block ``index`` (0-based) has experts (``ModelConfig.moe_blocks``)."""
    return model.moe_blocks[index]


def _shared_experts(*, config, pg_collection, gate: bool, name: str | None = None,
                    submodules: MLPSubmodules) -> SharedExpertMLP:
    """megatron's shared expert (the MLP every token also passes through)."""
    return SharedExpertMLP(config=config, submodules=submodules, gate=gate,
                           pg_collection=pg_collection, name=name)


def mark_experts(chunks) -> None:
    """Mark every routed expert's parameter an expert parameter (``allreduce`` False), at
    every parallel layout.

    megatron marks them only when the experts are expert-parallel (``parallel.ep`` > 1) or
    tensor-parallel otherwise than the rest (``parallel.etp`` other than ``parallel.tp``;
    ``tensor_parallel/layers.py``, ``use_expert_pgs``), and the mark decides the optimizer:
    marked parameters get an optimizer of their own, chained after the others'
    (``get_megatron_optimizer``), whose checkpoint keys are numbered apart (``chained_1.``).
    Left to megatron, a checkpoint of parallel.ep 1 and one of parallel.ep 2 would lay the
    optimizer state out differently and neither would load as the other. Marked always, the
    layout is one, and a run resumes at any ep and etp. Nothing else changes at ep 1 with etp
    = tp: megatron reduces marked gradients over the expert data-parallel group (world /
    (etp x ep x pp) ranks), then the data-parallel group's ranks, at the same 1/dp scale;
    their duplicates are filtered over the expert tensor-parallel group, then the
    tensor-parallel group's ranks; and the gradient norm joins both optimizers' norms."""
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, MoELayer):
                for param in module.experts.parameters():
                    param.allreduce = False


def moe_spec(model: ModelConfig, linears: dict):
    """The MLP builder of an MoE block: megatron's MoELayer over ``linears`` (the model's
    linear classes, ``model.spec.linear_modules``)."""
    mlp = MLPSubmodules(linear_fc1=linears["column"], linear_fc2=linears["row"])
    if resolve_transformer_impl(model.transformer_impl) is TransformerImpl.TE:
        from megatron.core.transformer.moe.experts import GroupedMLPSubmodules, TEGroupedMLP
        experts = partial(TEGroupedMLP, submodules=GroupedMLPSubmodules(
            linear_fc1=te_module("TEColumnParallelGroupedLinear"),
            linear_fc2=te_module("TERowParallelGroupedLinear")))
    else:
        experts = partial(SequentialMLP, submodules=mlp)
    return partial(MoELayer, submodules=MoESubmodules(
        experts=experts, shared_experts=partial(_shared_experts, submodules=mlp)))
