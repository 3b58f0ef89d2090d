"""Three norms of one SiameseNorm step computed in one Triton pass.

A sublayer's entry reads x and y and writes u = Na(x) and s = Nc(Na(x) + Nb(y)); the final merge
is the same pass without storing u; siamese_hybrid's attention entry is the pass with a
per-channel gate in place of Na and no Nc. :func:`fuse` and :func:`fuse_gate` decide, when a
model is built, whether given modules can run as one kernel: norms all
:class:`~kernels.norms.Norm` modules the kernels compute (each asked: ``Norm.fused_kernels``),
of one kind, eps and bias presence (Nc
may be an identity: the input-norm ablation). The kernels read the modules' own parameters, so
gradients land on the same tensors as in the unfused composition, and checkpoints and
sequence-parallel reductions do not depend on it.

Where the streams arrive packed ([s, b, 2h], the layer input), the ``*_packed`` entries take
that tensor whole: backward then writes the packed gradient directly, and the streams a later
op of the layer reads again come back as outputs whose gradients the kernel adds in.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from megatron.core.transformer.identity_op import IdentityOp

from kernels.backend import NormBackend
from kernels.norms import Norm

Halves = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class FusedNorms:
    """Na, Nb, Nc bound to the fused kernels (see :func:`fuse`). ``gate``: Na is a module
    with a per-channel ``weight`` g and no bias, computing x * g (see :func:`fuse_gate`)."""

    def __init__(self, a, b: Norm, c: Norm | None, gate: bool = False):
        from kernels import stream_library, triton_ops

        self._ops, self._library = triton_ops, stream_library
        self._norms = (a, b, c)
        self._eps, self._is_rms, self._gate = b.eps, b.is_rms, gate

    def _kind(self, **flags):
        return self._ops.Entry(self._eps, self._is_rms, gate=self._gate, **flags)

    def _params(self) -> list[torch.Tensor | None]:
        params = []
        for norm in self._norms:
            params += [None, None] if norm is None else [norm.weight, getattr(norm, "bias", None)]
        return params

    def _apply(self, kind, halves, packed, x, y, r=None, scale=None, *u_norm):
        return self._library.entry(kind, halves, packed, x, y, r, scale, *self._params(),
                                   *u_norm)

    def entry(self, x: torch.Tensor, y: torch.Tensor,
              store_u: bool = True) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(u, s) with u = Na(x), s = Nc(u + Nb(y)) (u None with a gate or without
        ``store_u``)."""
        kind = self._kind(store_a=store_u and not self._gate)
        u, _, _, s = self._apply(kind, None, None, x, y)
        return u, s

    def entry_packed(self, packed: torch.Tensor, halves: Halves, store_u: bool = True):
        """(u, x, y, s) of the streams ``halves(packed)``: u and s as :meth:`entry`; y, and x
        with a gate or without ``store_u``, returned for the layer to read again (else x is
        None: the norms' u stands for it)."""
        store_u = store_u and not self._gate
        kind = self._kind(store_a=store_u, pass_x=not store_u, pass_y=True)
        u, y, x, s = self._apply(kind, halves, packed, None, None)
        return u, x, y, s

    def update_entry(self, u: torch.Tensor | None, y: torch.Tensor, r: torch.Tensor,
                     scale: float | torch.Tensor,
                     u_from: tuple[torch.Tensor, Norm] | None = None):
        """(u', y', s): x = u + r / scale, y' = y + r, then u' = Na(x), s = Nc(u' + Nb(y')).
        ``u_from`` = (x0, norm): u is norm(x0), computed here from x0 forward and backward
        (``u`` may then be None: the previous entry need not store it), its gradient sent on
        to x0 and the norm's weights; ``norm`` must compute like these norms
        (:meth:`computes_like`)."""
        if u_from is None:
            if u is None:
                raise ValueError("update_entry needs u, or u_from to compute it")
            u, y, _, s = self._apply(self._kind(), None, None, u, y, r, scale)
            return u, y, s
        x0, norm = u_from
        kind = self._kind(u_from_x=True)
        u, y, _, s = self._apply(kind, None, None, x0, y, r, scale, norm.weight, norm.bias)
        return u, y, s

    def computes_like(self, norm) -> bool:
        """Whether ``norm`` is a Norm the kernels compute, of the same kind, eps and bias
        presence as these."""
        return _fusable(norm) and _kind(norm) == _kind(self._norms[1])

    def merge(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Nc(Na(x) + Nb(y)), without storing Na(x)."""
        return self._apply(self._kind(store_a=False), None, None, x, y)[3]

    def merge_packed(self, packed: torch.Tensor, halves: Halves) -> torch.Tensor:
        """:meth:`merge` of the streams ``halves(packed)``, its gradient written packed."""
        return self._apply(self._kind(store_a=False), halves, packed, None, None)[3]


def fuse(backend: NormBackend, a, b, c) -> FusedNorms | None:
    """The fused form of the norm modules ``a``, ``b``, ``c`` under ``backend``, or None when
    they must run as their composition (not triton, a module the kernels do not know such as a
    TE norm or an identity Na/Nb, a norm of a kind they do not compute, or norms that differ
    in kind or eps)."""
    if backend is not NormBackend.TRITON:
        return None
    if isinstance(c, IdentityOp):
        c = None
    norms = [a, b] if c is None else [a, b, c]
    if not all(_fusable(n) for n in norms):
        return None
    if len({_kind(n) for n in norms}) != 1:
        return None
    return FusedNorms(a, b, c)


def fuse_gate(backend: NormBackend, gate: torch.nn.Module, b) -> FusedNorms | None:
    """The fused form of ``x * gate.weight + b(y)`` (a per-channel gate, computed in fp32
    whatever the weight's dtype, and a norm) under ``backend``, or None (as :func:`fuse`)."""
    if backend is not NormBackend.TRITON or not _fusable(b):
        return None
    return FusedNorms(gate, b, None, gate=True)


def _fusable(norm) -> bool:
    """Whether the kernels compute ``norm``: a :class:`Norm` whose own kind they compute under
    its own backend (``Norm.fused_kernels``). Asked of each norm, never of the layer: a layer
    built with the triton backend may hold norms the kernels do not compute (DyT)."""
    return isinstance(norm, Norm) and norm.fused_kernels


def _kind(norm: Norm) -> tuple[float, bool, bool]:
    """What one kernel launch fixes for every norm it computes: eps, RMS or Layer, bias."""
    return norm.eps, norm.is_rms, norm.bias is None
