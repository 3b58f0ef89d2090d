"""The residual schemes this framework trains (``model.residual_scheme``) and the model's other
choice fields.

A scheme is one member of :class:`ResidualScheme`, carrying its :class:`Traits` (everything the
config checks, the megatron config, the spec and the dry run need to know about it), plus one
file, ``model/layers/<value>.py``, whose ``layer(model, index)`` says which layer class builds
each block (listed in ``model.layers.SCHEME_FILES``). This module is a leaf: the enums here are
read by the config and the layers alike, and it imports neither.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from kernels import normalizations
from model.kept import Kept, hyper_connections, manifold_hyper_connections, norms_only, two_stream

# What the traits' functions are called with: the ModelConfig being built (not imported here,
# since the config imports this module).
ModelConfig = Any


class FinalNorm(StrEnum):
    """What closes the decoder before the output layer."""

    NORM = "norm"  # one plain norm (blocks end un-normalised)
    NONE = "none"  # nothing: every block already ends in a norm (the Post-Norm family)
    MERGE = "merge"  # SiameseNorm's merge of the two streams, Nfinal(Na(x) + Nb(y))
    SCHEME = "scheme"  # the scheme's own: its file's final_norm(model, norm) spec


def _never(_model: ModelConfig) -> bool:
    return False


def _always(_model: ModelConfig) -> bool:
    return True


def _one(_model: ModelConfig) -> int:
    return 1


def _two(_model: ModelConfig) -> int:
    return 2


def _hc_rate(model: ModelConfig) -> int:
    return model.hc_rate


def _with_prenorm_first_block(model: ModelConfig) -> bool:
    return model.hybrid_first_block is not FirstBlock.HYBRID


@dataclass(frozen=True)
class Traits:
    two_stream: bool = False
    """SiameseNorm's x and y streams: activations between blocks are packed as [s, b, 2h]
    (model.streams), merged at the end."""
    streams: Callable[[ModelConfig], int] = _one
    """How many residual streams activations between blocks carry, packed as [s, b, n h]
    (``ModelConfig.residual_streams``)."""
    qkv_norm: bool = False
    """Attention normalises Q, K and V per head after the projection."""
    qk_norm: bool = False
    """Attention normalises Q and K per head after the projection (megatron's own
    ``qk_layernorm``), V as projected; ``qkv_norm`` includes it."""
    final: FinalNorm = FinalNorm.NORM
    depth_scaled_output_init: bool = True
    """Output projections start at std / sqrt(2 num_layers) (megatron's rule)."""
    fields: tuple[str, ...] = ()
    """Model fields only this scheme reads; under other schemes they must keep their default."""
    blocks_differ: Callable[[ModelConfig], bool] = _never
    """Whether some blocks hold other parameters than the rest, so checkpoints key each block
    by its global index instead of stacking them."""
    kept: Kept = norms_only(2)
    """What one block keeps for backward per token outside its attention and MLP (the dry
    run's memory estimate; :mod:`model.kept`): which norms it applies, and what else it keeps.
    ``tests/bench/test_saved_activations.py`` holds every scheme's estimate to the tensors
    autograd keeps, under every normalization."""

    fp32: tuple[str, ...] = ()
    """The scheme's own modules (by attribute name) that compute in fp32 whatever the
    activation dtype, their outputs rounded once to it: the one list of a scheme's fp32
    computations. ``tests/model/test_precision.py`` holds each to its fp32 computation in a
    bf16 model, and the Hugging Face remote code keeps their weights in fp32 when a model loads
    in bf16 (``FP32_MODULES`` of its configuration, generated from this). A model with experts
    adds :data:`EXPERT_FP32`, whatever its scheme."""

    @property
    def head_norms(self) -> bool:
        """Attention normalises Q and K per head (and V too under ``qkv_norm``)."""
        return self.qk_norm or self.qkv_norm


EXPERT_FP32: tuple[str, ...] = ("router",)
"""The modules of every scheme's mixture-of-experts blocks that compute in fp32 whatever the
activation dtype (with ``Traits.fp32`` the one list of fp32 computations): megatron's router,
run with ``moe_router_dtype`` fp32 (``model/megatron_config.py``) so that its logits, scores
and top-k choice do not flip routing on bf16 rounding ties; its probabilities stay fp32 until
they scale the experts' activations. ``tests/model/test_precision.py`` holds it to its fp32
computation in a bf16 model, and the Hugging Face remote code keeps its weights (and the
expert bias) in fp32 when a model with experts loads in bf16 (``EXPERT_FP32_MODULES`` of its
configuration, generated from this)."""

_SIAMESE_FIELDS = ("siamese_input_norm", "siamese_depth_constant")


class ResidualScheme(StrEnum):
    traits: Traits

    def __new__(cls, value: str, traits: Traits):
        member = str.__new__(cls, value)
        member._value_ = value
        member.traits = traits
        return member

    # h <- h + F(N(h)); final norm
    PRE = "pre", Traits()
    # h <- N(h + F(h)); no final norm
    POST = "post", Traits(final=FinalNorm.NONE)
    # SiameseNorm post_pre: Post-Norm-like x and Pre-Norm-like y
    SIAMESE = "siamese", Traits(two_stream=True, streams=_two, final=FinalNorm.MERGE,
                                fields=_SIAMESE_FIELDS, kept=two_stream(gate=False))
    # SiameseNorm hybrid_pre: x follows HybridNorm
    SIAMESE_HYBRID = "siamese_hybrid", Traits(
        two_stream=True, streams=_two, qkv_norm=True, final=FinalNorm.MERGE,
        fields=(*_SIAMESE_FIELDS, "hybrid_first_block"),
        blocks_differ=_with_prenorm_first_block, kept=two_stream(gate=True),
        fp32=("attn_gate",))
    # h <- N(alpha h + F(h)); branch weights initialised down by beta (its own depth scaling)
    DEEPNORM = "deepnorm", Traits(final=FinalNorm.NONE, depth_scaled_output_init=False)
    # QKV-norm attention, Post-Norm around the MLP; final norm
    HYBRIDNORM = "hybridnorm", Traits(qkv_norm=True, fields=("hybrid_first_block",),
                                      blocks_differ=_with_prenorm_first_block,
                                      kept=norms_only(1))
    # Post-Norm in the first blocks, Pre-Norm in the rest; final norm
    MIXLN = "mixln", Traits(fields=("mixln_post_ratio",), blocks_differ=_always)
    # Hyper-connections: n streams, each sublayer reads a mix and writes into all; summed at
    # the end, then a norm
    HC = "hc", Traits(streams=_hc_rate, final=FinalNorm.SCHEME, fields=("hc_rate", "hc_dynamic"),
                      kept=hyper_connections)
    # Peri-LN: h <- h + Nout(F(Nin(h))); final norm
    PERILN = "periln", Traits(kept=norms_only(4))
    # OLMo 2: h <- h + N(F(h)) with QK-norm; final norm; no depth-scaled init
    OLMO2 = "olmo2", Traits(qk_norm=True, depth_scaled_output_init=False)
    # Manifold-constrained hyper-connections: n streams mixed by a doubly stochastic H_res,
    # read through H_pre, written through H_post; summed at the end, then a norm
    MHC = "mhc", Traits(streams=_hc_rate, final=FinalNorm.SCHEME,
                        fields=("hc_rate", "mhc_sinkhorn_iterations"),
                        kept=manifold_hyper_connections, fp32=("attn_mhc", "mlp_mhc"))


def schemes_reading(field: str) -> tuple[ResidualScheme, ...]:
    """The schemes that read a scheme-specific model field, by name."""
    return tuple(sorted(s for s in ResidualScheme if field in s.traits.fields))


SCHEME_FIELDS = frozenset(f for s in ResidualScheme for f in s.traits.fields)


class FirstBlock(StrEnum):
    """Block 0 of hybridnorm and siamese_hybrid (``model.hybrid_first_block``).

    HybridNorm's "*" variant gives block 0 a Pre-Norm attention. The official SiameseNorm code
    expresses it as the per-block flag ``{0: {'attn_norm': True, 'ffn_residual': False}}``;
    SIAMESENORM.md words it "attn norm on, no post-norm before its MLP". The two readings differ
    in what block 0's MLP reads from x, so both exist, by name.
    """

    HYBRID = "hybrid"
    """Block 0 is built like every other block."""
    PRENORM = "prenorm"
    """The official code's flag: the attention reads N(x) + Npre(y) (no gate); the MLP reads
    Nin(N(x) + Npre(y)) while x keeps its un-normalised residual (a Pre-Norm MLP)."""
    PRENORM_LITERAL = "prenorm_literal"
    """SIAMESENORM.md's wording (siamese_hybrid only): the attention as ``prenorm``; the MLP
    reads Nin(x + Npre(y)), with no norm on x at all."""


class InitMethod(StrEnum):
    """How random weights are drawn (``model.init``); the std is ``model.init_method_std``."""

    NORMAL = "normal"
    """megatron's: normal(0, std); output projections (attention out, fc2) std / sqrt(2 L);
    the untied output layer std."""
    FULL_MEGATRON = "full_megatron"
    """OLMo's ``full_megatron``, the official SiameseNorm runs': as ``normal`` but every draw
    truncated at +-3 std, and an untied output layer at std 1 / sqrt(hidden_size)."""


class _Normalization(StrEnum):
    @property
    def kind(self) -> normalizations.NormKind:
        """The registered kind (``kernels.normalizations``): what a norm of it holds and does."""
        return normalizations.kind(self.value)

    @property
    def megatron_name(self) -> str:
        return self.kind.megatron_name


Normalization = _Normalization("Normalization", {name.upper(): name
                                                 for name in normalizations.KINDS},
                               module=__name__)
"""``model.normalization``: one member per registered kind (``kernels.normalizations``), so a
kind declared there is a config choice with nothing else to list."""


class Activation(StrEnum):
    SWIGLU = "swiglu"
    GELU = "gelu"


class PositionEmbedding(StrEnum):
    ROPE = "rope"
    LEARNED = "learned_absolute"


class Recompute(StrEnum):
    NONE = "none"
    SELECTIVE = "selective"  # megatron's core-attention recompute
    FULL = "full"  # whole layers, uniform chunks of parallel.recompute_num_layers


class LoadBalancing(StrEnum):
    """How the router of a mixture-of-experts block is pushed towards an even load
    (``model.moe_router_load_balancing_type``, megatron's names)."""

    AUX_LOSS = "aux_loss"
    """The Switch/GShard auxiliary loss over each micro-batch's tokens."""
    SEQ_AUX_LOSS = "seq_aux_loss"
    """The same loss per sequence, averaged (DeepSeek-V2's), which balances within documents."""
    GLOBAL_AUX_LOSS = "global_aux_loss"
    """The loss over the tokens of every data-parallel rank (the global-batch balance)."""
    NONE = "none"
    """No balancing loss (with ``moe_router_enable_expert_bias``: the loss-free balance)."""


class RouterScore(StrEnum):
    """The router's score function (``model.moe_router_score_function``)."""

    SOFTMAX = "softmax"
    SIGMOID = "sigmoid"


class TokenDropPolicy(StrEnum):
    """Which tokens an expert over its capacity drops (``model.moe_token_drop_policy``)."""

    PROBS = "probs"
    """Those it was given with the lowest router probability."""
    POSITION = "position"
    """Those furthest into the micro-batch."""
