"""A megatron TransformerLayer whose norm placement and residual update are hooks.

megatron's forward hard-wires Pre-Norm (norm -> branch -> bias-dropout-add). The residual
schemes here differ only in what each branch reads and how its output is folded back, so this
layer keeps megatron's attention and MLP modules and calls them from a short forward that asks
the scheme two questions per sublayer: ``branch_input`` and ``residual_update``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
)
from megatron.core.utils import make_viewless_tensor

from kernels import dispatch
from model import streams


@dataclass
class SchemeLayerSubmodules(TransformerLayerSubmodules):
    """megatron's layer submodules plus the norm builder used for every norm the scheme owns."""

    norm: Any = IdentityOp
    norm_overrides: dict[str, Any] = field(default_factory=dict)
    """Builders for some of the scheme's norms, by name; IdentityOp removes that norm (e.g. the
    SiameseNorm ablation without the input norms ``*_in_norm``)."""


class SchemeLayer(TransformerLayer):
    """Base class: subclasses list their norms in ``norm_names`` and implement the hooks."""

    norm_names: tuple[str, ...] = ()

    def __init__(self, config, submodules: SchemeLayerSubmodules, *args, **kwargs):
        super().__init__(config, submodules, *args, **kwargs)
        for name in self.norm_names:
            norm = submodules.norm_overrides.get(name, submodules.norm)(
                config=self.config, hidden_size=self.config.hidden_size,
                eps=self.config.layernorm_epsilon,
            )
            self.add_module(name, norm)

    def branch_input(self, sublayer: str, hidden_states: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """What the branch (``sublayer`` is "attn" or "mlp") reads, and what the update needs."""
        raise NotImplementedError

    def residual_update(self, sublayer: str, saved: Any, branch_out: torch.Tensor) -> torch.Tensor:
        """Fold the branch output back into the residual stream(s)."""
        raise NotImplementedError

    def _branch_output(self, output_with_bias) -> torch.Tensor:
        output, bias = output_with_bias
        if bias is not None:
            output = output + bias
        return F.dropout(output, p=self.hidden_dropout, training=self.training)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        context: torch.Tensor | None = None,
        context_mask: torch.Tensor | None = None,
        rotary_pos_emb: torch.Tensor | None = None,
        rotary_pos_cos: torch.Tensor | None = None,
        rotary_pos_sin: torch.Tensor | None = None,
        rotary_pos_cos_sin: torch.Tensor | None = None,
        attention_bias: torch.Tensor | None = None,
        inference_context=None,
        packed_seq_params=None,
        sequence_len_offset: torch.Tensor | None = None,
        padding_mask: torch.Tensor | None = None,
        **_unused,
    ):
        branch_in, saved = self.branch_input("attn", hidden_states)
        attention = self.self_attention(
            branch_in,
            attention_mask=attention_mask,
            inference_context=inference_context,
            rotary_pos_emb=rotary_pos_emb,
            rotary_pos_cos=rotary_pos_cos,
            rotary_pos_sin=rotary_pos_sin,
            rotary_pos_cos_sin=rotary_pos_cos_sin,
            attention_bias=attention_bias,
            packed_seq_params=packed_seq_params,
            sequence_len_offset=sequence_len_offset,
        )
        hidden_states = self.residual_update("attn", saved, self._branch_output(attention))

        branch_in, saved = self.branch_input("mlp", hidden_states)
        mlp = self.mlp(branch_in, padding_mask=padding_mask)
        hidden_states = self.residual_update("mlp", saved, self._branch_output(mlp))
        # The pipeline schedules free layer outputs through .data; they must not be views.
        output = make_viewless_tensor(
            inp=hidden_states, requires_grad=hidden_states.requires_grad, keep_graph=True
        )
        return output, context


class PendingUpdate(NamedTuple):
    """The attention sublayer's dual update, not yet applied: the MLP's entry applies it in the
    same pass as its norms (``dispatch.siamese_update_entry``)."""

    x: torch.Tensor
    y: torch.Tensor
    branch_out: torch.Tensor


class TwoStreamLayer(SchemeLayer):
    """A layer whose input and output pack the x and y streams ([s, b, 2h]).

    Global block 0 (``layer_number`` 1, always on the first pipeline stage) receives the
    embedding instead and starts both streams from it. Inside the layer the attention update
    travels to the MLP entry as a :class:`PendingUpdate`, so a fused kernel can apply it
    together with the MLP's norms; only the layer's output is packed.
    """

    def __init__(self, config, submodules, *args, depth_constant: bool = True, **kwargs):
        super().__init__(config, submodules, *args, **kwargs)
        self.depth_constant = depth_constant

    @property
    def depth_scale(self) -> float:
        """c_l = sqrt(2 (l + 1)) for global block index l; ``layer_number`` is global, 1-based,
        so pipeline stages agree with the unsharded model. c_l = 1 without ``depth_constant``
        (the paper's ablation)."""
        return math.sqrt(2.0 * self.layer_number) if self.depth_constant else 1.0

    def split_streams(self, sublayer: str, hidden_states: torch.Tensor):
        if sublayer == "attn" and self.layer_number == 1:
            return streams.start(hidden_states)
        return streams.unpack(hidden_states)

    def apply_update(self, pending: PendingUpdate) -> tuple[torch.Tensor, torch.Tensor]:
        """x <- x + r / c_l ; y <- y + r, for an entry that cannot take the fused path."""
        x, y, r = pending
        return x + r / self.depth_scale, y + r

    def residual_update(self, sublayer, saved, branch_out):
        """x <- x + r / c_l ; y <- y + r : one shared branch output feeds both streams."""
        x, y = saved
        if sublayer == "attn":
            return PendingUpdate(x, y, branch_out)
        return dispatch.dual_update(x, y, branch_out, self.depth_scale, streams)
