"""Plain-PyTorch norms: the ground truth every fused kernel is checked against.

Math runs in fp32 whatever the activation dtype, and the result is cast back, so bf16 runs
keep the statistics of the fp32 reference.
"""

from __future__ import annotations

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


def norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
         is_rms: bool) -> torch.Tensor:
    """RMSNorm (``is_rms``, no bias) or LayerNorm of the last dimension."""
    return rms_norm(x, weight, eps) if is_rms else layer_norm(x, weight, bias, eps)


def residual_sum(h: torch.Tensor, r: torch.Tensor, alpha: float) -> torch.Tensor:
    """alpha h + r in the activation dtype, as the unfused model computes it (no multiply
    for alpha = 1)."""
    return h + r if alpha == 1.0 else alpha * h + r


def add_norm(h: torch.Tensor, r: torch.Tensor, alpha: float, weight: torch.Tensor,
             bias: torch.Tensor | None, eps: float, is_rms: bool) -> torch.Tensor:
    """N(alpha h + r): a Post-Norm sublayer's residual add and norm."""
    return norm(residual_sum(h, r, alpha), weight, bias, eps, is_rms)
