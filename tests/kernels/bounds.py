"""Every address a Triton kernel loads or stores, checked in Triton's interpreter against the
tensors its launch was given.

In the interpreter a kernel's pointers are host addresses: a load or store that a wrong mask
lets through reads or writes whatever the heap holds there (on a GPU it is device memory,
corrupted silently or an illegal address). Inside :func:`checked`, each launch records its
tensor arguments, and every load and store (masked lanes left out, as the interpreter leaves
them untouched) must address elements of one of them: an element of the view itself, not only
of its storage, so a read of a packed tensor's half that strays into the other half is caught,
as is an address between elements. Lanes outside every argument are recorded and dropped
from the access (a load gives ``other`` there, a store skips them), so a wrong kernel is
reported instead of corrupting the process that runs it.
"""

from __future__ import annotations

import contextlib
import inspect
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch
from triton.runtime import interpreter


@dataclass(frozen=True)
class Extent:
    """The elements of one tensor argument: its first byte and (stride, size) in bytes per
    dimension, outer first (dimensions of one element or stride 0 left out)."""

    names: str
    start: int
    itemsize: int
    dims: tuple[tuple[int, int], ...]
    numel: int

    @classmethod
    def of(cls, name: str, t: torch.Tensor) -> Extent:
        size = t.element_size()
        dims = sorted(((s * size, n) for s, n in zip(t.stride(), t.shape, strict=True)
                       if n > 1 and s), reverse=True)
        return cls(name, t.data_ptr(), size, tuple(dims), t.numel())

    def holds(self, addresses: np.ndarray, width: int) -> np.ndarray:
        """Which of ``addresses`` start an access of ``width`` bytes inside one element. The
        offset is taken apart outer dimension first, which is exact for views whose strides
        nest (each larger than the span of the dimensions inside it), as torch's do."""
        if not self.numel:
            return np.zeros(addresses.shape, dtype=bool)
        rest = addresses.astype(np.int64) - self.start
        ok = rest >= 0
        for stride, size in self.dims:
            index = rest // stride
            ok &= (index >= 0) & (index < size)
            rest = rest - index * stride
        return ok & (rest >= 0) & (rest + width <= self.itemsize) & (rest % width == 0)

    def describe(self, address: int) -> str:
        offset = address - self.start
        return (f"{self.names} + {offset} bytes ({offset / self.itemsize:g} elements; the "
                f"tensor holds {self.numel} of {self.itemsize} bytes)")


@dataclass
class Report:
    """What :func:`checked` saw: launches per kernel, the constexpr variants launched, the
    accesses checked and every violation (one line each)."""

    launches: Counter = field(default_factory=Counter)
    variants: set = field(default_factory=set)
    accesses: int = 0
    lanes: int = 0
    violations: list[str] = field(default_factory=list)
    launch: tuple[str, list[Extent]] | None = None

    def check(self, kind: str, ptrs: np.ndarray, mask: np.ndarray, width: int) -> np.ndarray:
        """The access's mask with the lanes that address no argument's element taken out."""
        mask = np.broadcast_to(mask, ptrs.shape)
        if self.launch is None:
            self.violations.append(f"{kind} outside any checked launch")
            return mask
        kernel, extents = self.launch
        addresses = ptrs[mask]
        self.accesses += 1
        self.lanes += addresses.size
        if not addresses.size:
            return mask
        held = [e.holds(addresses, width) for e in extents]
        if any(h.all() for h in held):
            return mask
        inside = np.logical_or.reduce(held) if held else np.zeros(addresses.shape, bool)
        if inside.all():
            self.violations.append(f"{kernel}: a {kind} of {addresses.size} lanes spans "
                                   f"several arguments ({_nearest(extents, addresses[0])})")
            return mask
        first = int(addresses[~inside][0])
        self.violations.append(
            f"{kernel}: {kind} of {int((~inside).sum())} of {addresses.size} lanes outside "
            f"every tensor argument; first at {_nearest(extents, first)}")
        kept = mask.copy()
        kept[mask] = inside
        return kept


def _nearest(extents: list[Extent], address) -> str:
    address = int(address)  # from numpy's uint64, which would wrap below a tensor's start
    if not extents:
        return f"address {address:#x}, no tensor argument"
    return min(extents, key=lambda e: abs(address - e.start)).describe(address)


def _extents(fn, args: list, kwargs: dict) -> list[Extent]:
    """One extent per distinct tensor argument (arguments passed the same view are joined)."""
    found: dict[tuple, Extent] = {}
    for name, value in inspect.getcallargs(fn, *args, **kwargs).items():
        if isinstance(value, torch.Tensor):
            extent = Extent.of(name, value)
            key = (extent.start, extent.itemsize, extent.dims, extent.numel)
            if key in found:
                extent = Extent(f"{found[key].names}/{name}", *key)
            found[key] = extent
    return list(found.values())


# Memory operations the check does not take apart (our kernels use none): each use is a
# violation, so a kernel that starts using one is not passed unchecked. Those the installed
# Triton's interpreter lacks are skipped (block-pointer loads and stores, which Triton 3.6 still
# has, go through the masked load and store, so they are checked).
UNCHECKED = ("create_atomic_cas", "create_atomic_load", "create_atomic_store",
             "create_atomic_poll", "create_atomic_rmw", "create_descriptor_load",
             "create_descriptor_store", "create_descriptor_gather", "create_descriptor_scatter")


@contextlib.contextmanager
def checked() -> Iterator[Report]:
    """Every interpreted launch inside the block checked; the :class:`Report` it yields."""
    report = Report()
    executor, builder = interpreter.GridExecutor, interpreter.InterpreterBuilder
    init_args, load, store = (executor._init_args_hst, builder.create_masked_load,
                              builder.create_masked_store)

    def init_args_checked(self, args_dev, kwargs):
        args_hst, kwargs_hst = init_args(self, args_dev, kwargs)
        name = self.fn.__name__
        report.launches[name] += 1
        values = inspect.getcallargs(self.fn, *args_hst, **kwargs_hst)
        report.variants.add((name, tuple((k, values[k]) for k in self.constexprs
                                         if k in values)))
        report.launch = (name, _extents(self.fn, args_hst, kwargs_hst))
        return args_hst, kwargs_hst

    def width(ptrs) -> int:
        return ptrs.get_element_ty().primitive_bitwidth // 8

    # The arguments after the mask differ between Triton releases (3.6: cache_modifier and
    # eviction_policy, 3.9: cache_policy) and pass through untouched.
    def load_checked(self, ptrs, mask, *rest, **options):
        kept = report.check("load", ptrs.data, mask.data, width(ptrs))
        mask = interpreter.TensorHandle(np.ascontiguousarray(kept), mask.dtype)
        return load(self, ptrs, mask, *rest, **options)

    def store_checked(self, ptrs, value, mask, *rest, **options):
        # The interpreter copies each value's own bytes (its numpy itemsize) to the address,
        # so a value wider than the pointer's element would write past it.
        written = max(width(ptrs), value.data.dtype.itemsize)
        if written != width(ptrs):
            report.violations.append(f"{report.launch[0] if report.launch else 'no launch'}: "
                                     f"a store writes {written} bytes per element of "
                                     f"{width(ptrs)}")
        kept = report.check("store", ptrs.data, mask.data, written)
        mask = interpreter.TensorHandle(np.ascontiguousarray(kept), mask.dtype)
        return store(self, ptrs, value, mask, *rest, **options)

    def unchecked(name, original):
        def refused(self, *args, **kwargs):
            kernel = report.launch[0] if report.launch else "no launch"
            report.violations.append(f"{kernel}: {name} is not checked")
            return original(self, *args, **kwargs)

        return refused

    # Each release's interpreter has its own set (3.6 has no atomic load, store or poll).
    saved = {name: getattr(builder, name) for name in UNCHECKED if hasattr(builder, name)}
    executor._init_args_hst = init_args_checked
    builder.create_masked_load, builder.create_masked_store = load_checked, store_checked
    for name, original in saved.items():
        setattr(builder, name, unchecked(name, original))
    try:
        yield report
    finally:
        executor._init_args_hst = init_args
        builder.create_masked_load, builder.create_masked_store = load, store
        for name, original in saved.items():
            setattr(builder, name, original)
        report.launch = None


def kernel_names() -> set[str]:
    """The kernels a launch can name: every @triton.jit function of ``kernels.triton_kernels``
    but its helpers."""
    import triton

    from kernels import triton_kernels

    return {name for name, value in vars(triton_kernels).items()
            if isinstance(value, triton.runtime.KernelInterface) and not name.startswith("_")}
