"""Let megatron-core's CUDA-assuming code paths run on a CPU-only machine.

megatron-core hard-codes CUDA in a handful of places that are not about compute at all:
causal masks and token counters created with ``device="cuda"``, ``torch.cuda.current_device()``
used as a device argument, the CUDA RNG tracker, stream handles and ``torch.cuda.*Tensor`` type
checks. On a machine without CUDA this module redirects exactly those to the CPU so the same
model code serves the CPU demo and the gloo tests. It does nothing when CUDA is available.

It is a scope, not an import side effect: entry points (the ``pretrain`` CLI for train and eval,
the benchmarks, the test session and each spawned test rank) run their work inside
:func:`enabled`, and :func:`runtime.parallel.initialize` refuses to start on a CPU outside it.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode

from runtime import device

_depth = 0
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
        if kwargs.get("pin_memory"):  # a host copy staged for a GPU (context parallelism's
            kwargs = {**kwargs, "pin_memory": False}  # chunk indices): there is none
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # DistributedOptimizer and grad clipping assert CUDA type names.
            name = func(*args)
            return _CUDA_TYPE_NAMES.get(name, name)
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


class _CpuEvent:
    """Stand-in for a CUDA event: on the CPU, whatever it marks has already happened."""

    def __init__(self, *_args, **_kwargs) -> None:
        pass

    def record(self, _stream=None) -> None:
        pass

    def wait(self, _stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _CpuStream:
    """Stand-in for a CUDA stream: every operation is already synchronous on the CPU.
    Constructible, as megatron's MoE token dispatcher makes its own side stream."""

    def __init__(self, *_args, **_kwargs) -> None:
        pass

    def wait_stream(self, _stream) -> None:
        pass

    def wait_event(self, _event) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event=None):
        return _CpuEvent() if event is None else event


def _cpu_rng_state(*_args, **_kwargs) -> torch.Tensor:
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state, *_args, **_kwargs) -> None:
    torch.set_rng_state(new_state)


@functools.lru_cache(maxsize=16)
def _causal_mask(sq: int) -> torch.Tensor:
    return torch.ones(sq, sq, dtype=torch.bool).triu(1)


def _host_copy(tensor, as_numpy: bool = False, record_stream: bool = False):
    """megatron's ``maybe_move_tensor_to_cpu`` as it behaves for a CUDA tensor, for a CPU one:
    a host copy, as a NumPy array when asked. megatron copies only CUDA tensors, so on the CPU
    its all-to-all dispatcher would hand ``all_to_all_single`` its split sizes as tensors,
    which torch's binding refuses (it takes a sequence of ints, as the arrays it gets on CUDA
    are)."""
    if not torch.is_tensor(tensor):
        return tensor
    copy = tensor.detach().clone()
    return copy.numpy() if as_numpy else copy


def _gather_uneven(original, input_, group, output_split_sizes=None, use_global_buffer=False):
    """megatron's gather along the first dimension (``tensor_parallel.mappings``), with
    per-rank sizes too: its ``torch.distributed.all_gather`` into pieces of different lengths
    is refused by gloo, which gathers equal pieces only. Each rank's piece is padded to the
    longest, gathered, and cut back. megatron gathers uneven pieces where the MoE dispatcher
    collects an expert's tokens over its expert-tensor-parallel ranks
    (``parallel.etp`` > 1 with experts)."""
    if output_split_sizes is None or group.size() == 1:
        return original(input_, group, output_split_sizes, use_global_buffer)
    longest = max(output_split_sizes)
    padded = input_.new_zeros((longest, *input_.shape[1:]))
    padded[: input_.shape[0]] = input_
    gathered = input_.new_empty((longest * group.size(), *input_.shape[1:]))
    torch.distributed.all_gather_into_tensor(gathered, padded, group=group)
    return torch.cat([piece[:size] for piece, size in
                      zip(gathered.split(longest), output_split_sizes, strict=True)])


def _current_device() -> torch.device:
    """The CPU, as megatron's allocations name a device."""
    return torch.device("cpu")


def prepare_compile() -> None:
    """Let torch.compile fold the stand-in for ``torch.cuda.current_device`` into a graph as
    a constant, as it folds the function it stands in for: installed in ``torch.cuda``, Dynamo
    takes it for a torch op returning a non-tensor and breaks the graph there (megatron's
    sequence-parallel collectives allocate with it: 17 breaks in a 2-block TP=2 step).
    Dynamo's list is private; were it gone, compiled blocks would still run, with those
    breaks, which the TP=2 compiled-block test counts."""
    import torch._dynamo.variables.torch as dynamo_torch

    folded = getattr(dynamo_torch, "constant_fold_functions", None)
    if isinstance(folded, dict):
        folded.setdefault(_current_device, None)


_PATCHES = {  # torch.cuda's functions that megatron calls for bookkeeping, on the CPU
    "current_device": _current_device,
    "synchronize": lambda *a, **k: None,
    "current_stream": lambda *a, **k: _CpuStream(),
    "stream": lambda *a, **k: contextlib.nullcontext(),
    "Stream": _CpuStream,
    "Event": _CpuEvent,
    # The RNG tracker seeds its named states through this; the CPU generator stands in.
    "manual_seed": lambda seed: torch.default_generator.manual_seed(seed),
    "get_rng_state": _cpu_rng_state,
    "set_rng_state": _set_cpu_rng_state,
}


def _megatron_targets() -> list[tuple[object, str, object]]:
    """(module, attribute, CPU replacement) for megatron's private CUDA helpers."""
    from megatron.core.fusions import fused_softmax
    from megatron.core.tensor_parallel import mappings
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer import utils
    from megatron.core.transformer.moe import token_dispatcher

    return [
        # megatron's RNG tracker saves/restores CUDA generator state: the CPU generator's.
        (mrandom, "_get_cuda_rng_state", _cpu_rng_state),
        (mrandom, "_set_cuda_rng_state", _set_cpu_rng_state),
        # The causal mask helper builds on "cuda". It also runs inside backward when
        # activations are recomputed, where the device-rewriting mode is not active (torch
        # switches a mode off while it handles ``torch.autograd.backward``), so it is replaced.
        (utils, "get_default_causal_mask", _causal_mask),
        (fused_softmax, "get_default_causal_mask", _causal_mask),
        # The MoE all-to-all dispatcher's split sizes (megatron/core/transformer/moe/
        # token_dispatcher.py, _maybe_dtoh_and_synchronize).
        (token_dispatcher, "maybe_move_tensor_to_cpu", _host_copy),
        (mappings, "_gather_along_first_dim",
         functools.partial(_gather_uneven, mappings._gather_along_first_dim)),
    ]


def active() -> bool:
    """Whether the CPU layer is in force (inside :func:`enabled` on a machine without CUDA)."""
    return _depth > 0


@contextlib.contextmanager
def enabled() -> Iterator[bool]:
    """Run a block with megatron's CUDA bookkeeping redirected to the CPU; yields whether the
    layer is in force (False with CUDA, where it does nothing). Entry points wrap their work in
    it; on exit every patched attribute gets its original back and the mode is left. Nested
    uses share the outermost one."""
    global _depth
    if device.uses_cuda():
        yield False
        return
    with _lock:
        _depth += 1
        outermost = _depth == 1
        if outermost:
            targets = [(torch.cuda, name, fn) for name, fn in _PATCHES.items()]
            targets += _megatron_targets()
            saved = [(obj, name, getattr(obj, name)) for obj, name, _ in targets]
            for obj, name, replacement in targets:
                setattr(obj, name, replacement)
            mode = _CudaToCpu()
            mode.__enter__()
    try:
        yield True
    finally:
        with _lock:
            _depth -= 1
            if outermost:
                mode.__exit__(None, None, None)
                for obj, name, original in saved:
                    setattr(obj, name, original)
