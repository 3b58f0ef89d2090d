"""The parts every SiameseNorm layer shares: c_l, the streams in and out, the sublayer norms.

A SiameseNorm sublayer reads both streams through three norms and writes one branch output r
back into both:

    u = Npost(x);  s = Nin(u + Npre(y));  r = F(s);  x = u + r / c_l;  y = y + r

:class:`SublayerNorms` holds Npost, Npre and Nin and computes the entry; it binds the fused
Triton pass at construction when the model is built with the triton backend (one kernel reads
x and y once), else it is the plain composition of the three modules. An attention update is
never applied on its own: the MLP's entry takes it (``update_entry``), so the pair costs one
pass, and the MLP's update is written straight into the packed tensor the next layer reads
(:meth:`TwoStreamLayer.streams_out`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import torch
from megatron.core.dist_checkpointing.utils import apply_prefix_mapping
from megatron.core.transformer.identity_op import IdentityOp

from kernels.backend import NormBackend
from kernels.fused import fuse
from model import streams
from model.layers.base import SchemeLayer


class SublayerNorms(torch.nn.Module):
    """Npost, Npre and Nin of one sublayer (``post``/``inp`` False: an identity there).

    ``entry(x, y)`` is (u, s) with u = Npost(x), s = Nin(u + Npre(y)); ``update_entry`` first
    applies the previous sublayer's update x = u + r / c, y = y + r and returns (u', y, s).
    Fused, the update keeps u, the old y and r for backward, not the updated streams; given
    ``u_from`` = (x0, norm) with u = norm(x0) (the previous entry's input and its Npost), it
    takes x0 instead and computes u itself, forward and backward, so the previous entry
    stores no u at all (``store_u=False``). When x0 and y are halves of the layer input,
    which the attention entry keeps anyway, the MLP entry then keeps only r, as a Pre-Norm
    layer keeps its MLP norm's input h + r.
    """

    def __init__(self, build_norm, backend: NormBackend, *, post: bool = True,
                 inp: bool = True):
        super().__init__()
        self.post = build_norm() if post else IdentityOp()
        self.pre = build_norm()
        self.inp = build_norm() if inp else IdentityOp()
        # The kernels need a real Npost; without one this stays the composition.
        self.fused = fuse(backend, self.post, self.pre, self.inp) if post else None

    def entry(self, x: torch.Tensor, y: torch.Tensor,
              store_u: bool = True) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(u, s); fused without ``store_u``, u is None (a later entry computes it from x)."""
        if self.fused is not None:
            return self.fused.entry(x, y, store_u)
        u = self.post(x)
        return u, self.inp(u + self.pre(y))

    def entry_packed(self, packed: torch.Tensor, store_u: bool = True):
        """(x, y, u, s): :meth:`entry` of the streams packed in a layer input. Fused, the
        kernel takes the packed tensor and writes its gradient in one piece; y (and x, when u
        is not stored) come back as outputs of the entry, so the gradients the rest of the
        layer gives them join the packed gradient inside that kernel (x is None when u is
        stored)."""
        if self.fused is None:
            x, y = streams.unpack(packed)
            return (x, y, *self.entry(x, y))
        u, x, y, s = self.fused.entry_packed(packed, streams.unpack, store_u)
        return x, y, u, s

    def computes_u_from(self, norm: torch.nn.Module) -> bool:
        """Whether :meth:`update_entry` given ``u_from`` = (x, ``norm``) computes u = norm(x)
        itself (fused, with a norm like its own), so the previous entry need not store u."""
        return self.fused is not None and self.fused.computes_like(norm)

    def update_entry(self, u: torch.Tensor | None, y: torch.Tensor, r: torch.Tensor,
                     c: float | torch.Tensor,
                     u_from: tuple[torch.Tensor, torch.nn.Module] | None = None):
        if self.fused is not None:
            if u is not None:  # stored by the previous entry: read it (u_from is for u None)
                u_from = None
            return self.fused.update_entry(u, y, r, c, u_from)
        y = y + r
        u, s = self.entry(u + r / c, y)
        return u, y, s


# In checkpoints each sublayer norm keeps the flat name it has always had (and that
# Megatron-style tools read), e.g. ``attn_post_norm`` for the module ``attn_norms.post``.
CHECKPOINT_NAMES = {f"{sub}_norms.{part}.": f"{sub}_{name}_norm."
                    for sub in ("attn", "mlp")
                    for part, name in (("post", "post"), ("pre", "pre"), ("inp", "in"))}


PackedUpdate = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float | torch.Tensor],
                       torch.Tensor]


def _torch_update(u: torch.Tensor, y: torch.Tensor, r: torch.Tensor,
                  c: float | torch.Tensor) -> torch.Tensor:
    return streams.pack(u + r / c, y + r)


def _triton_update(u: torch.Tensor, y: torch.Tensor, r: torch.Tensor,
                   c: float | torch.Tensor) -> torch.Tensor:
    from kernels import stream_library

    return stream_library.dual_update(u, y, r, c, streams.empty, streams.unpack)


def packed_update(backend: NormBackend) -> PackedUpdate:
    """``update(u, y, r, c) = pack(u + r / c, y + r)`` for ``backend``, chosen once when a
    layer is built (as every other kernel choice): with triton one kernel writes both halves
    in place."""
    return _triton_update if backend is NormBackend.TRITON else _torch_update


def _fp32(value: float, device: torch.device | None = None) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32, device=device)


def siamese_params(model) -> dict:
    """The spec parameters every SiameseNorm layer takes from the model config (the paper's
    two ablations)."""
    return {"depth_constant": model.siamese_depth_constant,
            "input_norm": model.siamese_input_norm}


class TwoStreamLayer(SchemeLayer):
    """A layer whose input and output pack the x and y streams ([s, b, 2h]).

    Global block 0 (``layer_number`` 1, always on the first pipeline stage) receives the
    embedding instead and starts both streams from it.
    """

    def __init__(self, config, submodules, *args, depth_constant: bool = True,
                 input_norm: bool = True, **kwargs):
        super().__init__(config, submodules, *args, **kwargs)
        self.input_norm = input_norm
        # c_l = sqrt(2 (l + 1)) for global block index l; ``layer_number`` is global and
        # 1-based, so pipeline stages agree with the unsharded model. 1: the paper's ablation.
        self.c = math.sqrt(2.0 * self.layer_number) if depth_constant else 1.0
        # c_l once more as one fp32 value on the layer's device (see ``c_operand``); not
        # saved, as it follows from the layer number.
        self.register_buffer("c_tensor", _fp32(self.c), persistent=False)
        self.dual_update = packed_update(self.backend)

    def _apply(self, fn, recurse: bool = True):
        # A cast of the whole model (megatron's Float16Module makes every floating buffer
        # bf16) would round c_l; it is made again, exact in fp32, wherever the cast put it.
        super()._apply(fn, recurse)
        self.c_tensor = _fp32(self.c, self.c_tensor.device)
        return self

    @property
    def c_operand(self) -> float | torch.Tensor:
        """c_l as the updates take it. Eager torch code divides by the float (the rounding
        eager has always had). The Triton kernels read the tensor from memory, and inside a
        compiled block the tensor is a graph input where the float would be a constant
        Dynamo guards: with it every block past global block 0 shares one compiled graph,
        where the float made one per block."""
        if self.backend is NormBackend.TRITON or torch.compiler.is_compiling():
            return self.c_tensor
        return self.c

    def sublayer_norms(self, post: bool = True, site: str = "other") -> SublayerNorms:
        """Npost, Npre and Nin of one sublayer (``site``: "attention" for the attention's)."""
        return SublayerNorms(partial(self.build_norm, site=site), self.backend, post=post,
                             inp=self.input_norm)

    def streams_in(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) from the packed input, or both from the embedding in global block 0."""
        if self.reads_embedding:
            return streams.start(hidden_states)
        return streams.unpack(hidden_states)

    def enter(self, norms: SublayerNorms, hidden_states: torch.Tensor, store_u: bool = True):
        """(x, y, u, s): the streams of the layer input and ``norms``' entry of them
        (:meth:`SublayerNorms.entry_packed` past block 0)."""
        if self.reads_embedding:
            x, y = streams.start(hidden_states)
            return (x, y, *norms.entry(x, y, store_u))
        return norms.entry_packed(hidden_states, store_u)

    def streams_out(self, u: torch.Tensor, y: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        """The last update, x = u + r / c_l and y = y + r, as the packed tensor the next layer
        reads."""
        return self.dual_update(u, y, r, self.c_operand)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: dict | None = None):
        state = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        apply_prefix_mapping(state, {prefix + k: prefix + v for k, v in CHECKPOINT_NAMES.items()})
        return state
