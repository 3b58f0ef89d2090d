"""The routers of a mixture-of-experts model, watched: their balancing losses and where their
tokens go, at every logged step.

Why: a router that sends most tokens to a few experts wastes the others' parameters and
compute, and the loss curve does not show it; megatron's balancing losses only say how hard
the router is being pushed back. Both, and the loads themselves, are logged per step
(metrics.jsonl, W&B, the console line, the run's report), and a router that stays
imbalanced or collapsed, or recovers, is said (``pretrain.report.expert_load.RouterVerdicts``).

- **Losses**, as megatron computes and keeps them: each router adds its balancing loss (the
  type of ``model.moe_router_load_balancing_type``) and z-loss, without their coefficients,
  to megatron's MoE metrics tracker once per micro-batch. At a logged step the tracker is
  reduced as Megatron-LM's training loop does it (``MoEMetricsTracker.report``: summed over
  pipeline stages, each layer's own reduction over tensor-parallel ranks, averaged over
  data-parallel ranks), scaled by 1 / micro-batches and averaged over the MoE blocks:
  ``moe_aux_loss`` and ``moe_z_loss``. The tracker is cleared when each step begins, so a
  logged value is that step's alone, whatever ran between steps.
- **Loads**: a forward hook on each router reads the routing map it returns (tokens x experts,
  after the capacity factor: what each expert was given) and adds, per expert, the tokens
  it received, and the tokens it routed, into one tensor shaped for the whole model. One
  all-reduce over every rank at a logged step sums them: data- and expert-parallel ranks
  route different tokens, tensor-parallel ranks hold disjoint slices of the sequence (MoE
  needs sequence parallelism), and each pipeline stage fills only the rows of its own
  blocks, so the sum describes the whole global batch of every block on every rank. The
  hook counts only a training forward with gradients: activation recomputation runs a
  block once without gradients and again with them (counted once), and validation and
  downstream scoring run without (not counted). What the counts mean:
  ``pretrain.report.expert_load``.

Per logged step the record gets ``moe_aux_loss``, ``moe_z_loss`` (each when its coefficient
is set), ``moe_max_load``, ``moe_min_load``, ``moe_dropped`` (with a capacity factor) and
``moe_load/block<NN>``; ``experts.jsonl`` in the run folder gets the raw counts, and W&B
alone every expert's load (:attr:`RouterWatch.expert_loads`). A dense
model gets none of it: :func:`build` returns None and no hook exists.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
from megatron.core.transformer.moe.router import TopKRouter

from model.schemes import LoadBalancing
from pretrain.config import Config
from pretrain.data.batches import microbatches_per_step
from pretrain.report.expert_load import (
    FILE,
    BlockLoad,
    Health,
    RouterVerdicts,
    expert_load_fields,
    load_fields,
)
from pretrain.report.metrics import strict_json
from runtime import device

log = logging.getLogger("pretrain")

BALANCING_LOSS = {LoadBalancing.AUX_LOSS: "load_balancing_loss",
                  LoadBalancing.SEQ_AUX_LOSS: "seq_load_balancing_loss",
                  LoadBalancing.GLOBAL_AUX_LOSS: "global_load_balancing_loss"}
"""megatron's tracker name of each balancing loss type."""
Z_LOSS = "z_loss"


def tracked_losses(config: Config) -> dict[str, str]:
    """{metrics key: megatron's tracker name} of the losses the routers record: the balancing
    loss when its coefficient is set, the z-loss when its coefficient is."""
    m = config.model
    found = {}
    if m.moe_aux_loss_coeff > 0 and m.moe_router_load_balancing_type in BALANCING_LOSS:
        found["moe_aux_loss"] = BALANCING_LOSS[m.moe_router_load_balancing_type]
    if m.moe_z_loss_coeff > 0:
        found["moe_z_loss"] = Z_LOSS
    return found


class RouterWatch:
    """Hooks on this rank's routers for the life of the run. Per training step::

        watch.step_begins()
        forward_backward(...)
        record.update(watch.measure(step))   # logged steps only; collective
    """

    def __init__(self, config: Config, chunks: list, run_dir: Path | None, logs: bool):
        m, d = config.model, config.data
        self.num_experts, self.topk = m.num_experts, m.moe_router_topk
        self.num_layers = m.num_layers
        self.layer_freq = m.moe_layer_freq
        self.blocks = [i for i, moe in enumerate(m.moe_blocks) if moe]
        self.capacity = m.moe_expert_capacity_factor is not None
        self.padded = m.moe_pad_expert_input_to_capacity
        self.microbatches = microbatches_per_step(d.global_batch_size, d.micro_batch_size)
        self.losses = tracked_losses(config)
        self.path = run_dir / FILE if run_dir is not None and logs else None
        self.logs = logs
        self.verdicts = RouterVerdicts(self.num_experts, self.topk, config.optim.warmup_steps,
                                       config.run.log_interval, m.moe_aux_loss_coeff)
        self.expert_loads: dict[str, float] = {}
        """Every expert's load at the last measured step, for W&B alone (logging rank)."""
        # per global block: tokens received by each expert, then the tokens routed
        self.counts = torch.zeros(self.num_layers, self.num_experts + 1, dtype=torch.float64,
                                  device=device.compute_device())
        self.routers = [m for c in chunks for m in c.modules() if isinstance(m, TopKRouter)]
        self.handles = [r.register_forward_hook(self._counted) for r in self.routers]

    def step_begins(self) -> None:
        """Forget what the last step, or anything run since (validation), left behind."""
        get_moe_metrics_tracker().clear()
        self.counts.zero_()

    def _counted(self, router, _inputs, output) -> None:
        if not (router.training and torch.is_grad_enabled()):
            return  # validation, or the first pass of a recomputed block
        probs, routing_map = output
        if self.padded:  # the map holds the padding up to capacity; a padded slot has prob 0
            routing_map = routing_map & (probs.detach() != 0)
        row = self.counts[router.layer_number - 1]  # global 1-based index, whatever the stage
        row[:-1] += routing_map.sum(dim=0)  # stays on the device: no host sync in the step
        row[-1] += routing_map.shape[0]

    def measure(self, step: int) -> dict:
        """The record fields of the step just taken (collective: every rank calls it at the
        same steps); on the logging rank also its line of experts.jsonl and, once per block,
        the routers' verdicts."""
        fields = self._losses(step)
        counts = self.counts.clone()
        dist.all_reduce(counts)
        loads = [BlockLoad(b, tuple(int(v) for v in counts[b, :-1].tolist()),
                           int(counts[b, -1]) * self.topk) for b in self.blocks]
        fields.update(load_fields(loads, self.capacity))
        if self.path is not None:
            self._write(step, loads)
        if self.logs:
            self.expert_loads = expert_load_fields(loads)
            for health, line in self.verdicts.observe(step, loads):  # a recovery is news
                log.log(logging.INFO if health is Health.EVEN else logging.WARNING, "%s", line)
        return fields

    def _losses(self, step: int) -> dict:
        """megatron's tracker reduced as Megatron-LM's loop reduces it, then cleared."""
        if not self.losses:
            return {}
        tracker = get_moe_metrics_tracker()
        names = list(self.losses.values())
        for name in names:  # a stage without MoE blocks joins the reduction with zeros
            tracker.ensure_initialized(name, self.num_layers, device=device.compute_device())
        totals: dict = {}
        tracker.report(loss_scale=1.0 / self.microbatches, iteration=step, track_names=names,
                       num_layers=self.num_layers, moe_layer_freq=self.layer_freq,
                       total_loss_dict=totals)
        return {key: float(totals[name]) for key, name in self.losses.items()}

    def _write(self, step: int, loads: list[BlockLoad]) -> None:
        line = {"step": step, "topk": self.topk, "tokens": loads[0].routed // self.topk,
                "received": {str(b.block): list(b.received) for b in loads}}
        if self.capacity:
            line["dropped"] = {str(b.block): b.dropped for b in loads}
        with self.path.open("a") as f:
            f.write(strict_json(line) + "\n")


def build(config: Config, chunks: list, run_dir: Path | None, logs: bool) -> RouterWatch | None:
    """The run's router watch; None for a dense model (no hook, no field, no file)."""
    if not config.model.num_experts:
        return None
    return RouterWatch(config, chunks, run_dir, logs)
