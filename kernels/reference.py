"""Plain-PyTorch norms: the ground truth every fused kernel is checked against.

Math runs in fp32 whatever the activation dtype, and the result is cast back, so bf16 runs
keep the statistics of the fp32 reference.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    y = F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps)
    return y.to(x.dtype)


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    b = None if bias is None else bias.float()
    y = F.layer_norm(x.float(), (x.shape[-1],), weight.float(), b, eps)
    return y.to(x.dtype)


# The fused SiameseNorm ops, as compositions of the norm modules themselves (any callables:
# ``Norm``, a Transformer Engine norm, or an identity). These define what every fused kernel
# must compute; the model's torch path is exactly these.

Norm = Callable[[torch.Tensor], torch.Tensor]


def siamese_entry(x: torch.Tensor, y: torch.Tensor, post: Norm, pre: Norm, inp: Norm):
    """A sublayer's entry: (u, s) with u = Npost(x) and s = Nin(u + Npre(y))."""
    u = post(x)
    return u, inp(u + pre(y))


def siamese_update_entry(u: torch.Tensor, y: torch.Tensor, r: torch.Tensor, scale: float,
                         post: Norm, pre: Norm, inp: Norm):
    """The previous sublayer's dual update (x = u + r / c, y = y + r) followed by this
    sublayer's entry: returns (u', y, s) for the updated y."""
    x, y = u + r / scale, y + r
    u, s = siamese_entry(x, y, post, pre, inp)
    return u, y, s


def dual_update(u: torch.Tensor, y: torch.Tensor, r: torch.Tensor, scale: float,
                pack: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The layer's last update, packed for the next layer: pack(u + r / c, y + r)."""
    return pack(u + r / scale, y + r)


def stream_merge(x: torch.Tensor, y: torch.Tensor, x_norm: Norm, y_norm: Norm,
                 final_norm: Norm) -> torch.Tensor:
    """The final merge: Nfinal(Na(x) + Nb(y))."""
    return final_norm(x_norm(x) + y_norm(y))
