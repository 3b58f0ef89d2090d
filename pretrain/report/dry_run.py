"""``train --dry-run``: the resolved config, sizes and parallel layout, without training."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from kernels.backend import NormBackend
from model import decay
from model.backends import AttentionBackend, MegatronFusions, TransformerImpl, resolve_fusions
from model.builder import build_model
from model.config import ModelConfig, ParallelConfig
from model.megatron_config import fusion_fields
from model.schemes import Activation, FinalNorm, PositionEmbedding, Recompute
from model.sizes import ParameterCount
from model.sizes import parameter_count as model_parameter_count
from pretrain.config import Config, OptimName, ParamsDtype, to_toml, validate
from pretrain.report.expert_activations import expert_bytes, mlp_values
from pretrain.report.model_summary import expert_layout_text
from pretrain.report.throughput import flops_per_token
from pretrain.report.units import count, human
from runtime import cpu_compat, parallel
from runtime.errors import ConfigError


@dataclass(frozen=True)
class Fusions:
    """The megatron fusions that change what is kept for backward: ``activation`` is
    ``bias_activation_fusion`` (SwiGLU keeps only its input), ``cross_entropy`` is
    ``cross_entropy_loss_fusion`` (megatron's compiled native loss), ``rope`` is
    ``apply_rope_fusion`` (Transformer Engine's RoPE keeps no cos/sin per layer)."""

    activation: bool = False
    cross_entropy: bool = False
    rope: bool = False

    @classmethod
    def planned(cls, config: Config) -> Fusions:
        """The fusions a run of ``config`` uses on the GPU nodes a dry run plans for, by the
        rule that sets megatron's flags (``model.megatron_config.fusion_fields``), with what
        the config leaves to the machine resolved as on those nodes rather than on the one the
        dry run runs on (a login node without CUDA would plan a run without fusions):
        ``megatron_fusions`` auto is on, ``run.params_dtype`` auto bf16. Transformer Engine
        (RoPE's fusion is its) is counted only where the config asks for it (``te`` linears
        or attention): whether the nodes have it cannot be read from here, and the estimate
        counts megatron's own modules."""
        m = config.model
        te = m.transformer_impl is TransformerImpl.TE or m.attention_backend is AttentionBackend.TE
        flags = fusion_fields(m, resolve_fusions(m.megatron_fusions, cuda=True),
                              bf16=config.run.params_dtype is not ParamsDtype.FP32, te=te,
                              te_linears=m.transformer_impl is TransformerImpl.TE,
                              positions_per_token=config.data.reset_position_ids)
        return cls(activation=flags["bias_activation_fusion"],
                   cross_entropy=flags["cross_entropy_loss_fusion"],
                   rope=flags["apply_rope_fusion"])

    def line(self, config: Config) -> str:
        """The dry run's line saying which fusions its activation estimate counted."""
        m = config.model
        choice = m.megatron_fusions
        rope = m.position_embedding is PositionEmbedding.ROPE
        applies = {"SwiGLU": (self.activation, m.activation is Activation.SWIGLU),
                   "cross entropy": (self.cross_entropy, True), "RoPE": (self.rope, rope)}
        fused = [name for name, (on, used) in applies.items() if used and on]
        unfused = [name for name, (on, used) in applies.items() if used and not on]
        words = [f"fused {' and '.join(fused)}"] if fused else []
        words += [f"unfused {' and '.join(unfused)}"] if unfused else []
        note = (" (Transformer Engine's fusion: counted with te linears or attention "
                "only)" if resolve_fusions(choice, cuda=True) and rope and not self.rope else "")
        setting = "auto: on, as on the GPU nodes" if choice is MegatronFusions.AUTO else choice
        return (f"megatron fusions counted (model.megatron_fusions {setting}): "
                f"{', '.join(words)}{note}")


@dataclass(frozen=True)
class LayerBytes:
    """The bytes one layer keeps for backward per token, by how they divide: ``whole`` is held
    by every TP rank unless sequence parallel, ``split`` is split over TP, ``rope`` (RoPE's
    cos/sin) is per position on every rank, shared by a micro-batch's sequences unless each
    token has its own position (``data.reset_position_ids``); ``expert_tokens``, in an MoE
    block, the token copies at the experts' input, gathered over the experts' tensor-parallel
    ranks (``pretrain.report.expert_activations``)."""

    whole: float
    split: float
    rope: int
    expert_tokens: float = 0


def _layer_bytes(m: ModelConfig, width: int, fusions: Fusions, experts: bool,
                 cp: int = 1) -> LayerBytes:
    """What one layer keeps, in an activation dtype of ``width`` bytes, its MLP sublayer
    megatron's MoE layer if ``experts``; the terms are explained in :func:`activation_bytes`."""
    traits = m.residual_scheme.traits
    kind = m.normalization.kind
    norm = kind.kept(width)
    h, heads, groups = m.hidden_size, m.num_attention_heads, m.kv_heads
    head_dim = h // heads
    kv = groups * head_dim
    outside = traits.kept(m, width, kind.fused_kernels)
    streams = (outside.values * h * width + outside.bytes
               + norm.bytes(outside.norms, h, width, input_kept=False)
               + norm.bytes(outside.shared_norms, h, width, input_kept=True))
    dropout_masks = 2 * h if m.hidden_dropout > 0 else 0
    whole = streams + 2 * h * width + dropout_masks  # + the two branch inputs
    if cp == 1:  # Q and K after RoPE, the attention output; V, a view, keeps the QKV output
        attention = (h + kv + h) * width
    else:  # this rank's Q after RoPE, the gathered K and V in sequence order (the whole
        # sequence's), each chunk's output and their concatenation; V goes to the gather
        attention = (h + 2 * kv * cp + 2 * h) * width
    attention += 4 * heads  # the logsumexp
    if traits.qkv_norm:  # the head norms read the QKV output; the normalised V stays
        attention += (kv * width if cp == 1 else 0) + norm.bytes(
            heads + 2 * groups, head_dim, width, input_kept=False)
    else:
        qkv_kept = cp == 1 or (traits.qk_norm and norm.input)
        attention += (h + 2 * kv) * width if qkv_kept else 0
        if traits.qk_norm:
            attention += norm.bytes(heads + groups, head_dim, width, input_kept=True)
    unfused_rope = m.position_embedding is PositionEmbedding.ROPE and not fusions.rope
    rope = 4 * head_dim * width if unfused_rope else 0
    if not experts:
        mlp = mlp_values(m, m.ffn_size, fusions.activation) * width
        return LayerBytes(whole, attention + mlp, rope)
    moe = expert_bytes(m, width, fusions.activation)
    return LayerBytes(whole + moe.router, attention + moe.split, rope, moe.tokens)


def closing_bytes(m: ModelConfig, width: int) -> int:
    """Bytes per token what closes the decoder keeps for backward (see :func:`activation_bytes`),
    besides the output layer's input."""
    kind = m.normalization.kind
    norm = kind.kept(width)
    h, final = m.hidden_size, m.residual_scheme.traits.final
    if final is FinalNorm.NONE:
        return 0
    if final is not FinalNorm.MERGE:  # a norm; hyper-connections' after the stream sum
        return norm.bytes(1, h, width, input_kept=False)
    if kind.fused_kernels:  # one pass keeping the packed streams and each norm's statistics
        return 2 * h * width + norm.bytes(3, h, width, input_kept=True)
    return norm.bytes(3, h, width, input_kept=False)


def first_stage_blocks(layers: int, p: ParallelConfig) -> list[int]:
    """The global blocks of the first pipeline rank, the one holding the most micro-batches in
    flight: with v virtual stages, chunk c of it holds the c x pp-th run of layers / (pp v)
    blocks (megatron's interleaved layout)."""
    chunks = p.vp or 1
    per_chunk = layers // (p.pp * chunks)
    return [c * p.pp * per_chunk + i for c in range(chunks) for i in range(per_chunk)]


def estimated_layer_bytes(model: ModelConfig, width: int, fusions: Fusions,
                          sequences: int = 1, cp: int = 1) -> float:
    """Bytes per token one layer keeps for backward without TP or SP (see
    :func:`activation_bytes`), in an activation dtype of ``width`` bytes, with ``sequences``
    sequences per micro-batch sharing their positions; in a model with experts, a layer of
    an MoE block; under context parallelism ``cp``, per token of a rank's share."""
    kept = _layer_bytes(model, width, fusions, experts=model.num_experts > 0, cp=cp)
    return kept.whole + kept.split + kept.rope / sequences + kept.expert_tokens


def activation_bytes(config: Config, dp: int, fusions: Fusions | None = None) -> float:
    """Activation memory of the busiest GPU in one step, in bytes: what forward keeps for
    backward, tensor by tensor, on the GPU path (megatron's local linears, SDPA flash attention,
    the fused Triton norms for the normalizations they compute, the others' reference;
    Transformer Engine's modules and the torch norm backend keep other tensors).
    ``fusions``: those of the GPU run planned (:meth:`Fusions.planned`) unless given.

    Per token and layer, in values of the activation dtype (w bytes each), with h the hidden
    size, a heads, g K/V groups, kv = g x head_dim, f the MLP width and n the residual streams
    (``ModelConfig.residual_streams``):

    - attention: h, the QKV input; h + 2kv, the QKV output (V is a view of it, so all of it
      stays); h + kv, Q and K after RoPE; h, the attention output, which is also the output
      projection's input; 4a bytes of fp32 logsumexp (flash attention keeps no s x s scores).
      QKV-norm adds kv (the normalised V), and its head norms keep what their kind keeps of
      a + 2g rows of head_dim values, the QKV output being their input (the fused kernel
      keeps it: the same h + 2kv; a DyT keeps its fp32 copies instead, and then nothing keeps
      the QKV output); QK-norm (olmo2) what its kind keeps of a + g rows beyond the QKV
      output, which V keeps (the kernels: their statistics, 8 (a + g) bytes).
      Unfused RoPE (megatron's without Transformer Engine) keeps the cos and sin it applies
      to Q and to K: 4 head_dim values per position, which a micro-batch's sequences share
      unless each token has its own position (``data.reset_position_ids``).
    - MLP: h, the fc1 input; 2f, the fc1 output (f for GELU); then megatron's unfused SwiGLU
      keeps silu(gate), up + 0 (its glu_linear_offset add copies) and their product, the fc2
      input: 3f; with the activation fusion only the product, f; GELU its output, f.
    - streams: what a block keeps outside its branches (``Traits.kept``, :mod:`model.kept`):
      its norms, each keeping what its kind keeps (``kernels.normalizations.Kept``: the fused
      kernels their input, h, and two fp32 statistics per row, 8 bytes; a DyT its fp32 input
      copy and fp32 tanh, 8h bytes in bf16), and the other values it keeps. One stream: 2
      norms (pre, post, ...), 1 (hybridnorm: its attention has no norm in front), 4 (periln:
      the branch outputs' norms too). SiameseNorm under the fused kernels (3h and six rows of
      statistics): the kernels keep their inputs, not their outputs: 2h, the layer input,
      read by the attention entry; the MLP entry re-derives the updated streams from it and
      the attention output r (recomputing u = Npost(x)), so it keeps h more, r. With QKV-norm
      (the hybrid form) x reaches attention through the channel gate, which keeps x itself, a
      half of the layer input. With a normalization the kernels do not compute (DyT) each of
      the six norms runs on its own and keeps what its kind keeps of its own input (the
      hybrid form: three, the gated entry's norm reading y of the layer input the gate
      keeps).
      Hyper-connections (n streams, not measured on a GPU yet): per sublayer the streams it
      mixes and writes (n h), the mixed input of its norm (h), the branch output it scales
      into every stream (h) and, dynamic, the normalised streams its weights come from (n h).
      mHC: per sublayer the streams (n h, read by the mapping's product, the aggregation and
      H_res), its norm's input (h) and the branch output H_post scales (h); the flattened
      streams' RMS is applied after the product, so no normalised copy is kept.
      Next to these, a scheme's own per-token tensors, such as the mixing coefficients of hc
      and mhc (O(n^2) values per sublayer; mHC's Sinkhorn keeps only its logits and
      recomputes its iterations in backward), and dynamic hc's norm of the n streams.
    - dropout: a 1-byte mask per branch output (2h bytes) when hidden_dropout > 0.
    - document attention (data.document_attention): the micro-batch's int32 document ids, 4
      bytes per token, shared by every layer (flex attention's block mask is O((s/128)^2),
      left out; the CPU's exact path keeps one [b, 1, s, s] boolean mask per micro-batch
      more, s bytes per token, not counted here).

    - mixture of experts: in an MoE block the MLP's terms give way to megatron's MoE layer
      (``pretrain.report.expert_activations``): per assignment (k per token, or each
      expert's capacity) the token's copy at its expert's input, h, gathered over the
      experts' TP ranks (etp/tp of it per rank), and the expert's activations, 6f' for
      SwiGLU experts of width f' (the routing weight's product is one copy more than a
      dense MLP's; 3f' fused or GELU), split over TP; the shared expert's as a dense MLP's;
      and per token the router's fp32 scores, indices and permutation, O(E + k) bytes for E
      experts, outside the branches. Expert parallelism keeps the rows a rank's experts
      receive, counted as the balanced share.

    That is pre, post, deepnorm, mixln and olmo2 7h + 3kv + 5f, hybridnorm 6h + 4kv + 5f,
    periln 9h + 3kv + 5f, siamese 8h + 3kv + 5f, siamese_hybrid 8h + 4kv + 5f, hc
    (4n + 9)h + 3kv + 5f dynamic and (2n + 9)h + 3kv + 5f static, mhc (2n + 9)h + 3kv + 5f
    (2f less each with the activation fusion), plus RoPE's 4 head_dim values per position
    and the bytes of the scheme's own tensors and of its norms' statistics, under the fused
    kernels (RMSNorm, LayerNorm); a DyT keeps 3h more than a kernel's norm (fp32 copy and
    tanh, 4h, in place of the input, h) for each norm, the two-stream schemes more again.
    The decoder's end keeps h (the output layer's input) plus what closes it keeps
    (:func:`closing_bytes`): a norm's (hyper-connections' after the stream sum), the merge's
    packed 2h and three rows of statistics (unfused, its three norms'), or nothing (the
    Post-Norm family). The loss peaks
    with the [s, b, V/tp] logits held as an fp32 softmax for backward next to the logits in the
    activation dtype (forward) or their gradient (backward): 4 + w bytes per entry (4 in fp32);
    megatron's fused (compiled) cross entropy holds one fp32 copy more: + 4.

    Context parallelism (cp ranks share each sequence): every term is per token of a rank's
    share, s / cp tokens, but the attention's: a rank keeps its Q after RoPE (h), the whole
    sequence's K and V gathered in sequence order (2 kv cp per token of its share), the
    output of each of its two chunks and their concatenation (2h), and the QKV output only
    where a head norm keeps it (V goes to the gather); with document attention the gathered
    ids, 4 cp bytes per token. Its queries meet the keys before them through flash
    attention's lower-right causal rule on CUDA (the CPU materialises that mask, not counted).

    Layers: the first pipeline stage holds up to pp micro-batches in flight (1F1B), i.e. all its
    layers' activations for each; full recomputation keeps each layer's n-stream input plus one
    layer being recomputed; selective recomputation (core attention) saves next to nothing with
    flash attention and counts as none. The terms inside the branches split over TP, their
    inputs and the rest only with sequence parallelism; RoPE's cos/sin neither. Left out:
    backward's short-lived buffers and what a layer keeps once whatever the tokens (mHC's fp32
    gate vectors, 4 (n^2 + 2n) bytes per sublayer). Against one H100 at the paper's 1.3B
    shape this is within 0.5% for the schemes measured with today's kernels; per layer, every
    scheme's count per token is held exactly to the tensors autograd keeps (README,
    "Activation memory").
    """
    m, p, d = config.model, config.parallel, config.data
    if fusions is None:
        fusions = Fusions.planned(config)
    h = m.hidden_size
    tokens = config.seq_length * d.micro_batch_size // p.cp  # a context-parallel rank's share
    width = 2 if config.run.params_dtype != "fp32" else 4
    sp = p.tp if p.sequence_parallel else 1
    sequences = 1 if d.reset_position_ids else d.micro_batch_size  # sharing RoPE's cos/sin

    def layer(experts: bool) -> float:
        kept = _layer_bytes(m, width, fusions, experts, p.cp)
        return (kept.whole / sp + kept.split / p.tp + kept.rope / sequences
                + kept.expert_tokens * p.expert_tp / p.tp)

    layers_per_stage = m.num_layers // p.pp
    first_stage = [m.moe_blocks[i] for i in first_stage_blocks(m.num_layers, p)]
    in_flight = min(p.pp, max(1, d.global_batch_size // (d.micro_batch_size * dp)))
    streams = m.residual_streams
    kept = {experts: layer(experts) for experts in set(first_stage)}  # dense and MoE blocks
    if p.recompute is Recompute.FULL:
        per_microbatch = layers_per_stage * streams * h * width / sp + max(kept.values())
    else:
        per_microbatch = sum(kept[experts] for experts in first_stage)
    if d.document_attention:  # the ids, and under context parallelism the gathered ones
        per_microbatch += 4 * (1 + (p.cp if p.cp > 1 else 0))
    end = (h * width + closing_bytes(m, width)) / sp
    logit_bytes = 4 + (width if width < 4 else 0) + (4 if fusions.cross_entropy else 0)
    last_stage = end + logit_bytes * m.padded_vocab_size / p.tp
    return tokens * (in_flight * per_microbatch + (last_stage if p.pp == 1 else 0))


def context_parallel_bytes(config: Config, dp: int) -> float:
    """Bytes each context-parallel rank receives per step in its attention's collectives: per
    layer and micro-batch the all-gather of K and V (its TP rank's heads, the whole sequence,
    (cp - 1) / cp of it from the other ranks) in forward, again under full recomputation,
    and the reduce-scatter of their gradients in backward, the same size. 0 without context
    parallelism."""
    m, p, d = config.model, config.parallel, config.data
    if p.cp == 1:
        return 0.0
    width = 2 if config.run.params_dtype != "fp32" else 4
    kv = m.kv_heads * (m.hidden_size // m.num_attention_heads) // p.tp
    per_layer = 2 * kv * config.seq_length * d.micro_batch_size * width * (p.cp - 1) / p.cp
    passes = 3 if p.recompute is Recompute.FULL else 2
    micro = d.global_batch_size // (d.micro_batch_size * dp)
    return per_layer * passes * m.num_layers // p.pp * micro


ADAM_STATE = 12
"""Bytes of optimizer state per AdamW parameter: fp32 main weight and two fp32 moments."""
MUON_STATE = 8
"""Bytes of optimizer state per parameter Muon steps: fp32 main weight and one fp32 momentum."""


def parameter_count(model: ModelConfig, seed: int) -> tuple[ParameterCount, ParameterCount]:
    """Parameters of the whole model and the routed experts' share of them, and the same of
    the parameters ``optim.name = "muon"`` would step with Muon (the block linears and each
    expert's: ``model.decay``), from a
    build on the meta device (shapes only: a 15B model costs no memory) in a one-rank group
    opened and closed here."""
    with cpu_compat.enabled():
        parallel.initialize(ParallelConfig(), seed=seed)
        try:
            with torch.device("meta"):
                chunks = build_model(model, ParallelConfig(), norm_backend=NormBackend.TORCH)
                return (model_parameter_count(chunks),
                        model_parameter_count(chunks, decay.muon_matrix))
        finally:
            parallel.destroy()


def state_bytes_per_gpu(config: Config, params: ParameterCount, world: int,
                        muon: ParameterCount | None = None) -> float:
    """Weights, gradients and optimizer state on one GPU, in bytes: bf16 weights (2 B), fp32
    gradients (4 B), fp32 main weights and Adam moments (:data:`ADAM_STATE`, divided over the
    data-parallel ranks with the distributed optimizer). With ``optim.name = "muon"`` the
    ``muon`` parameters Muon steps keep one momentum instead (:data:`MUON_STATE`); with the
    distributed optimizer each data-parallel rank keeps that of the whole matrices it owns,
    about 1/dp of them (megatron packs them to balance the ranks). The routed experts split
    over etp x ep x pp ranks and their optimizer state over the expert data-parallel ranks
    (world / (etp x ep x pp)), the rest over tp x pp and dp, as megatron lays them out
    (Megatron-LM's ``theoretical_memory_usage`` counts them so). Muon's transient whole
    matrices (a TP shard's gathered weight, gradient and momentum while it steps) are not
    counted."""
    p = config.parallel
    if muon is None or config.optim.name is not OptimName.MUON:
        muon = ParameterCount(total=0, routed=0)

    def per_parameter(dp: int, state: int = ADAM_STATE) -> float:
        return 2 + 4 + state / (dp if p.distributed_optimizer else 1)

    shards = world // (p.tp * p.pp)  # the distributed optimizer's: data x context ranks
    expert_group = p.expert_tp * p.ep * p.pp
    expert_dp = world // expert_group
    return ((params.dense - muon.dense) / (p.tp * p.pp) * per_parameter(shards)
            + muon.dense / (p.tp * p.pp) * per_parameter(shards, MUON_STATE)
            + (params.routed - muon.routed) / expert_group * per_parameter(expert_dp)
            + muon.routed / expert_group * per_parameter(expert_dp, MUON_STATE))


# Above the resolved config: a comment, so the printed config stays TOML a user can copy.
REFERENCE_HINT = ("# what each field means: python -m pretrain explain SECTION.KEY "
                  "(e.g. optim.lr); every field: docs/config.md")


class LayoutRefused(ConfigError):
    """A world size the config's layout cannot take. ``plan``: the part of the dry run's
    report that holds without a world size (the config, sizes, tokens and FLOPs, and the world
    sizes the layout takes), which the dry run prints before the error's one line."""

    def __init__(self, message: str, plan: str):
        super().__init__(message)
        self.plan = plan


def world_sizes(config: Config, limit: int = 8) -> list[int]:
    """The ``limit`` smallest world sizes ``config`` takes: tp x cp x pp x dp for each
    data-parallel size dp that splits the global batch into whole micro-batches, kept where
    :func:`pretrain.config.validate` accepts it (the expert groups, virtual pipelining)."""
    p, d = config.parallel, config.data
    found = []
    for dp in range(1, d.global_batch_size // d.micro_batch_size + 1):
        if d.global_batch_size % (d.micro_batch_size * dp) == 0:
            try:
                validate(config, world_size=p.replica * dp)
            except ConfigError:
                continue
            found.append(p.replica * dp)
            if len(found) == limit:
                break
    return found


def _layout_needs(config: Config, world: int) -> str:
    """The layout line of a world size the config cannot take: what one model replica spans
    and the world sizes that fit."""
    p = config.parallel
    replica = f"tp {p.tp}" + (f" x cp {p.cp}" if p.cp > 1 else "") + f" x pp {p.pp}"
    if config.model.num_experts:
        replica += f" (experts: etp {p.expert_tp} x ep {p.ep} x pp {p.pp})"
    fits = world_sizes(config, limit=9)  # eight shown; a ninth says the list goes on
    takes = (f"world sizes it takes: {', '.join(map(str, fits[:8]))}"
             + (", ..." if len(fits) > 8 else "") if fits else "no world size fits it")
    return f"layout: {replica}; world {world} does not fit it (below); {takes}"


def dry_run(config: Config, world_size: int | None = None) -> str:
    """World size: ``world_size``, else $WORLD_SIZE, else one data-parallel replica. A world
    size the layout cannot take raises :class:`LayoutRefused`, with the plan up to the
    layout."""
    p, d, m = config.parallel, config.data, config.model
    world = world_size or int(os.environ.get("WORLD_SIZE", p.replica))
    params, muon = parameter_count(m, config.run.seed)
    tokens_per_step = d.global_batch_size * config.seq_length
    sizes = f"parameters: {params.total:,} ({human(params.total)})"
    if m.num_experts:
        active = params.active(m)
        sizes += (f"; active per token: {active:,} ({human(active)}): top-{m.moe_router_topk} "
                  f"of {m.num_experts} routed experts"
                  + (" and the shared expert" if m.moe_shared_expert_intermediate_size else "")
                  + f" in {count(sum(m.moe_blocks), 'MoE block')}; routed experts "
                  f"{params.routed:,} ({human(params.routed)})")
    head = [REFERENCE_HINT, to_toml(config).rstrip(), "", sizes]
    steps = [
        f"tokens per step: {tokens_per_step:,}; steps: {config.run.steps:,}; "
        f"total tokens: {human(tokens_per_step * config.run.steps)}",
        f"model FLOPs per token (forward + backward, Megatron-LM's formula): "
        f"{flops_per_token(config) / 1e9:.2f} GFLOP; per step: "
        f"{flops_per_token(config) * tokens_per_step / 1e12:,.1f} TFLOP",
    ]
    try:
        validate(config, world_size=world)
    except ConfigError as err:
        raise LayoutRefused(str(err), "\n".join([*head, *steps, _layout_needs(config, world)])) \
            from None
    dp = world // p.replica
    weights_gb = state_bytes_per_gpu(config, params, world, muon) / 2**30
    fusions = Fusions.planned(config)
    activations_gb = activation_bytes(config, dp, fusions) / 2**30
    experts = expert_layout_text(m, p, world)
    lines = [
        *head,
        f"layout: world {world} = tp {p.tp}" + (f" x cp {p.cp}" if p.cp > 1 else "")
        + f" x pp {p.pp} x dp {dp}"
        + (f", {p.vp} virtual stages per pipeline rank" if p.vp else "")
        + (", sequence parallel" if p.sequence_parallel else "")
        + f", recompute {p.recompute}" + experts,
        f"micro-batches per step: {d.global_batch_size // (d.micro_batch_size * dp)} "
        f"of {count(d.micro_batch_size, 'sequence')} per data-parallel rank",
        *steps,
        f"memory per GPU for weights, grads and optimizer state: {weights_gb:.1f} GiB"
        + (f" (Muon: one momentum for the block matrices' {muon.total:,} parameters, AdamW's "
           "two moments for the rest)" if config.optim.name is OptimName.MUON else ""),
        fusions.line(config),
        f"memory per GPU for activations (estimate): {activations_gb:.1f} GiB; "
        f"total about {weights_gb + activations_gb:.1f} GiB",
    ]
    if p.cp > 1:
        lines.append(
            f"context parallelism: each rank holds {config.seq_length // p.cp:,} tokens of "
            f"each sequence and receives {context_parallel_bytes(config, dp) / 2**30:.2f} GiB "
            "per step in the attention's K/V all-gathers and their gradients' "
            "reduce-scatters")
    return "\n".join(lines)
