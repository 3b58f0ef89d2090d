"""What a run's first lines, its dry run and an exported model's README say of the model's
size and of its experts: one wording, from one place.

A mixture-of-experts model is named by two sizes, the total and what one token uses (the
active parameters, ``model.sizes``); where a line gives a dense model's size it gives both for
an MoE one, with how many experts, the top-k and how many blocks hold them. The expert layout
(ep, etp and the expert data parallelism they leave) is laid over the same ranks as the dense
one and differs from it, so every line that says the layout says both.
"""

from __future__ import annotations

from model.config import ModelConfig, ParallelConfig
from model.sizes import ParameterCount
from pretrain.report.units import count


def experts_text(m: ModelConfig) -> str:
    """'8 experts top-2 in 6 MoE blocks' (and the shared expert where there is one); '' for a
    dense model."""
    if not m.num_experts:
        return ""
    text = (f"{count(m.num_experts, 'expert')} top-{m.moe_router_topk} in "
            f"{count(sum(m.moe_blocks), 'MoE block')}")
    return text + (" with a shared expert" if m.moe_shared_expert_intermediate_size else "")


def sizes_text(m: ModelConfig, sizes: ParameterCount) -> str:
    """The start line's size: '6,171,520 parameters (6 layers x 128, 4 heads)', and for an MoE
    model '(6 layers x 128, 4 heads, 8 experts top-2 in 6 MoE blocks, 2,345,678 active per
    token)'."""
    shape = f"{m.num_layers} layers x {m.hidden_size}, {m.num_attention_heads} heads"
    if m.num_experts:
        shape += f", {experts_text(m)}, {sizes.active(m):,} active per token"
    return f"{sizes.total:,} parameters ({shape})"


def expert_layout_text(m: ModelConfig, p: ParallelConfig, world: int) -> str:
    """'; experts: ep 2 x etp 1 x pp 1 x expert dp 2' after a layout line, for a model with
    experts ('' for a dense one): how the routed experts are split over the ``world`` ranks."""
    if not m.num_experts:
        return ""
    return (f"; experts: ep {p.ep} x etp {p.expert_tp} x pp {p.pp} x expert dp "
            f"{world // (p.expert_tp * p.ep * p.pp)}")
