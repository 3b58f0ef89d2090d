"""Let megatron-core's CUDA-assuming code paths run on a CPU-only machine.

megatron-core hard-codes CUDA in a handful of places that are not about compute at all:
causal masks and token counters created with ``device="cuda"``, ``torch.cuda.current_device()``
used as a device argument, the CUDA RNG tracker, stream handles and ``torch.cuda.*Tensor`` type
checks. On a machine without CUDA this module redirects exactly those to the CPU so the same
model code serves the CPU demo and the gloo tests. It does nothing when CUDA is available, and
installing it twice is a no-op.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import torch
from torch.overrides import TorchFunctionMode

from model import device

_installed = False
_lock = threading.Lock()


def _is_cuda_device(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


class _CudaToCpu(TorchFunctionMode):
    """Rewrites ``device='cuda'`` arguments and ``.cuda()`` calls to the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = {**kwargs, "device": "cpu"}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # DistributedOptimizer and grad clipping assert CUDA type names.
            name = func(*args)
            return _CUDA_TYPE_NAMES.get(name, name)
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


class _CpuStream:
    """Stand-in for a CUDA stream: every operation is already synchronous on the CPU."""

    def wait_stream(self, _stream) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event=None):
        return event


def _cpu_rng_state(*_args, **_kwargs) -> torch.Tensor:
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state, *_args, **_kwargs) -> None:
    torch.set_rng_state(new_state)


def _patch_megatron_rng() -> None:
    """megatron's RNG tracker saves/restores CUDA generator state; use the CPU generator."""
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = _cpu_rng_state
    mrandom._set_cuda_rng_state = _set_cpu_rng_state


@functools.lru_cache(maxsize=16)
def _causal_mask(sq: int) -> torch.Tensor:
    return torch.ones(sq, sq, dtype=torch.bool).triu(1)


def _patch_causal_mask() -> None:
    """The causal mask helper builds on "cuda". It also runs inside backward when activations
    are recomputed, where the device-rewriting mode is not active (torch switches a mode off
    while it handles ``torch.autograd.backward``), so it is replaced outright."""
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils

    utils.get_default_causal_mask = fused_softmax.get_default_causal_mask = _causal_mask


def install() -> bool:
    """Install the CPU redirections once per process. Returns True when they are active."""
    global _installed
    if device.uses_cuda():
        return False
    with _lock:
        if _installed:
            return True
        torch.cuda.current_device = lambda: torch.device("cpu")
        torch.cuda.synchronize = lambda *a, **k: None
        torch.cuda.current_stream = lambda *a, **k: _CpuStream()
        torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
        # The RNG tracker seeds its named states through this; the CPU generator stands in.
        torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(seed)
        torch.cuda.get_rng_state = _cpu_rng_state
        torch.cuda.set_rng_state = _set_cpu_rng_state
        _CudaToCpu().__enter__()
        _patch_megatron_rng()
        _patch_causal_mask()
        _installed = True
    return True
