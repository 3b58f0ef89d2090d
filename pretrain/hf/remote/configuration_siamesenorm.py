"""Configuration of the SiameseNorm-family causal language models (remote code).

The fields mirror the training framework's ``model.*`` fields of the same meaning, so a
folder's ``config.json`` states the model exactly as it was trained: the residual scheme
(``pre``, ``post``, ``siamese``, ``siamese_hybrid``, ``deepnorm``, ``hybridnorm``, ``mixln``,
``hc``, ``periln``, ``olmo2``, ``mhc``) and the switches only some schemes read, and for a
mixture of experts (``num_experts`` > 0) megatron's fields of what routes a token and what
computes it.
"""

import os
import warnings

import transformers
from packaging.specifiers import SpecifierSet

try:
    from transformers import PreTrainedConfig as _Config
except ImportError:  # transformers 4.x
    from transformers import PretrainedConfig as _Config

# The transformers releases this code is tested on: from the oldest release of the range to
# the newest one (``make test-hf-versions`` runs both ends), up to but not including the next
# minor release. A release outside it is refused at import: 5.24 renamed the argument that
# carries the KV cache, and code written for 5.23 then generated wrong text without an error.
SUPPORTED_TRANSFORMERS = ">=4.57,<5.25"
ANY_TRANSFORMERS = "SIAMESENORM_ANY_TRANSFORMERS"  # =1: load anyway, with a warning


def check_transformers():
    """ImportError (or, with the escape hatch, a warning) outside the supported range."""
    version = transformers.__version__
    if SpecifierSet(SUPPORTED_TRANSFORMERS).contains(version, prereleases=True):
        return
    why = (f"this SiameseNorm model supports transformers {SUPPORTED_TRANSFORMERS}, "
           f"not {version}")
    if os.environ.get(ANY_TRANSFORMERS) == "1":
        warnings.warn(f"{why}; loading it untested because {ANY_TRANSFORMERS}=1", stacklevel=2)
        return
    raise ImportError(f"{why}: install a release in that range (or set {ANY_TRANSFORMERS}=1 "
                      "to try this one untested)")


check_transformers()

# <generated: remote-schemes> python -m pretrain.report.scheme_lists --write
SCHEMES = ("pre", "post", "siamese", "siamese_hybrid", "deepnorm", "hybridnorm", "mixln", "hc",
           "periln", "olmo2", "mhc")
"""The residual schemes this code builds (``ResidualScheme``, in its order)."""
NORMALIZATIONS = ("rmsnorm", "layernorm", "dyt")
"""The normalizations ``modeling_siamesenorm.Norm`` computes (the registered kinds,
``kernels.normalizations``)."""
FINAL_NORMS = {
    "pre": "norm",
    "post": "none",
    "siamese": "merge",
    "siamese_hybrid": "merge",
    "deepnorm": "none",
    "hybridnorm": "norm",
    "mixln": "norm",
    "hc": "scheme",
    "periln": "norm",
    "olmo2": "norm",
    "mhc": "scheme",
}
"""What closes each scheme's decoder (``Traits.final``, ``FinalNorm``): "norm", "none", "merge"
(SiameseNorm's), or "scheme", its own."""
FP32_MODULES = {
    "siamese_hybrid": ("attn_gate",),
    "mhc": ("attn_mhc", "mlp_mhc"),
}
"""Per scheme, the modules that compute in fp32 (``Traits.fp32``): their weights stay fp32
when a model loads in bf16 or fp16 (``_keep_in_fp32_modules_strict``)."""
EXPERT_FP32_MODULES = ("router",)
"""The modules of every scheme's MoE blocks that compute in fp32 (``EXPERT_FP32``),
kept in fp32 in a model with experts as ``FP32_MODULES`` are."""
# </generated>


ROUTER_SCORES = ("softmax", "sigmoid")
"""The router score functions this code computes (megatron's ``moe_router_score_function``)."""


class SiameseNormConfig(_Config):
    model_type = "siamesenorm"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size: int = 256,
        hidden_size: int = 64,
        intermediate_size: int = 256,
        num_hidden_layers: int = 2,
        num_attention_heads: int = 4,
        num_key_value_heads: int | None = None,
        max_position_embeddings: int = 64,
        residual_scheme: str = "siamese",
        normalization: str = "rmsnorm",
        norm_eps: float = 1e-5,
        norm_bias: bool = False,
        activation: str = "swiglu",
        position_embedding: str = "rope",
        rope_theta: float = 10000.0,
        add_bias_linear: bool = False,
        hybrid_first_block: str = "hybrid",
        mixln_post_ratio: float = 0.25,
        siamese_input_norm: bool = True,
        siamese_depth_constant: bool = True,
        hc_rate: int = 4,
        hc_dynamic: bool = True,
        mhc_sinkhorn_iterations: int = 20,
        initializer_range: float = 0.02,
        tie_word_embeddings: bool = False,
        num_experts: int = 0,
        moe_layer_freq=1,
        moe_router_topk: int = 2,
        moe_ffn_hidden_size: int | None = None,
        moe_shared_expert_intermediate_size: int | None = None,
        moe_shared_expert_gate: bool = False,
        moe_router_score_function: str = "softmax",
        moe_router_pre_softmax: bool = False,
        moe_router_enable_expert_bias: bool = False,
        **kwargs,
    ):
        if residual_scheme not in SCHEMES:
            raise ValueError(f"residual_scheme ({residual_scheme!r}) must be one of "
                             f"{', '.join(SCHEMES)}")
        if normalization not in NORMALIZATIONS:
            raise ValueError(f"normalization ({normalization!r}) must be one of "
                             f"{', '.join(NORMALIZATIONS)}")
        if moe_router_score_function not in ROUTER_SCORES:
            raise ValueError(f"moe_router_score_function ({moe_router_score_function!r}) must "
                             f"be one of {', '.join(ROUTER_SCORES)}")
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.head_dim = hidden_size // num_attention_heads
        self.max_position_embeddings = max_position_embeddings
        self.residual_scheme = residual_scheme
        self.normalization = normalization
        self.norm_eps = norm_eps
        self.norm_bias = norm_bias
        self.activation = activation
        self.position_embedding = position_embedding
        self.rope_theta = rope_theta
        self.add_bias_linear = add_bias_linear
        self.hybrid_first_block = hybrid_first_block
        self.mixln_post_ratio = mixln_post_ratio
        self.siamese_input_norm = siamese_input_norm
        self.siamese_depth_constant = siamese_depth_constant
        self.hc_rate = hc_rate
        self.hc_dynamic = hc_dynamic
        self.mhc_sinkhorn_iterations = mhc_sinkhorn_iterations
        self.initializer_range = initializer_range
        # mixture of experts (megatron's names); 0 experts: every block's MLP is dense
        self.num_experts = num_experts
        self.moe_layer_freq = moe_layer_freq
        self.moe_router_topk = moe_router_topk
        self.moe_ffn_hidden_size = moe_ffn_hidden_size or intermediate_size
        self.moe_shared_expert_intermediate_size = moe_shared_expert_intermediate_size
        self.moe_shared_expert_gate = moe_shared_expert_gate
        self.moe_router_score_function = moe_router_score_function
        self.moe_router_pre_softmax = moe_router_pre_softmax
        self.moe_router_enable_expert_bias = moe_router_enable_expert_bias
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
