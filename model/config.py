"""Model and parallel-layout configuration, checked when it is built.

Every rule a user can break is checked here, before megatron sees the values, and reported as
one :class:`ConfigError` line naming the field, the rule and the value(s), e.g.
``parallel.tp (2) must divide model.num_attention_heads (3)``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from dataclasses import dataclass
from enum import StrEnum

from kernels import normalizations
from model.backends import (
    AttentionBackend,
    MegatronFusions,
    TransformerImpl,
)
from model.schemes import (
    SCHEME_FIELDS,
    Activation,
    FirstBlock,
    InitMethod,
    LoadBalancing,
    Normalization,
    PositionEmbedding,
    Recompute,
    ResidualScheme,
    RouterScore,
    TokenDropPolicy,
    schemes_reading,
)
from runtime import device
from runtime.errors import ConfigError, Findings


def require(ok: bool, message: str) -> None:
    """Raise ``message`` as a :class:`ConfigError` unless ``ok``: the one-line rule check."""
    if not ok:
        raise ConfigError(message)


def coerce_choices(section: str, obj) -> None:
    """Turn the strings given for choice fields (declared as a StrEnum) into their enum,
    naming the field and the choices on failure. Every config dataclass calls it from
    ``__post_init__``, so a config built in Python is checked like one read from TOML. Every
    field given a value that is not a choice is reported, one line each."""
    hints = typing.get_type_hints(type(obj))
    with Findings() as found:
        for field in dataclasses.fields(obj):
            enum_type = hints[field.name]
            if not (isinstance(enum_type, type) and issubclass(enum_type, StrEnum)):
                continue
            value = getattr(obj, field.name)
            try:
                setattr(obj, field.name, enum_type(value))
            except ValueError:
                choices = ", ".join(e.value for e in enum_type)
                found.require(False, f"{section}.{field.name} ({value!r}) must be one of: "
                              f"{choices}")


DYT_ALPHAS = ((0, 0.8, 0.2), (5120, 0.6, 0.15), (8192, 0.2, 0.05))
"""The DyT paper's alpha starts for LLMs ("Transformers without Normalization", its LLaMA runs:
7B at width 4096, 13B at 5120, 34B and 70B at 8192): (from this hidden size on, the attention
sublayer's norms, every other norm). A width between two of its models takes the narrower
one's values; below 4096 the 7B's."""


@dataclass
class ModelConfig:
    """Shape and residual scheme of a decoder-only transformer."""

    residual_scheme: ResidualScheme = ResidualScheme.SIAMESE
    """Which residual scheme the blocks follow, one of ``ResidualScheme`` (model/schemes.py;
    the reference lists them from it); each scheme's equations are in its layer's docstring,
    model/layers (one file per scheme)."""
    num_layers: int = 2
    """Transformer blocks, each an attention and an MLP sublayer (L in the schemes'
    equations); parallel.pp x parallel.vp must divide it."""
    hidden_size: int = 64
    """Width of the embeddings and of each residual stream (two-stream schemes carry two of
    this width, hc and mhc carry hc_rate)."""
    num_attention_heads: int = 4
    """Query heads; each has hidden_size / num_attention_heads channels, so it must divide
    hidden_size (and parallel.tp must divide it)."""
    num_query_groups: int | None = None
    """Grouped-query attention: number of K/V heads (default: one per query head)."""
    ffn_hidden_size: int | None = None
    """MLP width (default 4 * hidden_size)."""
    vocab_size: int = 256
    """Tokenizer vocabulary; the embedding is padded to make_vocab_size_divisible_by."""
    make_vocab_size_divisible_by: int = 128
    """The embedding and output layer hold vocab_size rounded up to a multiple of this (not
    of the parallel layout, so a checkpoint reshards); parallel.tp must divide the result."""
    seq_length: int = 64
    """Longest sequence the model accepts (learned position table size)."""
    normalization: Normalization = Normalization.RMSNORM
    """rmsnorm | layernorm | dyt: the kind of every norm of the model (the scheme's, the Q/K
    head norms, the final one); the registered kinds (kernels/normalizations.py). dyt: Dynamic
    Tanh, w tanh(alpha x) + b with a learned scalar alpha per norm (model.dyt_alpha), no
    statistics; computed by its fp32 reference under every backend (the fused Triton kernels
    compute rmsnorm and layernorm only), not by Transformer Engine."""
    dyt_alpha: float = 0.0
    """normalization dyt: where every norm's alpha starts; 0: by the DyT paper's rule for LLMs
    (its LLaMA runs: the norms of each block's attention sublayer and its Q/K head norms
    higher than the rest, both lower as the model widens; model.config.DYT_ALPHAS). Outside
    LLMs the paper starts every alpha at 0.5."""
    norm_eps: float = 1e-5
    """Epsilon added to the variance in every norm."""
    norm_bias: bool = False
    """layernorm only: every LayerNorm (Q/K/V head norms included) has a learnable bias. Off
    by default, as in the official SiameseNorm configs (``include_bias`` false)."""
    activation: Activation = Activation.SWIGLU
    """swiglu | gelu: the MLP's activation. swiglu is gated: fc1 computes a gate and a value
    of ffn_hidden_size each, SiLU(gate) x value goes to fc2; gelu is the exact GELU."""
    position_embedding: PositionEmbedding = PositionEmbedding.ROPE
    """rope | learned_absolute: rotary embeddings of Q and K in every attention, or a learned
    table of seq_length positions added to the token embeddings."""
    rotary_base: int = 10000
    """rope only: the base of the rotary frequencies (theta)."""
    add_bias_linear: bool = False
    """Every linear layer (QKV, the attention output, both MLP layers) has a bias. Off, as in
    the official SiameseNorm configs."""
    untie_embeddings_and_output_weights: bool = True
    """true: the output layer has its own weights; false: it reuses the input embedding's."""
    init_method_std: float = 0.02
    """Standard deviation of the normal draws of random weights (output projections scaled
    down with depth; the rules per weight are in model/init.py)."""
    init: InitMethod = InitMethod.NORMAL
    """normal | full_megatron: how random weights are drawn (model.schemes.InitMethod). Either way
    every weight is a function of run.seed and its checkpoint key only (model/init.py), so all
    parallel layouts start from the same model."""
    hidden_dropout: float = 0.0
    """Dropout probability on the embeddings and on each sublayer's output before it joins the
    residual stream."""
    attention_dropout: float = 0.0
    """Dropout probability on the attention probabilities."""
    attention_backend: AttentionBackend = AttentionBackend.AUTO
    """auto | sdpa | local | te: core attention. sdpa: torch's fused scaled_dot_product_attention;
    local: megatron's DotProductAttention (materialises the s x s scores); te: Transformer
    Engine's flash/cuDNN attention. auto: te when TE is installed on a CUDA machine, else sdpa."""
    transformer_impl: TransformerImpl = TransformerImpl.AUTO
    """auto | local | te: linear layers. te: Transformer Engine's linears, with the norm fused
    into the QKV and fc1 projections in Pre-Norm blocks; local: megatron's. auto: te when TE
    is installed on a CUDA machine, else local. Norms the schemes own stay kernels.norms.Norm."""
    megatron_fusions: MegatronFusions = MegatronFusions.AUTO
    """auto | on | off: megatron-core's fused kernels that need no TE (SwiGLU with its bias,
    if any, in one kernel; bias + dropout + residual add in Pre-Norm blocks; in bf16 runs the
    native fused cross-entropy) and, with TE, its fused RoPE and, with TE linears, the weight
    gradients accumulated straight into the fp32 main grads. auto: on with CUDA, off on the
    CPU (they are torch.compile'd). Same function either way, to fp32 rounding."""
    hybrid_first_block: FirstBlock = FirstBlock.HYBRID
    """hybridnorm and siamese_hybrid: hybrid | prenorm | prenorm_literal. prenorm is
    HybridNorm* as the official code computes it; prenorm_literal is SIAMESENORM.md's wording
    (siamese_hybrid only). The equations are in model/schemes.py FirstBlock."""
    mixln_post_ratio: float = 0.25
    """mixln only: the first floor(ratio * num_layers) blocks are Post-Norm, the rest Pre-Norm."""
    siamese_input_norm: bool = True
    """siamese and siamese_hybrid: false drops the input norms Nin of the merged branch input
    (the paper's ablation)."""
    siamese_depth_constant: bool = True
    """siamese and siamese_hybrid: false sets c_l = 1 (the paper's ablation)."""
    hc_rate: int = 4
    """hc and mhc: the expansion rate n, the number of residual streams."""
    hc_dynamic: bool = True
    """hc only: true for dynamic hyper-connections (per-token weights, the paper's DHC),
    false for the static ones."""
    mhc_sinkhorn_iterations: int = 20
    """mhc only: Sinkhorn-Knopp iterations (each a row and a column normalisation) that
    project each token's residual mixing matrix H_res onto the doubly stochastic matrices
    (the paper's t_max = 20)."""

    num_experts: int = 0
    """Mixture of experts: routed experts in the MLP sublayer of each MoE block (megatron's
    ``num_moe_experts``); 0 (the default) is a dense model and every other ``moe_*`` field
    must stay at its default. The scheme's equations are unchanged: F of an MoE block is
    megatron's MoE layer (router, token dispatcher, experts) instead of one MLP."""
    moe_layer_freq: int | list[int] = 1
    """Which blocks are MoE (megatron's ``moe_layer_freq``): k makes every k-th block MoE,
    from block 0; a list gives one 0 (dense) or 1 (MoE) per block."""
    moe_router_topk: int = 2
    """Experts each token is routed to (k of top-k); at most ``num_experts``."""
    moe_ffn_hidden_size: int | None = None
    """Width of each routed expert's MLP (default ``ffn_hidden_size``); SwiGLU experts hold
    a gate and a value of this width."""
    moe_shared_expert_intermediate_size: int | None = None
    """Width of the shared expert every token also passes through (DeepSeekMoE's; megatron's
    name), none by default. Several shared experts are one of their summed width. It has no
    linear biases (megatron's), so not with ``add_bias_linear``."""
    moe_router_load_balancing_type: LoadBalancing = LoadBalancing.AUX_LOSS
    """aux_loss | seq_aux_loss | global_aux_loss | none: the router's balancing loss
    (model.schemes.LoadBalancing)."""
    moe_aux_loss_coeff: float = 1e-2
    """Weight of the balancing loss in the training loss (megatron's default is 0; 1e-2 is
    the Switch Transformer's and Megatron-LM's MoE examples')."""
    moe_z_loss_coeff: float = 0.0
    """Weight of the router z-loss (ST-MoE's: the squared log-sum-exp of the router's logits,
    which keeps them small); 0 turns it off, 1e-3 is ST-MoE's value."""
    moe_router_score_function: RouterScore = RouterScore.SOFTMAX
    """softmax | sigmoid: how the router turns its logits into scores."""
    moe_router_pre_softmax: bool = False
    """softmax only: the softmax over all experts' logits, then the top k of those
    probabilities (the Switch Transformer's, needed for top-1); false (megatron's default):
    the top k logits first, then a softmax over those k (Mixtral's), whose weights sum to 1."""
    moe_router_enable_expert_bias: bool = False
    """The auxiliary-loss-free balance (DeepSeek-V3): a per-expert bias added to the scores
    for the top-k choice only, moved after each step towards the under-loaded experts by
    ``moe_router_bias_update_rate``. Needs the sigmoid score function."""
    moe_router_bias_update_rate: float = 1e-3
    """Step of the expert-bias update (DeepSeek-V3's 1e-3)."""
    moe_expert_capacity_factor: float | None = None
    """Token dropping: each expert takes at most this factor times its even share of a
    micro-batch's routed tokens and drops the rest (the dropped tokens' MoE output is 0;
    the residual stream carries them). None (the default) drops nothing."""
    moe_token_drop_policy: TokenDropPolicy = TokenDropPolicy.PROBS
    """probs | position: which tokens an expert over its capacity drops."""
    moe_pad_expert_input_to_capacity: bool = False
    """With a capacity factor: pad every expert's input to its capacity, so the expert
    matmuls have a fixed shape."""

    def __post_init__(self) -> None:
        coerce_choices("model", self)

    @property
    def kv_heads(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def norm_starts(self) -> dict[str, float]:
        """The start values a normalization's parameters take from the config, by name (and
        by site: ``dyt_alpha_attention`` for the norms of an attention sublayer and the head
        norms; ``kernels.norms.Norm``)."""
        if self.dyt_alpha > 0:
            return {"dyt_alpha": self.dyt_alpha, "dyt_alpha_attention": self.dyt_alpha}
        attention, other = next((a, o) for width, a, o in reversed(DYT_ALPHAS)
                                if self.hidden_size >= width)
        return {"dyt_alpha": other, "dyt_alpha_attention": attention}

    @property
    def moe_expert_ffn_size(self) -> int:
        """Width of each routed expert's MLP."""
        return self.moe_ffn_hidden_size or self.ffn_size

    @property
    def blocks_differ(self) -> bool:
        """Whether some blocks hold other parameters than the rest (Mix-LN's split, HybridNorm*'s
        block 0, MoE blocks among dense ones), so checkpoints key each block by its global
        index instead of stacking them."""
        return self.residual_scheme.traits.blocks_differ(self) or len(set(self.moe_blocks)) > 1

    @property
    def moe_blocks(self) -> list[bool]:
        """Per global block, whether its MLP sublayer is MoE (megatron's ``moe_layer_freq``:
        every k-th block from block 0, or a 0/1 list); all False for a dense model."""
        if not self.num_experts:
            return [False] * self.num_layers
        freq = self.moe_layer_freq
        if isinstance(freq, list):
            return [bool(f) for f in freq]
        return [index % freq == 0 for index in range(self.num_layers)]

    @property
    def residual_streams(self) -> int:
        """Residual streams the activations between blocks carry ([s, b, n h])."""
        return self.residual_scheme.traits.streams(self)

    @property
    def padded_vocab_size(self) -> int:
        """Vocabulary padded to a multiple that does not depend on the parallel layout, so a
        checkpoint's embedding has one shape under every TP size."""
        m = self.make_vocab_size_divisible_by
        return int(math.ceil(self.vocab_size / m) * m)

    def validate(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size",
                     "seq_length", "make_vocab_size_divisible_by"):
            value = getattr(self, name)
            require(isinstance(value, int) and value >= 1,
                     f"model.{name} ({value!r}) must be a positive integer")
        require(self.hidden_size % self.num_attention_heads == 0,
                 f"model.num_attention_heads ({self.num_attention_heads}) must divide "
                 f"model.hidden_size ({self.hidden_size})")
        require(self.kv_heads >= 1 and self.num_attention_heads % self.kv_heads == 0,
                 f"model.num_query_groups ({self.num_query_groups}) must divide "
                 f"model.num_attention_heads ({self.num_attention_heads})")
        require(self.ffn_size >= 1, f"model.ffn_hidden_size ({self.ffn_hidden_size}) must be "
                 "a positive integer")
        require(self.norm_eps > 0, f"model.norm_eps ({self.norm_eps}) must be > 0")
        optional_bias = [k.name for k in normalizations.KINDS.values()
                         if any(p.optional and p.name == "bias" for p in k.parameters)]
        require(not self.norm_bias or self.normalization in optional_bias,
                f"model.norm_bias (true) requires model.normalization "
                f"{' or '.join(optional_bias)} (got {self.normalization}): the others have "
                "no bias to switch (dyt always has one)")
        require(self.dyt_alpha >= 0,
                f"model.dyt_alpha ({self.dyt_alpha}) must be >= 0 (0: the DyT paper's rule)")
        require(self.hybrid_first_block is not FirstBlock.PRENORM_LITERAL
                or self.residual_scheme is ResidualScheme.SIAMESE_HYBRID,
                f"model.hybrid_first_block (prenorm_literal) is the wording of the two-stream "
                f"siamese_hybrid; {self.residual_scheme} takes hybrid or prenorm")
        require(self.init_method_std > 0,
                 f"model.init_method_std ({self.init_method_std}) must be > 0")
        for name in ("hidden_dropout", "attention_dropout"):
            value = getattr(self, name)
            require(0.0 <= value < 1.0, f"model.{name} ({value}) must be in [0, 1)")
        for name in ("attention_backend", "transformer_impl"):
            if getattr(self, name) == "te":  # the check looks for CUDA before TE
                missing = device.te_unavailable_reason()
                require(missing is None, f"model.{name} (te) needs Transformer Engine on a "
                         f"CUDA machine ({missing}); use auto")
        if self.position_embedding is PositionEmbedding.ROPE:
            require((self.hidden_size // self.num_attention_heads) % 2 == 0,
                     f"model.hidden_size / model.num_attention_heads "
                     f"({self.hidden_size // self.num_attention_heads}) must be even for rope")
        require(isinstance(self.hc_rate, int) and not isinstance(self.hc_rate, bool)
                and self.hc_rate >= 1, f"model.hc_rate ({self.hc_rate!r}) must be a positive "
                "integer")
        require(isinstance(self.mhc_sinkhorn_iterations, int)
                and not isinstance(self.mhc_sinkhorn_iterations, bool)
                and self.mhc_sinkhorn_iterations >= 1,
                f"model.mhc_sinkhorn_iterations ({self.mhc_sinkhorn_iterations!r}) must be a "
                "positive integer")
        ratio = self.mixln_post_ratio
        require(isinstance(ratio, int | float) and not isinstance(ratio, bool)
                 and 0.0 <= ratio <= 1.0, f"model.mixln_post_ratio ({ratio!r}) must be in [0, 1]")
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        # A field that shapes only some schemes must stay at its default under the others.
        for name in sorted(SCHEME_FIELDS - set(self.residual_scheme.traits.fields)):
            value = getattr(self, name)
            require(value == defaults[name],
                     f"model.{name} ({json.dumps(value)}) requires model.residual_scheme "
                     f"{' or '.join(schemes_reading(name))} (got {self.residual_scheme})")


@dataclass
class ParallelConfig:
    """How one model replica is split over ranks; data parallelism takes the rest."""

    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline-parallel size."""
    vp: int | None = None
    """Virtual pipeline stages (model chunks) per pipeline rank: interleaved 1F1B."""
    sequence_parallel: bool = False
    """Megatron's sequence parallelism: with parallel.tp > 1, the activations outside the
    tensor-parallel matmuls (norms, dropout, residual adds) are split along the sequence over
    the tensor-parallel ranks, which saves their memory at the same communication volume."""
    recompute: Recompute = Recompute.NONE
    """none | selective | full: activation recomputation in the backward pass. selective
    recomputes megatron's core attention; full recomputes whole blocks, keeping only their
    inputs, in chunks of recompute_num_layers (docs/memory.md)."""
    recompute_num_layers: int = 1
    """With full recompute: layers per checkpointed chunk."""
    distributed_optimizer: bool = True
    """Shard optimizer state across data-parallel ranks (megatron DistributedOptimizer)."""
    ep: int = 1
    """Expert parallelism (megatron's ``expert_model_parallel_size``): the routed experts of
    every MoE block are split over this many ranks, tokens travel to their experts by
    all-to-all. Expert ranks are carved from the data-parallel ranks (and, with etp below tp,
    the tensor-parallel ones), so ep x etp x pp must divide the world size."""
    cp: int = 1
    """Context parallelism (megatron's ``context_parallel_size``): every sequence is split over
    this many ranks, each running every layer on two of its 2 x cp chunks (balanced under
    causal attention); the attention gathers the whole sequence's keys and values
    (``model.context_parallel``). For long sequences: activation memory per rank falls by cp.
    Context ranks are carved from the data-parallel ones, so tp x cp x pp must divide the
    world size (docs/parallelism.md#context-parallelism)."""
    etp: int | None = None
    """Expert tensor parallelism (megatron's ``expert_tensor_parallel_size``): the
    tensor-parallel split of each expert's matrices; default parallel.tp. 1 keeps experts whole,
    the usual choice with expert parallelism."""

    def __post_init__(self) -> None:
        coerce_choices("parallel", self)

    @property
    def model_chunks(self) -> int:
        return self.vp or 1

    @property
    def replica(self) -> int:
        """Ranks holding one model replica's share of the data: tp x cp x pp (data parallelism
        takes the world size over it)."""
        return self.tp * self.cp * self.pp

    @property
    def expert_tp(self) -> int:
        """The tensor-parallel size of the experts (``etp``, default ``tp``)."""
        return self.tp if self.etp is None else self.etp

    def validate(self) -> None:
        for name in ("tp", "pp", "cp", "recompute_num_layers", "ep"):
            value = getattr(self, name)
            require(isinstance(value, int) and value >= 1,
                     f"parallel.{name} ({value!r}) must be a positive integer")
        if self.vp is not None:
            require(isinstance(self.vp, int) and self.vp >= 1,
                     f"parallel.vp ({self.vp!r}) must be a positive integer")
            require(self.pp > 1, f"parallel.vp ({self.vp}) requires parallel.pp > 1 "
                     f"(got {self.pp})")
        if self.etp is not None:
            require(isinstance(self.etp, int) and not isinstance(self.etp, bool)
                    and self.etp >= 1, f"parallel.etp ({self.etp!r}) must be a positive integer")
        require(not self.sequence_parallel or self.tp > 1,
                 f"parallel.sequence_parallel (true) requires parallel.tp > 1 (got {self.tp})")


def validate_layout(model: ModelConfig, parallel: ParallelConfig) -> None:
    """Check each config and the rules that tie the model's shape to the layout. Four groups,
    each reported (runtime.errors.Findings): the model's own rules and the layout's own, and,
    where both pass (the others divide by their sizes), the shape's fit to the layout and the
    mixture of experts'. Inside a group the first failure ends it: its later rules read what
    earlier ones check, or share their cause (a tp that does not divide the heads does not
    divide the query groups that default to them)."""
    with Findings() as found:
        own = [found.check(model.validate), found.check(parallel.validate)]
        if all(own):
            found.check(_validate_shape, model, parallel)
            found.check(_validate_experts, model, parallel)


def _validate_shape(model: ModelConfig, parallel: ParallelConfig) -> None:
    """The model's shape against the tensor- and pipeline-parallel layout."""
    tp = parallel.tp
    require(model.num_attention_heads % tp == 0,
             f"parallel.tp ({tp}) must divide model.num_attention_heads "
             f"({model.num_attention_heads})")
    require(model.kv_heads % tp == 0,
             f"parallel.tp ({tp}) must divide model.num_query_groups ({model.kv_heads})")
    require(model.ffn_size % tp == 0,
             f"parallel.tp ({tp}) must divide model.ffn_hidden_size ({model.ffn_size})")
    require(model.padded_vocab_size % tp == 0,
             f"parallel.tp ({tp}) must divide the padded vocabulary "
             f"({model.padded_vocab_size}); raise model.make_vocab_size_divisible_by")
    stages = parallel.pp * parallel.model_chunks
    require(model.num_layers % stages == 0,
             f"model.num_layers ({model.num_layers}) must be divisible by parallel.pp x "
             f"parallel.vp ({parallel.pp} x {parallel.model_chunks} = {stages})")
    if parallel.cp > 1:
        require(model.attention_backend is not AttentionBackend.LOCAL,
                 f"parallel.cp ({parallel.cp}) needs model.attention_backend sdpa (or te, "
                 "Transformer Engine's own context parallelism): megatron's local attention "
                 "has none; set --model.attention_backend=sdpa")
    check_sequence_split(model.seq_length, "model.seq_length", parallel)
    if parallel.recompute is Recompute.FULL:
        per_chunk = model.num_layers // stages
        require(parallel.recompute_num_layers <= per_chunk,
                 f"parallel.recompute_num_layers ({parallel.recompute_num_layers}) must be <= "
                 f"the layers per model chunk ({per_chunk})")


def check_sequence_split(length: int, field: str, parallel: ParallelConfig) -> None:
    """A sequence of ``length`` tokens (``field``) splits over the layout: into 2 x cp equal
    chunks under context parallelism (two per rank), and each rank's share over the TP ranks
    under sequence parallelism."""
    cp, tp = parallel.cp, parallel.tp
    if cp > 1:
        require(length % (2 * cp) == 0,
                 f"{field} ({length}) must be divisible by 2 x parallel.cp ({2 * cp}): each "
                 "context-parallel rank holds two of 2 x cp equal chunks")
    if parallel.sequence_parallel:
        local = length // cp
        require(local % tp == 0,
                 f"parallel.tp ({tp}) must divide {field} ({length}) with sequence "
                 "parallelism" if cp == 1 else
                 f"parallel.tp ({tp}) must divide each context-parallel rank's share of "
                 f"{field} ({length} / parallel.cp {cp} = {local}) with sequence parallelism")


MOE_FIELDS = ("moe_layer_freq", "moe_router_topk", "moe_ffn_hidden_size",
              "moe_shared_expert_intermediate_size", "moe_router_load_balancing_type",
              "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_router_score_function",
              "moe_router_pre_softmax",
              "moe_router_enable_expert_bias", "moe_router_bias_update_rate",
              "moe_expert_capacity_factor", "moe_token_drop_policy",
              "moe_pad_expert_input_to_capacity")
"""The model fields that shape only a mixture-of-experts model (``model.num_experts`` > 0)."""


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _require_experts_on_the_first_stage(model: ModelConfig, parallel: ParallelConfig) -> None:
    """With parallel.pp > 1 the first pipeline stage (the ranks of pipeline rank 0, global
    rank 0 among them) must hold an MoE block. megatron writes an optimizer's settings (its
    parameter groups) into a checkpoint from global rank 0 alone; on a stage without experts
    the experts' optimizer holds no parameter and is left out of checkpoints
    (``pretrain.optim.sharded_optimizer_state``), so the experts' settings would be missing
    and no resume could load them. Other stages may be all dense."""
    if parallel.pp == 1:
        return
    stages = parallel.pp * parallel.model_chunks
    per_chunk = model.num_layers // stages
    blocks = [block for chunk in range(0, stages, parallel.pp)
              for block in range(chunk * per_chunk, (chunk + 1) * per_chunk)]
    require(any(model.moe_blocks[block] for block in blocks),
            f"model.moe_layer_freq ({model.moe_layer_freq}) leaves the first pipeline stage "
            f"of parallel.pp {parallel.pp} (blocks {blocks}, 0-based) without an MoE block; "
            "with experts it must hold one (its first rank writes the experts' optimizer "
            "settings into checkpoints): put an MoE block among those, or use parallel.pp 1")


def _validate_experts(model: ModelConfig, parallel: ParallelConfig) -> None:
    """The mixture-of-experts rules: a dense model leaves every MoE setting at its default;
    an MoE model's routing, widths and expert layout fit each other."""
    experts = model.num_experts
    require(isinstance(experts, int) and not isinstance(experts, bool) and experts >= 0,
            f"model.num_experts ({experts!r}) must be an integer >= 0 (0: dense)")
    if experts == 0:
        defaults = {f.name: f.default for f in dataclasses.fields(model)}
        for name in MOE_FIELDS:
            value = getattr(model, name)
            require(value == defaults[name], f"model.{name} ({json.dumps(value)}) requires "
                    "model.num_experts > 0 (got 0: a dense model)")
        require(parallel.ep == 1, f"parallel.ep ({parallel.ep}) requires model.num_experts > 0 "
                "(got 0: a dense model has no experts to split)")
        require(parallel.etp is None, f"parallel.etp ({parallel.etp}) requires "
                "model.num_experts > 0 (got 0: a dense model has no experts to split)")
        return
    k = model.moe_router_topk
    require(_positive_int(k) and k <= experts, f"model.moe_router_topk ({k!r}) must be in "
            f"[1, model.num_experts ({experts})]")
    require(experts % parallel.ep == 0, f"parallel.ep ({parallel.ep}) must divide "
            f"model.num_experts ({experts})")
    freq = model.moe_layer_freq
    if isinstance(freq, list):
        require(len(freq) == model.num_layers and all(f in (0, 1) for f in freq)
                and not any(isinstance(f, bool) for f in freq),
                f"model.moe_layer_freq ({freq}) must be a list of one 0 (dense) or 1 (MoE) "
                f"per block ({model.num_layers} blocks)")
        require(any(freq), f"model.moe_layer_freq ({freq}) makes no block MoE; set "
                "model.num_experts 0 for a dense model")
    else:
        require(_positive_int(freq), f"model.moe_layer_freq ({freq!r}) must be a positive "
                "integer (every k-th block is MoE) or a list of 0/1 per block")
    _require_experts_on_the_first_stage(model, parallel)
    for name in ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"):
        value = getattr(model, name)
        require(value is None or _positive_int(value),
                f"model.{name} ({value!r}) must be a positive integer")
        if value is not None:
            require(value % parallel.expert_tp == 0 if name == "moe_ffn_hidden_size"
                    else value % parallel.tp == 0,
                    f"model.{name} ({value}) must be divisible by parallel."
                    f"{'etp' if name == 'moe_ffn_hidden_size' else 'tp'} "
                    f"({parallel.expert_tp if name == 'moe_ffn_hidden_size' else parallel.tp})")
    shared = model.moe_shared_expert_intermediate_size
    require(shared is None or not model.add_bias_linear,
            f"model.moe_shared_expert_intermediate_size ({shared}) needs model.add_bias_linear "
            "false (megatron's shared expert has no linear biases; got true)")
    require(model.moe_expert_ffn_size % parallel.expert_tp == 0,
            f"parallel.etp ({parallel.expert_tp}) must divide the experts' width "
            f"(model.moe_ffn_hidden_size, default model.ffn_hidden_size: "
            f"{model.moe_expert_ffn_size})")
    for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
        value = getattr(model, name)
        require(value >= 0, f"model.{name} ({value}) must be >= 0")
    require(model.moe_router_bias_update_rate > 0, f"model.moe_router_bias_update_rate "
            f"({model.moe_router_bias_update_rate}) must be > 0")
    softmax = model.moe_router_score_function is RouterScore.SOFTMAX
    require(not model.moe_router_pre_softmax or softmax, "model.moe_router_pre_softmax (true) "
            "applies to model.moe_router_score_function softmax (got sigmoid)")
    require(k != 1 or not softmax or model.moe_router_pre_softmax,
            "model.moe_router_topk (1) with model.moe_router_score_function softmax needs "
            "model.moe_router_pre_softmax true (a softmax over the one chosen logit is 1 "
            "whatever the router learns, so it would get no gradient)")
    require(not model.moe_router_enable_expert_bias
            or model.moe_router_score_function is RouterScore.SIGMOID,
            "model.moe_router_enable_expert_bias (true) needs model.moe_router_score_function "
            f"sigmoid (megatron's expert bias; got {model.moe_router_score_function})")
    factor = model.moe_expert_capacity_factor
    require(factor is None or factor > 0,
            f"model.moe_expert_capacity_factor ({factor}) must be > 0 (or unset: no dropping)")
    require(not model.moe_pad_expert_input_to_capacity or factor is not None,
            "model.moe_pad_expert_input_to_capacity (true) needs "
            "model.moe_expert_capacity_factor (unset: no capacity to pad to)")
    require(parallel.tp == 1 or parallel.sequence_parallel,
            f"parallel.tp ({parallel.tp}) with experts needs parallel.sequence_parallel true "
            "(megatron's MoE layer dispatches sequence-parallel tokens only)")
