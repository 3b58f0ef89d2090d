"""Residual scheme -> megatron-core block spec: which layer class, which norms, which merge.

Variants are chosen here, by spec, never by branches inside a forward pass: each scheme's file
(``model/layers/<scheme>.py``) names the layer class of every block, and megatron's stock
TransformerLayer serves every Pre-Norm block, so single-stream Pre-Norm pays nothing for the
framework. Each block's spec is chosen from its global index, so schemes whose blocks differ
(Mix-LN's Post-Norm blocks, HybridNorm*'s Pre-Norm block 0) split the same way on every
pipeline layout. The norm backend, resolved once by the builder, reaches every norm here as a
spec parameter.
"""

from __future__ import annotations

from functools import partial

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
    get_transformer_layer_offset,
)

from kernels import normalizations
from kernels.backend import NormBackend
from kernels.norms import Norm
from model.attention import QKVNormSelfAttention
from model.backends import (
    AttentionBackend,
    TransformerImpl,
    resolve_attention_backend,
    resolve_transformer_impl,
    te_module,
)
from model.config import ModelConfig, require
from model.layers import SCHEME_FILES
from model.layers.base import LayerChoice, SchemeLayerSubmodules
from model.layers.merge import StreamMergeNorm
from model.local_attention import LocalAttention
from model.moe import is_moe_block, moe_spec
from model.schemes import FinalNorm, Normalization
from model.sdpa_attention import SDPAttention
from model.tp_linear import ColumnLinear, RowLinear


def plain_norm(model: ModelConfig, backend: NormBackend, site: str | None = None) -> ModuleSpec:
    """How every norm in the spec is built: megatron's ``TENorm`` (Transformer Engine's RMSNorm
    or LayerNorm, which tags its own weights for sequence parallelism) for the ``te`` backend,
    else :class:`~kernels.norms.Norm` computing with ``backend`` (torch or triton). Both take
    megatron's norm arguments and keep ``weight``/``bias`` names, so a checkpoint does not
    depend on the choice. ``site``: "attention" for a norm the spec places in an attention
    sublayer (a DyT alpha starts higher there); a scheme's layer gives its own norms theirs
    when it builds them (``SchemeLayer.build_norm``)."""
    if backend is NormBackend.TE:
        te_kinds = " and ".join(k.name for k in normalizations.KINDS.values()
                                if k.transformer_engine)
        require(model.normalization.kind.transformer_engine,
                f"kernels.norm_backend (te) computes {te_kinds} (Transformer Engine's norms), "
                f"not model.normalization {model.normalization}: set "
                "--kernels.norm_backend=torch (or triton on a GPU)")
        _require_norm_bias_for_te(model, "kernels.norm_backend (te)")
        return ModuleSpec(module=te_module("TENorm"))
    params = {"backend": backend, "bias": model.norm_bias, "kind": str(model.normalization),
              "starts": model.norm_starts}
    return ModuleSpec(module=Norm, params=params | ({"site": site} if site else {}))


def _require_norm_bias_for_te(model: ModelConfig, what: str) -> None:
    """Transformer Engine's LayerNorm always has a bias."""
    require(model.normalization is Normalization.RMSNORM or model.norm_bias,
            f"{what} needs model.norm_bias true with layernorm (Transformer Engine's "
            "LayerNorm always has a bias; got false)")


def linear_modules(model: ModelConfig) -> dict:
    """The linear-layer classes for ``model.transformer_impl``: megatron's, or Transformer
    Engine's plus its fused norm+linear (``norm_column``; None where there is none). TE is looked
    up only when chosen, and choosing it is only valid with CUDA (``model.backends``)."""
    if resolve_transformer_impl(model.transformer_impl) is TransformerImpl.TE:
        te_norms = model.normalization.kind.transformer_engine
        if te_norms:
            _require_norm_bias_for_te(model, "model.transformer_impl (te)")
        # TE fuses only its own norms into a linear; any other kind stays a module apart
        return {"column": te_module("TEColumnParallelLinear"),
                "row": te_module("TERowParallelLinear"),
                "norm_column": te_module("TELayerNormColumnParallelLinear") if te_norms
                else None}
    return {"column": ColumnLinear, "row": RowLinear, "norm_column": None}


def core_attention(model: ModelConfig):
    """The core-attention class for ``model.attention_backend``."""
    backend = resolve_attention_backend(model.attention_backend)
    if backend is AttentionBackend.TE:
        return te_module("TEDotProductAttention")
    return SDPAttention if backend is AttentionBackend.SDPA else LocalAttention


def attention_spec(model: ModelConfig, backend: NormBackend,
                   fuse_input_norm: bool = False) -> ModuleSpec:
    """Self-attention (with per-head Q/K norms for QK-norm schemes, Q/K/V norms for QKV-norm
    ones). ``fuse_input_norm``: the QKV projection applies the block's input norm itself (the
    layer's must be IdentityOp)."""
    traits = model.residual_scheme.traits
    head_norm = plain_norm(model, backend, "attention") if traits.head_norms else IdentityOp
    linears = linear_modules(model)
    return ModuleSpec(
        module=QKVNormSelfAttention if traits.qkv_norm else SelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=SelfAttentionSubmodules(
            linear_qkv=linears["norm_column"] if fuse_input_norm else linears["column"],
            core_attention=core_attention(model),
            linear_proj=linears["row"],
            q_layernorm=head_norm,
            k_layernorm=head_norm,
        ),
    )


def mlp_spec(model: ModelConfig, index: int, fuse_input_norm: bool = False):
    """The MLP sublayer F of global block ``index``: megatron's MLP, or in an MoE block its
    MoE layer (``model/moe.py``). ``fuse_input_norm``: fc1 applies the block's pre-MLP norm
    itself (never in an MoE block, whose router reads the normalised input too)."""
    linears = linear_modules(model)
    if is_moe_block(model, index):
        return moe_spec(model, linears)
    fc1 = linears["norm_column"] if fuse_input_norm else linears["column"]
    return partial(
        MLP.as_mlp_submodule,
        submodules=MLPSubmodules(linear_fc1=fc1, linear_fc2=linears["row"]),
    )


# Checkpoint names of the unfused Pre-Norm layer's norms, mapped to TE's fused names (megatron's
# own convention), so a checkpoint of one variant loads into the other.
_FUSED_NORM_KEYS = {
    "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
    "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
}


def pre_norm_layer_spec(model: ModelConfig, index: int, backend: NormBackend) -> ModuleSpec:
    """megatron's own Pre-Norm TransformerLayer for global block ``index``. With TE linears
    its input and pre-MLP norms are fused into the QKV and fc1 projections (TE's
    LayerNormLinear), as in megatron's TE spec; an MoE block keeps its pre-MLP norm apart
    (the router reads its output too)."""
    fused = linear_modules(model)["norm_column"] is not None
    moe = is_moe_block(model, index)
    fused_mlp = fused and not moe
    # Unfused norms take the fused names; an MoE block's pre-MLP norm is its own either way.
    keys = {} if fused else {k: v for k, v in _FUSED_NORM_KEYS.items()
                             if not (moe and k == "pre_mlp_layernorm.")}
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=IdentityOp if fused else plain_norm(model, backend, "attention"),
            self_attention=attention_spec(model, backend, fuse_input_norm=fused),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=IdentityOp if fused_mlp else plain_norm(model, backend),
            mlp=mlp_spec(model, index, fuse_input_norm=fused_mlp),
            mlp_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map=keys,
        ),
    )


def scheme_layer(model: ModelConfig, index: int) -> LayerChoice:
    """The layer class and parameters of global block ``index`` (0-based), from the scheme's
    own file; None for megatron's Pre-Norm layer."""
    return SCHEME_FILES[model.residual_scheme].layer(model, index)


def layer_spec(model: ModelConfig, index: int, backend: NormBackend) -> ModuleSpec:
    """The spec of global block ``index`` (0-based)."""
    choice = scheme_layer(model, index)
    if choice is None:
        return pre_norm_layer_spec(model, index, backend)
    layer_class, params = choice
    return ModuleSpec(
        module=layer_class,
        params={**params, "backend": backend},
        submodules=SchemeLayerSubmodules(
            self_attention=attention_spec(model, backend), mlp=mlp_spec(model, index),
            norm=plain_norm(model, backend),
        ),
    )


def final_norm(model: ModelConfig, backend: NormBackend) -> ModuleSpec | None:
    """What closes the decoder (the scheme's ``Traits.final``)."""
    final = model.residual_scheme.traits.final
    if final is FinalNorm.SCHEME:
        return SCHEME_FILES[model.residual_scheme].final_norm(model, plain_norm(model, backend))
    if final is FinalNorm.MERGE:
        return ModuleSpec(module=StreamMergeNorm,
                          params={"norm": plain_norm(model, backend), "backend": backend})
    return None if final is FinalNorm.NONE else plain_norm(model, backend)


def block_spec(model: ModelConfig, config, vp_stage: int | None, pp_rank: int,
               backend: NormBackend) -> TransformerBlockSubmodules:
    """The blocks this pipeline stage (and virtual stage) builds, each from its global index,
    every norm computing with ``backend`` (resolved: torch, triton or te)."""
    layers = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return TransformerBlockSubmodules(
        layer_specs=[layer_spec(model, offset + i, backend) for i in range(layers)],
        layer_norm=final_norm(model, backend),
    )
