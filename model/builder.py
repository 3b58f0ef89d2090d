"""Build a model for any residual scheme and parallel layout, and count its parameters.

Usage (after :func:`runtime.parallel.initialize`)::

    chunks = build_model(ModelConfig(residual_scheme="siamese"), ParallelConfig(tp=2),
                         norm_backend="triton")
    chunks = wrap_ddp(chunks, parallel)           # for training
    n = count_parameters(chunks)                  # this rank's share

``build_model`` returns one GPTModel per virtual pipeline stage held by this rank.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
from megatron.core.transformer.module import param_is_not_shared
from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker

from kernels.backend import NormBackend, resolve
from model import decay, moe
from model.config import ModelConfig, ParallelConfig
from model.gpt import GPT
from model.init import initialize
from model.megatron_config import transformer_config
from model.spec import block_spec
from runtime import device
from runtime.grads import finalize_grads


def build_model(
    model: ModelConfig, parallel: ParallelConfig, params_dtype: torch.dtype = torch.float32,
    norm_backend: NormBackend | str = NormBackend.AUTO, seed: int | None = None,
    positions_per_token: bool = False,
) -> list[GPTModel]:
    """The chunks of ``model`` this rank holds. ``norm_backend`` (``kernels.norm_backend``) is
    resolved here, once, and every norm of the model computes with it. The initial weights are
    a function of ``seed`` (default: the seed torch was last seeded with) and ``model`` only
    (``model.init``), whatever the layout. ``positions_per_token``: rotary angles from each
    token's position id (positions that restart at each packed document; model/gpt.py)."""
    seed = torch.initial_seed() if seed is None else seed
    backend = resolve(norm_backend)
    config = transformer_config(model, parallel, params_dtype, positions_per_token)
    config.finalize_model_grads_func = finalize_grads
    # On the meta device (shapes only: the dry run's count) there is nothing to draw, and
    # megatron's own draws, which model.init replaces anyway, are most of a build's time.
    config.perform_initialization = torch.empty(0).device.type != "meta"
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    chunks = []
    for stage in range(parallel.model_chunks):
        vp_stage = stage if parallel.vp is not None else None
        chunk = GPT(
            config=config,
            positions_per_token=positions_per_token,
            transformer_layer_spec=block_spec(model, config, vp_stage, pp_rank, backend),
            vocab_size=model.padded_vocab_size,
            max_sequence_length=model.seq_length,
            pre_process=parallel_state.is_pipeline_first_stage(
                ignore_virtual=False, vp_stage=vp_stage),
            post_process=parallel_state.is_pipeline_last_stage(
                ignore_virtual=False, vp_stage=vp_stage),
            share_embeddings_and_output_weights=not model.untie_embeddings_and_output_weights,
            position_embedding_type=model.position_embedding.value,
            rotary_base=model.rotary_base,
            vp_stage=vp_stage,
        )
        chunks.append(chunk)
    if model.num_experts:
        moe.mark_experts(chunks)  # one optimizer-state layout at every ep and etp
        # megatron's MoE metrics tracker is one per process, sized by the depth of the first
        # model that records into it: a new model starts it anew (another depth in the same
        # process indexed past its end).
        destroy_moe_metrics_tracker()
    decay.assign(chunks, model.residual_scheme)
    # Weights are drawn on the CPU, then move to the device this process computes on. A model
    # built on the meta device (shapes only) stays there.
    if not any(p.is_meta for chunk in chunks for p in chunk.parameters()):
        initialize(chunks, model, seed)
        for chunk in chunks:
            chunk.to(device.compute_device())
    return chunks


def wrap_ddp(chunks: list[GPTModel], parallel: ParallelConfig,
             whole=None) -> list[DistributedDataParallel]:
    """Wrap each chunk in megatron's DDP (gradient buffers, DP reduction, optimizer sharding).

    ``whole``: a predicate naming the parameters an optimizer steps whole on one
    data-parallel rank (Muon's matrices, :mod:`pretrain.muon`). Under the distributed
    optimizer they get buffers of their own, laid out by megatron's layer-wise optimizer so
    that each parameter lies inside one rank's shard of its bucket: the reduce-scatter then
    leaves every owned matrix's whole gradient on its rank, and the all-gather after the step
    brings its update to the others. The other parameters keep megatron's byte-level shards."""
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=parallel.distributed_optimizer,
    )
    wrapped = [
        DistributedDataParallel(
            config=chunk.config, ddp_config=ddp_config, module=chunk,
            # Megatron-LM's rule: only the first chunk's buffers are bucketed.
            disable_bucketing=index > 0,
            full_param_layout=_whole_layout(chunk, ddp_config, whole),
        )
        for index, chunk in enumerate(chunks)
    ]
    wrapped[0].config.no_sync_func = [c.no_sync for c in wrapped] if len(wrapped) > 1 \
        else wrapped[0].no_sync
    return wrapped


def _whole_layout(chunk, ddp_config: DistributedDataParallelConfig, whole):
    """megatron's layer-wise buffer layout of ``chunk`` (see :func:`wrap_ddp`), or None: DDP's
    own layout. Bucketing is off (no overlapped reduction), so one bucket per buffer."""
    if whole is None or not ddp_config.use_distributed_optimizer:
        return None
    params = [p for _, p in chunk.named_parameters() if p.requires_grad]
    for param in params:
        param.is_managed_by_layer_wise_optimizer = whole(param)
    return LayerWiseDistributedOptimizer.compute_full_param_layout(
        params, None, parallel_state.get_data_parallel_world_size(with_context_parallel=True),
        ddp_config,
        expert_data_parallel_world_size=parallel_state.get_expert_data_parallel_world_size())


def count_parameters(chunks, where=None) -> int:
    """This rank's share of the whole model's parameters: summed over the tensor- and
    pipeline-parallel ranks it gives each parameter once, whatever the layout. A tensor
    replicated on every TP rank (norm weights, biases of row-parallel linears) counts on TP
    rank 0 only (a routed expert's on expert-TP rank 0); the last pipeline stage's copy of
    tied embeddings (megatron marks it ``shared``) and a tensor tied within the rank count
    once. The routed experts' share is summed over the expert-parallel ranks too
    (:func:`model_parameters`). ``where``: count only the parameters it holds true for."""
    return sum(param.numel() for param in _counted(chunks) if where is None or where(param))


def _counted(chunks):
    """The parameters :func:`count_parameters` counts, each once."""
    seen: set[int] = set()
    expert_tp = parallel_state.get_expert_tensor_parallel_group(check_initialized=False)
    for chunk in chunks:
        for param in chunk.parameters():
            if id(param) in seen or not param_is_not_shared(param) \
                    or not param_is_not_tensor_parallel_duplicate(param,
                                                                  expert_tp_group=expert_tp):
                continue
            seen.add(id(param))
            yield param


def model_parameters(chunks) -> int:
    """Parameters of the whole model, the same number under every layout: each rank's
    :func:`count_parameters` summed over its model-parallel group (TP x PP), except the routed
    experts' (marked ``allreduce`` False, :func:`model.moe.mark_experts`: expert parallelism
    splits them over ranks that are data-parallel for the rest), summed over the expert
    model-parallel group (expert TP x EP x PP) instead. A collective: every rank calls it."""
    return sum(model_parameter_parts(chunks))


def model_parameter_parts(chunks) -> tuple[int, int]:
    """The whole model's parameters as (the routed experts', every other), each summed over
    the ranks that split it (:func:`model_parameters`); the routed share is what sets the
    active count of an MoE model (``model.sizes.whole_model_count``). A collective."""
    routed = sum(p.numel() for p in _counted(chunks) if not getattr(p, "allreduce", True))
    dense = count_parameters(chunks) - routed
    return (_summed(routed, parallel_state.get_expert_tensor_model_pipeline_parallel_group()),
            _summed(dense, parallel_state.get_model_parallel_group()))


def _summed(count: int, group) -> int:
    total = torch.tensor([count], dtype=torch.int64, device=device.compute_device())
    torch.distributed.all_reduce(total, group=group)
    return int(total.item())
