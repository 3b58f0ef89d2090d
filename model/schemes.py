"""The residual schemes this framework trains, selectable by ``model.residual_scheme``."""

from __future__ import annotations

from enum import StrEnum


class ResidualScheme(StrEnum):
    PRE = "pre"  # h <- h + F(N(h)); final norm
    POST = "post"  # h <- N(h + F(h)); no final norm
    SIAMESE = "siamese"  # SiameseNorm post_pre: Post-Norm-like x and Pre-Norm-like y
    SIAMESE_HYBRID = "siamese_hybrid"  # SiameseNorm hybrid_pre: x follows HybridNorm

    @property
    def two_stream(self) -> bool:
        """Whether activations between blocks carry both streams ([s, b, 2h])."""
        return self in (ResidualScheme.SIAMESE, ResidualScheme.SIAMESE_HYBRID)

    @property
    def qkv_norm(self) -> bool:
        """Whether attention normalises Q, K and V per head after the projection."""
        return self is ResidualScheme.SIAMESE_HYBRID


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
