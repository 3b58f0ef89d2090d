"""Process groups for one run: torch.distributed, megatron's parallel state, seeds, and how
the ranks agree on a host-side decision."""

from __future__ import annotations

import os
import random
from typing import Protocol

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

from runtime import cpu_compat, device


class Layout(Protocol):
    """The split of one model replica over ranks that the process groups are built for
    (``model.config.ParallelConfig`` is one; the runtime reads only these sizes)."""

    tp: int
    pp: int
    vp: int | None
    cp: int
    ep: int
    expert_tp: int


def initialize(parallel: Layout, seed: int = 1234, graph_safe_rng: bool = False) -> None:
    """Join (or create, for a single process) the default group and build megatron's groups.

    The process is bound to its device first (:mod:`runtime.device`): NCCL on its GPU, or gloo
    on the CPU, where the caller must have entered :func:`runtime.cpu_compat.enabled`. A
    process started without torchrun gets a one-rank group on a free local port.
    ``graph_safe_rng``: megatron's RNG tracker in its CUDA-graph-safe form (CUDA only; see
    :func:`seed_everything`).
    """
    if not device.uses_cuda() and not cpu_compat.active():
        raise RuntimeError("on a CPU, megatron runs inside runtime.cpu_compat.enabled(); "
                           "enter it around the work that initialises process groups")
    if not dist.is_initialized():
        backend = device.distributed_backend()
        bound = device.select()
        # NCCL is told its GPU up front, so that barriers and sub-groups never guess it.
        options = {"device_id": bound} if bound.type == "cuda" else {}
        if "RANK" in os.environ:  # launched by torchrun (or another launcher that sets it)
            dist.init_process_group(backend=backend, **options)
        else:
            # A private one-rank group. Its store listens on a port the OS picks as it binds,
            # so concurrent runs on one machine cannot race for a port, and nothing goes into
            # the environment, where child processes would mistake it for a launcher's.
            store = dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True)
            dist.init_process_group(backend=backend, store=store, rank=0, world_size=1,
                                    **options)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        virtual_pipeline_model_parallel_size=parallel.vp,
        context_parallel_size=parallel.cp,
        expert_model_parallel_size=parallel.ep,
        expert_tensor_parallel_size=parallel.expert_tp,
    )
    seed_everything(seed, graph_safe_rng)


def seed_everything(seed: int, graph_safe_rng: bool = False) -> None:
    """Python's, numpy's and torch's generators, and megatron's model-parallel RNG tracker.
    With ``graph_safe_rng`` (``kernels.cuda_graphs``) the tracker keeps its states in CUDA
    generators that a captured graph advances (megatron's ``use_cudagraphable_rng``), so
    dropout inside a replayed graph draws new numbers each step instead of replaying the
    captured ones; the tracker is made anew either way, so a process seeded twice gets the
    kind it asked for last."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed, use_cudagraphable_rng=graph_safe_rng,
                                    force_reset_rng=True)


def any_rank(flag: bool) -> bool:
    """Whether ``flag`` holds on some rank of the job (one all-reduce on the compute device):
    how the ranks agree on a host-side decision, e.g. to stop or that a write failed."""
    value = torch.tensor([float(flag)], device=device.compute_device())
    dist.all_reduce(value)
    return bool(value.item())


def destroy() -> None:
    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
