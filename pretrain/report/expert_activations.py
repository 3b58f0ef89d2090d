"""What an MoE block's MLP sublayer keeps for backward per token, in place of one dense MLP's
activations: megatron's ``MoELayer`` (its top-k router, the all-to-all dispatcher's
permutation, ``SequentialMLP``'s experts and the shared expert), tensor by tensor as
megatron-core 0.19.2 keeps them with the router in fp32 (``model/megatron_config.py``).

Every term is a number of bytes per token routed, and exact on one rank: routing sends each
token to k experts, so the experts together see k x (tokens) rows whatever the balance. On
expert-parallel ranks a rank keeps the rows its own experts received, the balanced share on
average; the estimate counts that share (``pretrain.report.dry_run.activation_bytes``).
``tests/bench/test_saved_activations.py`` holds these terms to autograd's saved tensors for
every registered scheme and the router's variants.
"""

from __future__ import annotations

from dataclasses import dataclass

from model.config import ModelConfig
from model.schemes import Activation, LoadBalancing, RouterScore

FP32, INDEX, MASK = 4, 8, 1  # bytes of a router value, an int64 index, a bool


@dataclass(frozen=True)
class ExpertBytes:
    """An MoE sublayer's bytes per token: ``router`` per token on the rank that routes it (a
    term outside the branches: split only by sequence parallelism); ``tokens``, the copies of
    the token at its experts' input (h values per assignment, gathered over the experts'
    tensor-parallel ranks); ``split``, the experts' and the shared expert's activations,
    split over tensor parallelism."""

    router: float
    tokens: float
    split: float


def assignments(model: ModelConfig) -> float:
    """Rows the experts process per token: k, or with a capacity factor c each expert's
    capacity, k c per token (padded to it, exactly; without padding an expert may take fewer,
    so this is the bound)."""
    k, capacity = model.moe_router_topk, model.moe_expert_capacity_factor
    if capacity is None:
        return k
    return k * capacity if model.moe_pad_expert_input_to_capacity else min(k, k * capacity)


def mlp_values(model: ModelConfig, width: int, fused: bool) -> int:
    """Values of the activation dtype one dense MLP of ``width`` keeps per token besides its
    input: the fc1 output (2 x width for SwiGLU); megatron's unfused SwiGLU then keeps
    silu(gate), up + 0 (its glu_linear_offset add copies) and their product, the fc2 input,
    3 x width (with the activation fusion only the product); GELU its output."""
    if model.activation is Activation.SWIGLU:
        return 2 * width + (width if fused else 3 * width)
    return 2 * width


def _expert_values(model: ModelConfig, fused: bool) -> int:
    """Values one expert keeps per row it processes: a dense MLP's, with the routing weight
    applied to the activation's output (megatron's ``per_token_scale``): unfused, the product
    in the activation dtype is one copy more (the fc2 input), the activation's output kept
    for the product's backward; the fused weighted SwiGLU keeps its input and writes the fc2
    input, as the unweighted one does."""
    f = model.moe_expert_ffn_size
    if model.activation is Activation.SWIGLU:
        return 3 * f if fused else 6 * f
    return 3 * f


def _router_bytes(model: ModelConfig) -> float:
    """Bytes the router and the permutation keep per token, with E experts and k chosen:

    - the choice: softmax after top-k keeps the k indices and the k probabilities; softmax
      before top-k (``moe_router_pre_softmax``) its output over all E and the k indices;
      sigmoid its output over all E and the k indices, and for k > 1 the k chosen scores and
      their sum, which normalise them.
    - the balancing loss's scores over all E (sigmoid: and their sum); none without one.
    - the z-loss: the fp32 logits and their logsumexp.
    - token dropping (a capacity factor): the routing map after dropping, 1 byte per expert.
    - the permutation: the argsort of the [E, tokens] routing map (the kept view of it holds
      all E x tokens indices), the tokens' indices and the permuted probabilities (one each
      per assignment); with capacity padding, per padded row two indices and a probability.
    """
    experts, k = model.num_experts, model.moe_router_topk
    sigmoid = model.moe_router_score_function is RouterScore.SIGMOID
    if sigmoid:
        choice = FP32 * experts + INDEX * k + ((FP32 * k + FP32) if k > 1 else 0)
    elif model.moe_router_pre_softmax:
        choice = FP32 * experts + INDEX * k
    else:
        choice = INDEX * k + FP32 * k
    balancing = 0
    if model.moe_router_load_balancing_type is not LoadBalancing.NONE:
        balancing = FP32 * experts + (FP32 if sigmoid else 0)
    z_loss = FP32 * experts + FP32 if model.moe_z_loss_coeff > 0 else 0
    rows = assignments(model)
    dropping = MASK * experts if model.moe_expert_capacity_factor is not None else 0
    if dropping and model.moe_pad_expert_input_to_capacity:
        permutation = (2 * INDEX + FP32) * rows
    else:
        permutation = INDEX * experts + (INDEX + FP32) * rows
    return choice + balancing + z_loss + dropping + permutation


def expert_bytes(model: ModelConfig, width: int, fused: bool) -> ExpertBytes:
    """The MoE sublayer's terms in an activation dtype of ``width`` bytes; ``fused``: the
    activation fusion (``Fusions.activation``). Its input, the branch's normalised input, is
    the dense MLP's too and is counted with the block."""
    rows = assignments(model)
    shared = model.moe_shared_expert_intermediate_size
    split = rows * _expert_values(model, fused) * width
    if shared:
        split += mlp_values(model, shared, fused) * width
    return ExpertBytes(router=_router_bytes(model), tokens=rows * model.hidden_size * width,
                       split=split)
