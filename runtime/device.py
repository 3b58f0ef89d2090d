"""Which device this process computes on: the one place that decides it.

A process computes on its own GPU when CUDA is available (the one its launcher's LOCAL_RANK
names, as torchrun and slurm lay ranks out: one per GPU), and on the CPU otherwise. Everything
that creates a tensor for the model, the data, a collective or a statistic asks
:func:`compute_device`; the process group's backend follows from the same choice (NCCL with
CUDA, gloo without), so a collective's tensors always live where its backend expects them.

To run on the CPU on a machine that has GPUs (a gloo test with more ranks than GPUs, say),
hide the GPUs from the process before it starts: ``CUDA_VISIBLE_DEVICES=""``. Then this
machine looks exactly like a CPU machine to torch, megatron and Triton alike.

torch is imported by each function, not by this module: the config's checks ask here whether
Transformer Engine or CUDA can be used (``model.backends``, ``kernels.backend``), and loading
a config must not cost torch's import (a second or more), so that a mistake in it is said at
once.
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def uses_cuda() -> bool:
    """True when this process computes on a GPU."""
    import torch

    return torch.cuda.is_available()


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


def select() -> torch.device:
    """Bind this process to its device (call once, before any CUDA work) and return it.

    With CUDA, the GPU is LOCAL_RANK: launching more ranks per node than it has visible GPUs is
    an error here rather than two NCCL ranks on one GPU, which NCCL refuses later, less clearly.
    """
    import torch

    if not uses_cuda():
        return torch.device("cpu")
    rank, count = local_rank(), torch.cuda.device_count()
    if rank >= count:
        raise RuntimeError(
            f"LOCAL_RANK ({rank}) needs a GPU of its own but this node shows {count}; launch "
            f"at most {count} ranks per node, or hide the GPUs (CUDA_VISIBLE_DEVICES='') to "
            "run every rank on the CPU")
    torch.cuda.set_device(rank)
    return torch.device("cuda", rank)


def compute_device() -> torch.device:
    """The device this process's model, batches and collectives live on."""
    import torch

    if uses_cuda():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def distributed_backend() -> str:
    """torch.distributed's backend for tensors on :func:`compute_device`."""
    return "nccl" if uses_cuda() else "gloo"


def device_name() -> str:
    """The accelerator's marketing name (e.g. "NVIDIA H100 80GB HBM3"), or "cpu"."""
    import torch

    return torch.cuda.get_device_name(compute_device()) if uses_cuda() else "cpu"


def peak_memory_gib() -> float | None:
    """Peak memory allocated on this process's GPU so far, in GiB (None on the CPU)."""
    import torch

    if not uses_cuda():
        return None
    return torch.cuda.max_memory_allocated(compute_device()) / 2**30


def make_deterministic() -> None:
    """Make every GPU kernel of a run reproducible bit for bit (``run.deterministic``).

    Call before the process group and the first CUDA kernel: cuBLAS reads its workspace
    setting when it creates its handle and NCCL reads its algorithm when the communicator is
    built. What each setting removes: cuBLAS's split-K reductions over several streams
    (a fixed workspace per stream); NCCL's choice between ring and tree, and between protocols,
    which sum in different orders by message size (ring only); torch's atomic-add kernels,
    including SDPA's flash and memory-efficient backward passes, which switch to their
    deterministic variants and rule out cuDNN attention (torch's deterministic mode raises
    for any op that has no deterministic form, instead of silently varying). Transformer
    Engine, if used, is told the same. On the CPU, where runs are deterministic already, it
    only enables torch's checks.
    """
    import torch

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    os.environ.setdefault("NCCL_ALGO", "Ring")
    os.environ["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] = "0"
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def te_unavailable_reason() -> str | None:
    """Why Transformer Engine cannot be used by this process, or None when it can: the one
    place TE is detected (norm backends, attention and linear layers all ask here).

    TE is imported only after CUDA is known to exist: with TE installed on a machine without
    CUDA, importing it raises (not ImportError) and breaks megatron's own imports."""
    if not uses_cuda():
        return "no CUDA device on this machine"
    return None if te_importable() else "transformer_engine is not installed or failed to import"


@functools.cache
def te_importable() -> bool:
    """megatron's TE wrappers import and found TE (only ever called with CUDA present)."""
    try:
        from megatron.core.extensions import transformer_engine as te_ext
    except Exception:  # a broken TE raises RuntimeError/OSError, not only ImportError
        return False
    return bool(te_ext.HAVE_TE)
