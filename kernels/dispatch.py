"""The one place that decides which implementation computes a norm.

The choice is made once per process from ``KERNELS_NORM_BACKEND``, the run config's
``kernels.norm_backend`` or :func:`set_backend`, so the hot path never re-checks what is
installed. Tests force a path with :func:`forced_backend`.

- ``torch``: the reference in ``kernels/reference.py`` (fp32 math, one norm at a time).
- ``triton``: the fused kernels of ``kernels/triton_kernels.py`` (a SiameseNorm sublayer's
  three norms, the dual update and the final merge each in one pass; plain norms too). It needs
  a CUDA device, or Triton's CPU interpreter (``TRITON_INTERPRET=1``), which is for tests only.
- ``te``: Transformer Engine's plain norms, placed by the model spec. It is accepted only where
  TE imports on a CUDA machine; TE has no two-stream fusion, so the fused ops below run their
  reference composition of the norm modules under it.
- ``auto``: triton with CUDA and Triton, else torch. A CPU machine always gets torch.

The fused ops take the norm *modules*: the torch path calls them (so it is exactly the
unfused model), the triton path passes their parameters to the kernels (so checkpoints and
sequence-parallel gradient reduction do not depend on the backend). A norm the kernels do not
know (e.g. a TE module), or norms that differ in kind or eps, fall back to the reference.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
from collections.abc import Callable, Iterator
from enum import StrEnum
from typing import Any

import torch
from megatron.core.transformer.identity_op import IdentityOp

from kernels import reference
from model import device


class NormBackend(StrEnum):
    AUTO = "auto"
    TORCH = "torch"
    TRITON = "triton"
    TE = "te"


def _triton_reason() -> str | None:
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if not (device.uses_cuda() or os.environ.get("TRITON_INTERPRET") == "1"):
        return "no CUDA device (Triton's CPU interpreter, TRITON_INTERPRET=1, is for tests)"
    return None


@functools.cache
def _te_importable() -> bool:
    try:  # a broken TE raises RuntimeError/OSError, not only ImportError
        import transformer_engine.pytorch  # noqa: F401
    except Exception:
        return False
    return True


def _te_reason() -> str | None:
    # TE is imported only after CUDA is known to exist: on a CUDA-less machine importing it
    # raises and breaks megatron's own imports.
    if not device.uses_cuda():
        return "no CUDA device on this machine"
    return None if _te_importable() else "transformer_engine is not installed or failed to import"


def unavailable_reason(backend: NormBackend) -> str | None:
    """Why ``backend`` cannot run here, or None when it can."""
    return {NormBackend.TRITON: _triton_reason, NormBackend.TE: _te_reason}.get(
        backend, lambda: None)()


_active: NormBackend | None = None


def _resolve(requested: NormBackend) -> NormBackend:
    if requested is NormBackend.AUTO:
        triton_usable = device.uses_cuda() and _triton_reason() is None
        return NormBackend.TRITON if triton_usable else NormBackend.TORCH
    reason = unavailable_reason(requested)
    if reason is not None:
        raise ValueError(f"kernels.norm_backend ({requested}) is not available here: {reason}")
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


def _triton_ops():
    # Imported on first use only: the kernels are compiled (or, under TRITON_INTERPRET=1,
    # interpreted) as decided when this module is first imported.
    from kernels import triton_ops

    return triton_ops


# ---- plain norms (kernels.norms.Norm) ---------------------------------------------------------

def rms_norm_fn() -> Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]:
    if active_backend() is NormBackend.TRITON:
        return lambda x, w, eps: _triton_ops().NormFunction.apply(x, w, None, eps, True)
    return reference.rms_norm


def layer_norm_fn() -> Callable[..., torch.Tensor]:
    if active_backend() is NormBackend.TRITON:
        return lambda x, w, b, eps: _triton_ops().NormFunction.apply(x, w, b, eps, False)
    return reference.layer_norm


# ---- fused SiameseNorm ops ---------------------------------------------------------------------

def _kernel_params(*norms: Any, optional_last: bool = False) -> tuple | None:
    """(eps, is_rms, [weight, bias] per norm) when the triton path can run these norms, else
    None. With ``optional_last`` the last norm may be an identity (weight and bias None)."""
    if active_backend() is not NormBackend.TRITON:
        return None
    from kernels.norms import Norm  # kernels.norms imports this module

    params, kinds = [], set()
    for i, norm in enumerate(norms):
        if optional_last and i == len(norms) - 1 and isinstance(norm, IdentityOp):
            params += [None, None]
        elif isinstance(norm, Norm):
            params += [norm.weight, norm.bias]
            kinds.add((norm.eps, norm.is_rms))
        else:
            return None
    if len(kinds) != 1:
        return None
    (eps, is_rms), = kinds
    return eps, is_rms, params


def siamese_entry(x: torch.Tensor, y: torch.Tensor, post, pre, inp):
    """(u, s): u = Npost(x), s = Nin(u + Npre(y)); ``inp`` may be an identity (no Nin)."""
    fused = _kernel_params(post, pre, inp, optional_last=True)
    if fused is None:
        return reference.siamese_entry(x, y, post, pre, inp)
    eps, is_rms, params = fused
    u, _, s = _triton_ops().EntryFunction.apply(x, y, None, *params, 1.0, eps, is_rms, True)
    return u, s


def siamese_update_entry(u: torch.Tensor, y: torch.Tensor, r: torch.Tensor, scale: float,
                         post, pre, inp):
    """(u', y', s): the dual update x = u + r / c, y' = y + r, then u' = Npost(x),
    s = Nin(u' + Npre(y'))."""
    fused = _kernel_params(post, pre, inp, optional_last=True)
    if fused is None:
        return reference.siamese_update_entry(u, y, r, scale, post, pre, inp)
    eps, is_rms, params = fused
    return _triton_ops().EntryFunction.apply(u, y, r, *params, scale, eps, is_rms, True)


def dual_update(u: torch.Tensor, y: torch.Tensor, r: torch.Tensor, scale: float,
                layout: Any) -> torch.Tensor:
    """layout.pack(u + r / c, y + r); ``layout`` is the streams module (pack and unpack)."""
    if active_backend() is not NormBackend.TRITON:
        return reference.dual_update(u, y, r, scale, layout.pack)
    return _triton_ops().DualUpdateFunction.apply(u, y, r, scale, layout.unpack)


def stream_merge(x: torch.Tensor, y: torch.Tensor, x_norm, y_norm, final_norm) -> torch.Tensor:
    """Nfinal(Na(x) + Nb(y))."""
    fused = _kernel_params(x_norm, y_norm, final_norm)
    if fused is None:
        return reference.stream_merge(x, y, x_norm, y_norm, final_norm)
    eps, is_rms, params = fused
    _, _, out = _triton_ops().EntryFunction.apply(x, y, None, *params, 1.0, eps, is_rms, False)
    return out
