"""The final merge of SiameseNorm's two streams: out = Nfinal( Na(x) + Nb(y) ).

It takes the place of megatron's final layer norm in the TransformerBlock spec, so it runs on
the last pipeline stage only and turns the packed [s, b, 2h] tensor back into [s, b, h] for
the output layer.
"""

from __future__ import annotations

import torch

from kernels import dispatch
from model import streams


class StreamMergeNorm(torch.nn.Module):
    """Three norms built with ``norm`` (the spec's norm builder): Na, Nb and Nfinal."""

    def __init__(self, config, hidden_size: int, eps: float, *, norm):
        super().__init__()
        self.x_norm = norm(config=config, hidden_size=hidden_size, eps=eps)
        self.y_norm = norm(config=config, hidden_size=hidden_size, eps=eps)
        self.final_norm = norm(config=config, hidden_size=hidden_size, eps=eps)

    def forward(self, packed: torch.Tensor) -> torch.Tensor:
        x, y = streams.unpack(packed)
        return dispatch.stream_merge(x, y, self.x_norm, self.y_norm, self.final_norm)
