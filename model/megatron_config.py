"""The single translation from our configs to megatron-core's ``TransformerConfig``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig

from model.backends import (
    TransformerImpl,
    resolve_fusions,
    resolve_transformer_impl,
    te_available,
)
from model.config import ModelConfig, ParallelConfig, validate_layout
from model.schemes import Activation, PositionEmbedding, Recompute


def transformer_config(
    model: ModelConfig, parallel: ParallelConfig, params_dtype: torch.dtype = torch.float32,
    positions_per_token: bool = False,
) -> TransformerConfig:
    """Build megatron's TransformerConfig; the only place its fields are chosen.

    Choices that are not obvious:
    - ``use_cpu_initialization``: megatron builds the weights on the CPU; ``model/init.py``
      then redraws every random one from the seed and its global name (layout-independent),
      and the builder moves the model to its device.
    - ``variable_seq_lengths`` for multi-stream schemes under PP: stages exchange the packed
      [s, b, n h] tensor, but both pipeline schedules size their receive buffers from
      ``hidden_size``; exchanging shapes first is the one mechanism both schedules honour.
    - ``batch_p2p_comm`` is off with virtual pipelining: the batched isend/irecv path gives
      wrong results with interleaving on gloo.
    - ``qk_layernorm`` for Q/K(/V)-norm schemes: it makes megatron sum the per-head norm
      gradients across TP ranks (every rank normalises different heads with shared weights).
    - megatron's fusions (``model.megatron_fusions``): SwiGLU(+bias), bias+dropout+add and
      the native cross-entropy need only torch.compile; RoPE fusion needs TE (and rotary
      angles per position, not per token: off with ``positions_per_token``, model/gpt.py), gradient
      accumulation fusion TE's linears (megatron's own would need apex). megatron's fused GELU
      is the tanh approximation, another function than the model's exact GELU, so GELU stays
      unfused. The native fused cross-entropy casts the logits' gradient to
      bf16 (megatron's code), so it is used in bf16 runs only. Megatron's masked-softmax fusion
      is left off: SDPA replaces it.
    - ``hetereogenous_dist_checkpoint`` (sic) when blocks differ: megatron's checkpoint stacks
      each parameter over the blocks, which needs every block to hold it; per-block keys (by
      global index) still reshard across PP layouts.
    """
    validate_layout(model, parallel)
    bf16 = params_dtype == torch.bfloat16
    swiglu = model.activation is Activation.SWIGLU
    recompute = parallel.recompute
    traits = model.residual_scheme.traits
    fused = resolve_fusions(model.megatron_fusions)
    te_linears = resolve_transformer_impl(model.transformer_impl) is TransformerImpl.TE
    return TransformerConfig(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.kv_heads,
        ffn_hidden_size=model.ffn_size,
        kv_channels=model.hidden_size // model.num_attention_heads,
        normalization=model.normalization.megatron_name,
        layernorm_epsilon=model.norm_eps,
        gated_linear_unit=swiglu,
        activation_func=F.silu if swiglu else F.gelu,
        add_bias_linear=model.add_bias_linear,
        hidden_dropout=model.hidden_dropout,
        attention_dropout=model.attention_dropout,
        init_method_std=model.init_method_std,
        qk_layernorm=traits.head_norms,
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        virtual_pipeline_model_parallel_size=parallel.vp,
        context_parallel_size=parallel.cp,
        sequence_parallel=parallel.sequence_parallel,
        recompute_granularity=None if recompute is Recompute.NONE else recompute.value,
        recompute_method="uniform" if recompute is Recompute.FULL else None,
        recompute_num_layers=parallel.recompute_num_layers if recompute is Recompute.FULL
        else None,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=bf16,
        autocast_dtype=params_dtype,
        use_cpu_initialization=True,
        hetereogenous_dist_checkpoint=model.blocks_differ,
        variable_seq_lengths=model.residual_streams > 1 and parallel.pp > 1,
        batch_p2p_comm=parallel.vp is None,
        # megatron rejects variable_seq_lengths with the default (allgather) dispatcher even
        # in a dense model; all-to-all is also the one that scales with expert parallelism.
        moe_token_dispatcher_type="alltoall",
        expert_model_parallel_size=parallel.ep,
        expert_tensor_parallel_size=parallel.expert_tp,
        **_moe_fields(model, te_linears),
        **fusion_fields(model, fused, bf16=bf16, te=te_available(), te_linears=te_linears,
                        positions_per_token=positions_per_token),
        persist_layer_norm=False,
        attention_softmax_in_fp32=True,
    )


def fusion_fields(model: ModelConfig, fused: bool, bf16: bool, te: bool, te_linears: bool,
                  positions_per_token: bool = False) -> dict:
    """megatron's fusion flags (the rules in :func:`transformer_config`), from what decides
    them rather than from this process's machine: ``fused``, ``model.megatron_fusions``
    resolved; ``bf16``, the parameters' dtype; ``te``, Transformer Engine installed;
    ``te_linears``, TE's linears in use. The dry run calls it for the GPU nodes it plans for."""
    return dict(
        bias_activation_fusion=fused and model.activation is Activation.SWIGLU,
        bias_dropout_fusion=fused,
        cross_entropy_loss_fusion=fused and bf16,
        cross_entropy_fusion_impl="native",
        masked_softmax_fusion=False,
        apply_rope_fusion=(fused and model.position_embedding is PositionEmbedding.ROPE
                           and not positions_per_token and te),
        gradient_accumulation_fusion=fused and te_linears,
    )


def _moe_fields(model: ModelConfig, te_linears: bool) -> dict:
    """megatron's MoE fields of an MoE model (``model/moe.py``); none for a dense one, so
    megatron treats it as dense (no MoE loss scaling in its schedules).

    - ``moe_layer_freq`` is passed for megatron's own bookkeeping (loss tracking, FLOPs);
      which blocks are MoE is chosen by our spec (``model.moe.moe_blocks``) from the same
      value.
    - ``moe_router_dtype`` fp32: the router's logits, scores and top-k in fp32 in bf16
      runs, so routing does not flip on bf16 rounding ties.
    - ``moe_grouped_gemm`` with TE linears: TE's grouped GEMM runs all local experts in one
      kernel; megatron's own grouped path needs the grouped_gemm package, which we do not use.
    - ``moe_per_layer_logging`` keeps megatron's per-layer loss values, which the run's
      metrics report (``pretrain/train/experts.py``).
    """
    if not model.num_experts:
        return {}
    z_loss = model.moe_z_loss_coeff
    return dict(
        num_moe_experts=model.num_experts,
        moe_layer_freq=model.moe_layer_freq,
        moe_router_topk=model.moe_router_topk,
        moe_ffn_hidden_size=model.moe_expert_ffn_size,
        moe_shared_expert_intermediate_size=model.moe_shared_expert_intermediate_size,
        moe_router_load_balancing_type=model.moe_router_load_balancing_type.value,
        moe_aux_loss_coeff=model.moe_aux_loss_coeff,
        moe_z_loss_coeff=z_loss if z_loss > 0 else None,
        moe_router_score_function=model.moe_router_score_function.value,
        moe_router_pre_softmax=model.moe_router_pre_softmax,
        moe_router_enable_expert_bias=model.moe_router_enable_expert_bias,
        moe_router_bias_update_rate=model.moe_router_bias_update_rate,
        moe_expert_capacity_factor=model.moe_expert_capacity_factor,
        moe_token_drop_policy=model.moe_token_drop_policy.value,
        moe_pad_expert_input_to_capacity=model.moe_pad_expert_input_to_capacity,
        moe_router_dtype="fp32",
        moe_grouped_gemm=te_linears,
        moe_per_layer_logging=True,
    )
