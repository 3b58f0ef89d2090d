"""The residual schemes this framework trains, selectable by ``model.residual_scheme``."""

from __future__ import annotations

from enum import StrEnum


class ResidualScheme(StrEnum):
    PRE = "pre"  # h <- h + F(N(h)); final norm
    POST = "post"  # h <- N(h + F(h)); no final norm
    SIAMESE = "siamese"  # SiameseNorm post_pre: Post-Norm-like x and Pre-Norm-like y
    SIAMESE_HYBRID = "siamese_hybrid"  # SiameseNorm hybrid_pre: x follows HybridNorm
    DEEPNORM = "deepnorm"  # h <- N(alpha h + F(h)); branch weights initialised down by beta
    HYBRIDNORM = "hybridnorm"  # QKV-norm attention, Post-Norm around the MLP; final norm
    MIXLN = "mixln"  # Post-Norm in the first blocks, Pre-Norm in the rest; final norm

    @property
    def two_stream(self) -> bool:
        """Whether activations between blocks carry both streams ([s, b, 2h])."""
        return self in (ResidualScheme.SIAMESE, ResidualScheme.SIAMESE_HYBRID)

    @property
    def qkv_norm(self) -> bool:
        """Whether attention normalises Q, K and V per head after the projection."""
        return self in (ResidualScheme.SIAMESE_HYBRID, ResidualScheme.HYBRIDNORM)

    @property
    def ends_normalized(self) -> bool:
        """Whether every block ends in a norm (the Post-Norm family), so no final norm."""
        return self in (ResidualScheme.POST, ResidualScheme.DEEPNORM)

    @property
    def depth_scaled_output_init(self) -> bool:
        """Whether output projections start at std / sqrt(2 num_layers) (megatron's rule).
        DeepNorm's beta is its own depth down-scaling, so it starts them at the plain std."""
        return self is not ResidualScheme.DEEPNORM


class Normalization(StrEnum):
    RMSNORM = "rmsnorm"
    LAYERNORM = "layernorm"

    @property
    def megatron_name(self) -> str:
        return {"rmsnorm": "RMSNorm", "layernorm": "LayerNorm"}[self.value]


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
