"""Programs resident per SM of a compiled Triton kernel, and the grid of the backward launches
that follows from it.

The backward kernels run a fixed grid of programs, each looping over a contiguous block of
rows and writing one fp32 weight-gradient partial, summed afterwards. Their grid is best one
wave: as many programs as the GPU holds at once, no more. How many an SM holds is a property
of the compiled kernel (registers per thread, shared memory per program, warps per program),
and it varies widely: at hidden 2048 the entry's backward takes 75 registers a thread in one
variant and 245 in another, so a fixed guess of warps per SM either leaves SMs half empty or
adds a tail wave.
The grid is therefore sized from the kernel Triton compiles for the launch, by the rules the
hardware allocates registers, warps and shared memory with.

The arithmetic is plain functions of numbers (so tests check it by hand without a GPU, and
``bench.kernel_resources`` applies the same rules, on a CPU machine, to the numbers it reads
from the cubins Triton builds);
:func:`resident_programs` is the one place that asks Triton and the driver.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

# Per SM, for the architectures Triton targets here: register file, warps, programs, and
# shared memory a kernel may use (KiB), from NVIDIA's tuning guides. A device's own
# properties replace these where torch exposes them (:func:`device_limits`).
REGISTERS, MAX_WARPS, MAX_PROGRAMS = 65536, 64, 32
SHARED_KIB = {80: 164, 90: 228, 100: 228}
RESERVED_SHARED = 1024  # bytes the system keeps per resident program (sm_80 on)
# Programs per SM on architectures outside the table: the fewest any of sm_75 to sm_120 holds
# (16, sm_75 and sm_86), so an unknown GPU gets a grid under one wave, never a tail wave.
OTHER_MAX_PROGRAMS = 16
WARP = 32  # threads per warp on NVIDIA GPUs

# Rows per backward program at least: fewer would make the fp32 partials (programs x width
# each) a sizeable part of the traffic next to the rows they sum.
MIN_ROWS_PER_PROGRAM = 16
# Programs of an interpreted backward (no GPU): a few, so tests see several partials summed.
INTERPRETED_PROGRAMS = 4
# Programs per SM a backward kernel is held to where its compiler can fit them without
# spilling: with one, each row's reductions (a barrier each) stall every warp on the SM at
# once; a second program's warps run meanwhile.
TARGET_PROGRAMS = 2


class Resources(NamedTuple):
    """What one program of a compiled kernel takes."""

    registers: int  # per thread
    local: int  # bytes of local memory per thread: where its spilled registers go
    shared: int  # bytes of shared memory per program


class Limits(NamedTuple):
    """What one SM offers the programs resident on it."""

    registers: int  # 32-bit registers in its register file
    max_warps: int
    max_programs: int
    shared: int  # bytes of shared memory its programs may use together
    reserved_shared: int  # bytes the system keeps per resident program


def arch_limits(arch: int) -> Limits:
    """The limits of an SM of ``sm_ARCH`` (80, 90, 100), from the table above."""
    return Limits(REGISTERS, MAX_WARPS, MAX_PROGRAMS, SHARED_KIB[arch] * 1024, RESERVED_SHARED)


def device_limits(props: Any) -> Limits:
    """The limits of an SM of the device torch describes with ``props``
    (``torch.cuda.get_device_properties``): the register file, threads and shared memory per
    SM as the device reports them, where this torch exposes them; the architecture's table
    entry for the rest (torch reports neither programs per SM nor the reserved shared
    memory)."""
    arch = props.major * 10 + props.minor
    table = (arch_limits(arch) if arch in SHARED_KIB
             else arch_limits(80)._replace(max_programs=OTHER_MAX_PROGRAMS))
    threads = getattr(props, "max_threads_per_multi_processor", None)
    warp = getattr(props, "warp_size", None) or WARP
    return Limits(
        registers=getattr(props, "regs_per_multiprocessor", None) or table.registers,
        max_warps=threads // warp if threads else table.max_warps,
        max_programs=table.max_programs,
        shared=getattr(props, "shared_memory_per_multiprocessor", None) or table.shared,
        reserved_shared=table.reserved_shared)


def resident_per_sm(registers: int, shared: int, num_warps: int, limits: Limits) -> int:
    """How many programs of ``num_warps`` warps, each thread using ``registers`` registers and
    each program ``shared`` bytes of shared memory, one SM holds at once: registers are given
    out per warp in units of 256 (32 threads x registers rounded up to 8), shared memory per
    program plus the reserved bytes, and no SM holds more than its warp and program limits.
    0 when one program does not fit."""
    per_warp = math.ceil(WARP * math.ceil(max(registers, 1) / 8) * 8 / 256) * 256
    by_registers = (limits.registers // per_warp) // num_warps
    by_shared = limits.shared // (shared + limits.reserved_shared)
    return min(by_registers, limits.max_warps // num_warps, by_shared, limits.max_programs)


def register_cap(num_warps: int, limits: Limits, programs: int = TARGET_PROGRAMS) -> int:
    """The most registers a thread may use for ``programs`` programs of ``num_warps`` warps to
    share an SM's register file, by the allocation rule of :func:`resident_per_sm` (a
    multiple of 8; 255 at most, the most a thread can address)."""
    per_warp = limits.registers // (programs * num_warps) // 256 * 256
    return min(per_warp // WARP // 8 * 8, 255)


class Fit(NamedTuple):
    """How a backward kernel is compiled and how many of its programs an SM then holds."""

    resident: int  # programs per SM
    maxnreg: int | None  # the register cap it is compiled with; None: the compiler's choice


def fit(chosen: Resources, capped: Callable[[int], Resources], num_warps: int,
        limits: Limits) -> Fit:
    """:class:`Fit` of a backward kernel that compiles to ``chosen`` when the compiler picks
    its registers, and to ``capped(cap)`` when held to ``cap`` registers a thread. The
    compiler's choice where it already fits :data:`TARGET_PROGRAMS` programs per SM;
    otherwise capped to fit them, if the capped kernel does not spill (ptxas takes registers
    freely under the 255 ceiling, for loads in flight it need not hold: at hidden 2048 five
    entry backwards take 134-215 and fit 128 without spilling); otherwise the compiler's
    choice, since a spill costs local-memory traffic on every row (whether a small one costs
    less than a second program gains is for a GPU to time: docs/gpu.md)."""
    resident = resident_per_sm(chosen.registers, chosen.shared, num_warps, limits)
    if resident >= TARGET_PROGRAMS:
        return Fit(resident, None)
    cap = register_cap(num_warps, limits)
    found = capped(cap)
    fitted = resident_per_sm(found.registers, found.shared, num_warps, limits)
    if found.local or fitted <= resident:
        return Fit(resident, None)
    return Fit(fitted, cap)


def programs_per_sm(resources: Resources, num_warps: int, arch: int) -> int:
    """:func:`resident_per_sm` of a kernel compiled for ``sm_ARCH``, on that architecture's
    SM."""
    return resident_per_sm(resources.registers, resources.shared, num_warps, arch_limits(arch))


def backward_programs(n_rows: int, sm_count: int, resident: int) -> int:
    """Programs of a backward launch over ``n_rows`` rows on ``sm_count`` SMs that each hold
    ``resident`` programs of the compiled kernel: one full wave, since every program loops
    over its block of rows, so programs beyond those that fit at once only add partials to
    write and sum and a tail wave; but at least :data:`MIN_ROWS_PER_PROGRAM` rows each, so the
    partials stay small next to the rows they sum; and at least one."""
    return max(1, min(math.ceil(n_rows / MIN_ROWS_PER_PROGRAM), resident * sm_count))


def interpreted_programs(n_rows: int) -> int:
    """Programs of a backward launch in Triton's CPU interpreter: up to
    :data:`INTERPRETED_PROGRAMS`, one per row at most, at least one."""
    return max(1, min(n_rows, INTERPRETED_PROGRAMS))


def compiled_resources(compiled: Any) -> Resources:
    """:class:`Resources` of a Triton ``CompiledKernel`` whose handles are initialised (so the
    driver has filled ``n_regs`` and ``n_spills``: the driver's local memory bytes a thread,
    where spills go, which Triton divides by 4 into spilled 32-bit registers)."""
    return Resources(compiled.n_regs, 4 * compiled.n_spills, compiled.metadata.shared)


def _index(device: torch.device) -> int:
    return torch.cuda.current_device() if device.index is None else device.index


@functools.cache
def sm_count(index: int) -> int:
    """SMs of CUDA device ``index``."""
    return torch.cuda.get_device_properties(index).multi_processor_count


def _arg_key(value: Any) -> Any:
    """What Triton specialises a launch argument on: a tensor's dtype and 16-byte alignment,
    an integer's width, whether it is 1 or a multiple of 16; a float or bool by its type."""
    if isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() % 16 == 0
    if isinstance(value, int) and not isinstance(value, bool):
        return int, -(2**31) <= value < 2**31, value == 1, value % 16 == 0
    return type(value)


_FITS: dict[tuple, Fit] = {}


def _compile(kernel: Any, args: tuple, kwargs: dict, index: int) -> Any:
    """``kernel`` compiled for the launch ``kernel[grid](*args, **kwargs)`` on CUDA device
    ``index``, not launched (``warmup``), its module loaded: loading is what fills
    ``n_regs`` and ``n_spills`` (the driver reports them, the compiler's metadata does
    not)."""
    with torch.cuda.device(index):  # Triton compiles and loads for the current device
        compiled = kernel.warmup(*args, grid=(1,), **kwargs)
        compiled._init_handles()
    return compiled


def resident_programs(kernel: Any, args: tuple, kwargs: dict, device: torch.device) -> Fit:
    """:func:`fit` of ``kernel`` (a ``@triton.jit`` function) as Triton compiles it for the
    launch ``kernel[grid](*args, **kwargs)`` on CUDA ``device``, with the device's limits;
    at least one program per SM (a kernel built for the device runs one: a 0 would be a limit
    torch misreports, and would shrink the grid to one program). Cached per kernel,
    argument specialisation, constexprs and device, so a launch pays its one or two compiles
    once."""
    index = _index(device)
    key = (kernel, index, tuple(_arg_key(a) for a in args), tuple(sorted(kwargs.items())))
    found = _FITS.get(key)
    if found is None:
        compiled = _compile(kernel, args, kwargs, index)
        props = torch.cuda.get_device_properties(index)
        found = fit(compiled_resources(compiled),
                    lambda cap: compiled_resources(
                        _compile(kernel, args, {**kwargs, "maxnreg": cap}, index)),
                    compiled.metadata.num_warps, device_limits(props))
        found = found._replace(resident=max(found.resident, 1))
        _FITS[key] = found
    return found


class Launch(NamedTuple):
    """A backward launch: its programs and the options it compiles with (a register cap)."""

    programs: int
    options: dict


def launch_programs(kernel: Any, n_rows: int, device: torch.device, args: tuple,
                    kwargs: dict) -> Launch:
    """:class:`Launch` of the backward ``kernel[(programs,)](*args, **kwargs, **options)``
    over ``n_rows`` rows on ``device``: one wave of the compiled kernel on a GPU
    (:func:`backward_programs` of :func:`resident_programs`, with its register cap), and
    :func:`interpreted_programs` without one. Nothing is compiled for a launch without rows
    (the ops skip it)."""
    if device.type != "cuda":
        return Launch(interpreted_programs(n_rows), {})
    if not n_rows:
        return Launch(1, {})
    index = _index(device)
    found = resident_programs(kernel, args, kwargs, device)
    options = {} if found.maxnreg is None else {"maxnreg": found.maxnreg}
    return Launch(backward_programs(n_rows, sm_count(index), found.resident), options)
