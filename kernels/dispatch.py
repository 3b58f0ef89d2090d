"""The one place that decides which implementation computes a norm.

The choice is made once per process from ``KERNELS_NORM_BACKEND`` (or :func:`set_backend`),
so the hot path never re-checks what is installed. Tests force a path with
:func:`forced_backend`. Only the torch reference exists for now; ``auto`` resolves to the
fastest backend available on this machine.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from enum import StrEnum

import torch

from kernels import reference


class NormBackend(StrEnum):
    AUTO = "auto"
    TORCH = "torch"


_AVAILABLE = (NormBackend.TORCH,)
_active: NormBackend | None = None


def _resolve(requested: NormBackend) -> NormBackend:
    if requested is NormBackend.AUTO:
        return _AVAILABLE[0]
    if requested not in _AVAILABLE:
        raise ValueError(
            f"kernels.norm_backend ({requested}) is not available here; "
            f"available: {', '.join(_AVAILABLE)}"
        )
    return requested


def set_backend(name: str) -> NormBackend:
    """Select the backend for the rest of the process; returns the resolved one."""
    global _active
    try:
        requested = NormBackend(name)
    except ValueError:
        choices = ", ".join(b.value for b in NormBackend)
        raise ValueError(f"kernels.norm_backend ({name}) must be one of: {choices}") from None
    _active = _resolve(requested)
    return _active


def active_backend() -> NormBackend:
    if _active is None:
        set_backend(os.environ.get("KERNELS_NORM_BACKEND", NormBackend.AUTO))
    assert _active is not None
    return _active


@contextlib.contextmanager
def forced_backend(name: str) -> Iterator[NormBackend]:
    """Run a block with a given backend, restoring the previous choice afterwards."""
    global _active
    previous = _active
    try:
        yield set_backend(name)
    finally:
        _active = previous


def rms_norm_fn() -> Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]:
    return {NormBackend.TORCH: reference.rms_norm}[active_backend()]


def layer_norm_fn() -> Callable[..., torch.Tensor]:
    return {NormBackend.TORCH: reference.layer_norm}[active_backend()]
