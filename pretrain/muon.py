"""``optim.name = "muon"``: torch.optim.Muon for the blocks' linear weights, AdamW for the rest.

The split is the parameter registry's (:func:`model.decay.muon_matrix`): the weights of the
blocks' attention and MLP linear layers. Everything else (embeddings, the output layer, norms,
biases, gates, learned scalars, the hyper-connection schemes' own matrices, routers) stays with
AdamW, as in "Muon is Scalable for LLM Training" and torch's own guidance.

Both are megatron optimizers chained (megatron's ``ChainedOptimizer``): megatron's own AdamW,
built by the code path ``get_megatron_optimizer`` takes, and a megatron wrapper around
:class:`MatrixMuon`. The wrappers keep what they do for AdamW: fp32 main parameters under bf16,
one global gradient norm and clip over both, sharded checkpoint state, and parameter groups the
LR scheduler steps (each Muon group carries its own peak and final LR and weight decay).

The update is torch's: :class:`MatrixMuon` is ``torch.optim.Muon`` whose ``step`` runs
unchanged on the whole matrices one process would hold:

- a tensor-parallel shard is gathered along its partition dimension (the gradient, the
  momentum and the weight), stepped whole, and this rank's shard kept: the Newton-Schulz
  iteration and the shape-based LR adjustment see the whole matrix;
- a fused weight that is several matrices is stepped per part: QKV as Q, K and V, the SwiGLU's
  fc1 as its gate and up halves. That is what torch.optim.Muon does to a model whose layers
  are separate (the unfused Llama layout the export writes), and what Megatron-LM's split_qkv
  does: the fusion is a kernel choice and must not change the optimizer.

On one process, for a matrix that is neither, the tensors handed to torch are the parameter,
its gradient and its momentum themselves. Gathering costs three all-gathers of each matrix per
step and a whole matrix's memory per TP rank for the update's duration.
"""

from __future__ import annotations

import torch
from megatron.core.optimizer import (
    ChainedOptimizer,
    Float16OptimizerWithFloat16Params,
    FP32Optimizer,
    OptimizerConfig,
    _get_megatron_optimizer_based_on_param_groups,
    _get_param_groups,
)
from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer
from megatron.core.optimizer.optimizer_config import ParamKey, ParamPredicate
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.mlp import MLP
from megatron.core.utils import get_pg_rank

from model import decay
from runtime.errors import ConfigError

PARTS = "muon_parts"
"""The parameter attribute of a fused weight: the rows of each part within one group of rows
(QKV: one query group's Q, K and V rows; the SwiGLU's fc1: its gate and up halves)."""


def mark_parts(chunks) -> None:
    """Tag the fused block weights with their parts (:data:`PARTS`), from megatron's modules."""
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, SelfAttention):
                c = module.config
                per_group = c.num_attention_heads // c.num_query_groups * c.kv_channels
                setattr(module.linear_qkv.weight, PARTS,
                        (per_group, c.kv_channels, c.kv_channels))
            elif isinstance(module, MLP) and module.config.gated_linear_unit:
                half = module.linear_fc1.weight.shape[0] // 2  # this rank's rows of each
                setattr(module.linear_fc1.weight, PARTS, (half, half))


def _split(tensor: torch.Tensor, sizes) -> list[torch.Tensor]:
    """The parts of ``tensor`` (rows grouped as ``sizes`` repeated), each as one matrix."""
    if sizes is None:
        return [tensor]
    cols = tensor.shape[-1]
    grouped = tensor.view(-1, sum(sizes), cols)
    return [part.reshape(-1, cols) for part in grouped.split(list(sizes), dim=1)]


def _join(parts: list[torch.Tensor], sizes, like: torch.Tensor) -> torch.Tensor:
    if sizes is None:
        return parts[0]
    cols = like.shape[-1]
    return torch.cat([part.view(-1, size, cols) for part, size in zip(parts, sizes, strict=True)],
                     dim=1).view_as(like)


class _Whole:
    """One Muon parameter as the whole matrices torch steps (its parts, TP shards gathered),
    and the way back to this rank's tensors."""

    def __init__(self, param, grad, buf, tp_group):
        self.param, self.buf = param, buf
        self.sizes = getattr(param, PARTS, None)
        sharded = (getattr(param, "tensor_model_parallel", False) and tp_group is not None
                   and torch.distributed.get_world_size(tp_group) > 1)
        self.dim = param.partition_dim if sharded else None
        self.group = tp_group
        if self.sizes is None and self.dim is None:  # torch's own tensors, stepped in place
            self.params, self.grads, self.bufs = [param], [grad], [buf]
            return
        self.params, self.grads, self.bufs = (
            [self._gather(part) for part in _split(t, self.sizes)] for t in (param, grad, buf))

    def _gather(self, part: torch.Tensor) -> torch.Tensor:
        if self.dim is None:
            return part.contiguous()
        size = torch.distributed.get_world_size(self.group)
        shards = [torch.empty_like(part) for _ in range(size)]
        torch.distributed.all_gather(shards, part.contiguous(), group=self.group)
        return torch.cat(shards, dim=self.dim)

    def _local(self, whole: torch.Tensor) -> torch.Tensor:
        if self.dim is None:
            return whole
        size = torch.distributed.get_world_size(self.group)
        return whole.chunk(size, dim=self.dim)[torch.distributed.get_rank(self.group)]

    def write_back(self) -> None:
        if self.sizes is None and self.dim is None:
            return
        for local, wholes in ((self.param, self.params), (self.buf, self.bufs)):
            local.copy_(_join([self._local(w) for w in wholes], self.sizes, local))


class MatrixMuon(torch.optim.Muon):
    """torch.optim.Muon stepping the whole matrices behind TP shards and fused weights.

    torch's ``step`` collects each group's parameters, gradients and momentum buffers in
    ``_init_group`` and hands them to its Muon function; this class's ``_init_group`` hands it
    the whole matrices instead (:class:`_Whole`), and ``step`` writes the stepped weights and
    momenta back to this rank's tensors. The arithmetic is torch's, whatever its version."""

    def __init__(self, params, tp_group=None, **kwargs):
        super().__init__(params, **kwargs)
        self.tp_group = tp_group
        self._stepped: list[_Whole] = []

    def _init_group(self, group, params_with_grad, grads, muon_momentum_bufs):
        has_complex = super()._init_group(group, params_with_grad, grads, muon_momentum_bufs)
        local = list(zip(params_with_grad, grads, muon_momentum_bufs, strict=True))
        for found in (params_with_grad, grads, muon_momentum_bufs):
            found.clear()
        for param, grad, buf in local:
            whole = _Whole(param, grad, buf, self.tp_group)
            params_with_grad += whole.params
            grads += whole.grads
            muon_momentum_bufs += whole.bufs
            self._stepped.append(whole)
        return has_complex

    @torch.no_grad()
    def step(self, closure=None):
        self._stepped = []
        try:
            return super().step(closure)
        finally:
            for whole in self._stepped:
                whole.write_back()
            self._stepped = []


def _init_momentum(opt: torch.optim.Optimizer, config=None) -> None:
    """A zero momentum for every parameter (the template a checkpoint load fills)."""
    for group in opt.param_groups:
        for param in group["params"]:
            if "momentum_buffer" not in opt.state[param]:
                opt.state[param]["momentum_buffer"] = torch.zeros_like(param)


def peak_and_final_lr(o) -> tuple[float, float]:
    """The Muon groups' peak and final LR (``o``: the optim section): muon_lr (0: lr) and the
    same fraction of it that min_lr is of lr."""
    if not o.muon_lr:
        return o.lr, o.min_lr
    return o.muon_lr, o.muon_lr * o.min_lr / o.lr


MARK = {"optimizer": "muon"}
"""What a Muon parameter group carries (megatron's own key for an emerging optimizer's)."""


def build(config, chunks, optimizer_config: OptimizerConfig, overrides: dict):
    """megatron's AdamW for the parameters that are not Muon's, chained with megatron wrappers
    around :class:`MatrixMuon` for those that are (``config``: the run's Config).

    Each optimizer comes in two, as megatron's own chain does: one for the dense parameters,
    one for the routed experts' (stepped with their own data-parallel and tensor-parallel
    groups). Under the distributed optimizer AdamW keeps megatron's byte-level shards and the
    Muon matrices go to megatron's ``LayerWiseDistributedOptimizer``: each data-parallel rank
    steps the whole matrices the buffer layout gave it (:func:`model.builder.wrap_ddp`) and
    keeps their momentum only, and the updated weights reach the other ranks through DDP's
    parameter all-gather."""
    o = config.optim
    _require_sequential_experts(chunks)
    mark_parts(chunks)
    peak, final = peak_and_final_lr(o)
    muon_key = ParamKey(predicate=ParamPredicate(name="muon", fn=decay.muon_matrix))
    overrides = {**overrides, muon_key: {**MARK, "max_lr": peak, "min_lr": final,
                                         "start_wd": o.muon_weight_decay,
                                         "end_wd": o.muon_weight_decay}}
    groups = _get_param_groups(chunks, optimizer_config, overrides)
    processes = ProcessGroupCollection.use_mpu_process_groups()
    matrices = []
    for expert in (False, True):
        mine = [g for g in groups if _is_muon(g) and g["is_expert_parallel"] == expert]
        if mine:
            tp = processes.expt_tp if expert else processes.tp
            matrices.append((MatrixMuon(
                mine, tp_group=tp, lr=peak, weight_decay=o.muon_weight_decay,
                momentum=o.muon_momentum, nesterov=o.muon_nesterov, ns_steps=o.muon_ns_steps,
                adjust_lr_fn=str(o.muon_adjust_lr_fn)), expert))
    adams = _adams(optimizer_config, chunks, [g for g in groups if not _is_muon(g)])
    if optimizer_config.use_distributed_optimizer:
        sharded = LayerWiseDistributedOptimizer(
            [muon if optimizer_config.bf16 else _NestedFP32(muon, optimizer_config,
                                                            _init_momentum)
             for muon, _ in matrices], optimizer_config, processes,
            init_state_fn_list=[_init_momentum] * len(matrices), model_chunks=chunks)
        for inner in sharded.chained_optimizers:
            _carry_parts(inner)
        return ChainedOptimizer([*adams, sharded])
    wrapped = []
    for muon, expert in matrices:
        inner = (Float16OptimizerWithFloat16Params(muon, optimizer_config, None, _init_momentum)
                 if optimizer_config.bf16 else FP32Optimizer(muon, optimizer_config,
                                                             _init_momentum))
        _carry_parts(inner)
        inner.grad_stats_parallel_group = processes.tp_ep_pp if expert else processes.mp
        inner.tp_group = inner.expert_tp_group = processes.expt_tp if expert else processes.tp
        wrapped.append(inner)
    return ChainedOptimizer([*adams, *wrapped])


def _require_sequential_experts(chunks) -> None:
    """Refuse routed experts on Transformer Engine's grouped GEMM (``model.transformer_impl``
    auto where TE is installed): their per-expert weights are not block linears, so Muon would
    leave them to AdamW without a word. megatron's SequentialMLP holds each expert as an MLP of
    its own, which :func:`mark_parts` and the parameter registry see."""
    for chunk in chunks:
        for module in chunk.modules():
            if type(module).__name__ == "TEGroupedMLP":
                raise ConfigError(
                    "optim.name muon does not step the routed experts of Transformer Engine's "
                    "grouped GEMM (model.transformer_impl auto chose te) yet: set "
                    "--model.transformer_impl=local")


class _NestedFP32(FP32Optimizer):
    """megatron's fp32 wrapper with its checkpoint state under "optimizer", where the bf16
    wrapper keeps it and where ``LayerWiseDistributedOptimizer``'s checkpoint code reads it
    (megatron builds the layer-wise optimizer for bf16 runs only; fp32 runs are ours)."""

    def sharded_state_dict(self, model_sharded_state_dict, is_loading=False, metadata=None):
        return {"optimizer": super().sharded_state_dict(model_sharded_state_dict, is_loading,
                                                        metadata)}

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict["optimizer"])


def _is_muon(group: dict) -> bool:
    return group.get("optimizer") == MARK["optimizer"]


def _carry_parts(inner) -> None:
    """The parts of a fused weight (:data:`PARTS`) on its fp32 main copy too (bf16 runs)."""
    for model_params, main_params in zip(getattr(inner, "float16_groups", []),
                                         getattr(inner, "fp32_from_float16_groups", []),
                                         strict=True):
        for model_param, main_param in zip(model_params, main_params, strict=True):
            if hasattr(model_param, PARTS):
                setattr(main_param, PARTS, getattr(model_param, PARTS))


def _adams(optimizer_config: OptimizerConfig, chunks, groups: list[dict]) -> list:
    """megatron's AdamW for ``groups`` as ``get_megatron_optimizer`` builds it: the dense
    parameters' and the routed experts', each with its process groups; under the distributed
    optimizer over DDP's buffers of these parameters only (not the layer-wise Muon ones)."""
    found = ProcessGroupCollection.setup_process_groups_for_optimizer(None, chunks, True)
    adams = []
    for expert in (False, True):
        mine = [g for g in groups if g["is_expert_parallel"] == expert]
        if not mine and expert:
            continue
        buffer_name = "expert_parallel_buffers" if expert else "buffers"
        buffers = {index: [b for b in getattr(chunk, buffer_name) if not _layer_wise(b)]
                   for index, chunk in enumerate(chunks)}
        mp = found["expt_tp_pp_with_egtp_remat_group" if expert else "mp_group"]
        adams.append(_get_megatron_optimizer_based_on_param_groups(
            config=optimizer_config, model_chunks=chunks, param_groups=mine,
            per_model_buffers=buffers, model_parallel_group=mp,
            data_parallel_group=found["intra_expt_dp_group" if expert else "intra_dp_cp_group"],
            data_parallel_group_gloo=found["intra_expt_dp_group_gloo" if expert
                                           else "intra_dp_cp_group_gloo"],
            data_parallel_group_idx=get_pg_rank(mp),
            intra_dist_opt_group=found["intra_dist_opt_group"],
            distributed_optimizer_instance_id=0))
    return adams


def _layer_wise(buffer) -> bool:
    return bool(buffer.params) and getattr(buffer.params[0],
                                           "is_managed_by_layer_wise_optimizer", False)
