"""Which implementation computes the norms: chosen from the config once, when a model is built.

- ``torch``: the reference in ``kernels/reference.py`` (fp32 math, one norm at a time).
- ``triton``: the fused kernels of ``kernels/triton_kernels.py`` (a SiameseNorm sublayer's
  three norms, the dual update and the final merge each in one pass; plain norms too). It needs
  a CUDA device, or Triton's CPU interpreter (``TRITON_INTERPRET=1``), which is for tests only.
- ``te``: Transformer Engine's plain norms, placed by the model spec. Accepted only where TE
  imports on a CUDA machine; TE has no two-stream fusion, so those ops compose the TE modules.
- ``auto``: triton with CUDA and Triton, else torch. A CPU machine always gets torch.

:func:`resolve` turns the configured name into the backend a model is built with; the model
passes it down to every module that computes a norm (``model.spec``), and each module binds
its functions in ``__init__``. Nothing here is process state: two models built with different
backends in one process each keep their own.
"""

from __future__ import annotations

import importlib.util
import os
from enum import StrEnum

from runtime import device
from runtime.errors import ConfigError


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


def unavailable_reason(backend: NormBackend) -> str | None:
    """Why ``backend`` cannot run here, or None when it can."""
    return {NormBackend.TRITON: _triton_reason, NormBackend.TE: device.te_unavailable_reason}.get(
        backend, lambda: None)()


def resolve(requested: NormBackend | str) -> NormBackend:
    """The backend a model is built with for ``kernels.norm_backend = requested``: ``auto``
    becomes what this machine runs best; a named backend that cannot run here is a
    ConfigError naming the reason."""
    try:
        requested = NormBackend(requested)
    except ValueError:
        choices = ", ".join(b.value for b in NormBackend)
        raise ConfigError(f"kernels.norm_backend ({requested}) must be one of: "
                          f"{choices}") from None
    if requested is NormBackend.AUTO:
        triton_usable = device.uses_cuda() and _triton_reason() is None
        return NormBackend.TRITON if triton_usable else NormBackend.TORCH
    reason = unavailable_reason(requested)
    if reason is not None:
        raise ConfigError(f"kernels.norm_backend ({requested}) is not available here: {reason}")
    return requested
