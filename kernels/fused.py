"""Three norms of one SiameseNorm step computed in one Triton pass.

A sublayer's entry reads x and y and writes u = Na(x) and s = Nc(Na(x) + Nb(y)); the final merge
is the same pass without storing u. :func:`fuse` decides, when a model is built, whether a
given trio of norm modules can run as one kernel: all three :class:`~kernels.norms.Norm`
modules of one kind, eps and bias presence built for triton (Nc may be an identity: the
input-norm ablation). The kernels read the modules' own parameters, so gradients land on the
same tensors as in the unfused composition, and checkpoints and sequence-parallel reductions do
not depend on it.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.identity_op import IdentityOp

from kernels.backend import NormBackend
from kernels.norms import Norm


class FusedNorms:
    """Na, Nb, Nc bound to the fused kernels (see :func:`fuse`)."""

    def __init__(self, a: Norm, b: Norm, c: Norm | None):
        from kernels import triton_ops

        self._ops = triton_ops
        self._norms = (a, b, c)
        self._eps, self._is_rms = a.eps, a.is_rms

    def _params(self) -> list[torch.Tensor | None]:
        params = []
        for norm in self._norms:
            params += [None, None] if norm is None else [norm.weight, norm.bias]
        return params

    def entry(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(u, s) with u = Na(x), s = Nc(u + Nb(y))."""
        u, _, s = self._ops.EntryFunction.apply(
            x, y, None, *self._params(), 1.0, self._eps, self._is_rms, True)
        return u, s

    def update_entry(self, u: torch.Tensor, y: torch.Tensor, r: torch.Tensor, scale: float,
                     u_from: tuple[torch.Tensor, Norm] | None = None):
        """(u', y', s): x = u + r / scale, y' = y + r, then u' = Na(x), s = Nc(u' + Nb(y')).
        ``u_from`` = (x0, norm) with u = norm(x0): backward keeps x0 (and recomputes u) rather
        than u; ``norm`` must compute like these norms (:meth:`computes_like`)."""
        x0, norm = u_from if u_from is not None else (None, None)
        return self._ops.EntryFunction.apply(
            u, y, r, *self._params(), scale, self._eps, self._is_rms, True, x0,
            None if norm is None else norm.weight, None if norm is None else norm.bias)

    def computes_like(self, norm) -> bool:
        """Whether ``norm`` is a Norm of the same kind, eps and bias presence as these."""
        return isinstance(norm, Norm) and _kind(norm) == _kind(self._norms[0])

    def merge(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Nc(Na(x) + Nb(y)), without storing Na(x)."""
        _, _, s = self._ops.EntryFunction.apply(
            x, y, None, *self._params(), 1.0, self._eps, self._is_rms, False)
        return s


def fuse(backend: NormBackend, a, b, c) -> FusedNorms | None:
    """The fused form of the norm modules ``a``, ``b``, ``c`` under ``backend``, or None when
    they must run as their composition (not triton, a module the kernels do not know such as a
    TE norm or an identity Na/Nb, or norms that differ in kind or eps)."""
    if backend is not NormBackend.TRITON:
        return None
    if isinstance(c, IdentityOp):
        c = None
    norms = [a, b] if c is None else [a, b, c]
    if not all(isinstance(n, Norm) for n in norms):
        return None
    if len({_kind(n) for n in norms}) != 1:
        return None
    return FusedNorms(a, b, c)


def _kind(norm: Norm) -> tuple[float, bool, bool]:
    """What one kernel launch fixes for every norm it computes: eps, RMS or Layer, bias."""
    return norm.eps, norm.is_rms, norm.bias is None
