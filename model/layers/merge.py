"""The final merge of SiameseNorm's two streams: out = Nfinal( Na(x) + Nb(y) ).

It takes the place of megatron's final layer norm in the TransformerBlock spec, so it runs on
the last pipeline stage only and turns the packed [s, b, 2h] tensor back into [s, b, h] for
the output layer. With the triton backend the three norms are one fused pass.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.spec_utils import ModuleSpec, build_module

from kernels.backend import NormBackend
from kernels.fused import fuse
from model import streams


class StreamMergeNorm(torch.nn.Module):
    """Na (``x_norm``), Nb (``y_norm``) and Nfinal (``final_norm``), built from ``norm``."""

    def __init__(self, config, hidden_size: int, eps: float, *, norm: ModuleSpec | type,
                 backend: NormBackend = NormBackend.TORCH):
        super().__init__()
        self.x_norm, self.y_norm, self.final_norm = (
            build_module(norm, config=config, hidden_size=hidden_size, eps=eps)
            for _ in range(3))
        self.fused = fuse(backend, self.x_norm, self.y_norm, self.final_norm)

    def forward(self, packed: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:
            return self.fused.merge_packed(packed, streams.unpack)
        x, y = streams.unpack(packed)
        return self.final_norm(self.x_norm(x) + self.y_norm(y))
