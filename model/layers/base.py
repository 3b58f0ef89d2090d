"""A megatron TransformerLayer whose forward is the scheme's own equations.

megatron's forward hard-wires Pre-Norm (norm -> branch -> bias-dropout-add). The residual
schemes keep megatron's attention and MLP modules (so tensor and sequence parallelism,
recomputation and checkpoints apply unchanged) and write the few lines that differ: what each
branch reads and how its output is folded back. Each scheme's layer implements
:meth:`SchemeLayer.compute` from its equations, calling :meth:`~SchemeLayer.attention` and
:meth:`~SchemeLayer.feed_forward` for the two branches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
)
from megatron.core.utils import make_viewless_tensor

from kernels.backend import NormBackend
from kernels.norms import Norm


@dataclass
class SchemeLayerSubmodules(TransformerLayerSubmodules):
    """megatron's layer submodules plus how every norm the scheme owns is built (the model's
    norm class with its kernel backend: ``model.spec.plain_norm``)."""

    norm: ModuleSpec | type = IdentityOp


class BranchInputs(NamedTuple):
    """What megatron hands a layer besides the hidden states, for its two branches."""

    attention: dict[str, Any]
    padding_mask: torch.Tensor | None


class SchemeLayer(TransformerLayer):
    """Base class: a scheme's layer implements :meth:`compute`. ``backend`` is the norm backend
    the model is built with (resolved, spec param), for the ops a layer binds itself."""

    def __init__(self, config, submodules, *args, backend: NormBackend = NormBackend.TORCH,
                 **kwargs):
        super().__init__(config, submodules, *args, **kwargs)
        self.backend = backend
        # Global block 0 (megatron's global, 1-based layer_number 1) reads the embedding. Kept
        # as a flag: a compiled block's guard is then on it (two graphs per block class),
        # not on the block's number (one graph per block).
        self.reads_embedding = self.layer_number == 1

    def build_norm(self, hidden_size: int | None = None, site: str = "other") -> torch.nn.Module:
        """A norm as the spec builds them (over ``hidden_size``, default the model's);
        ``site`` "attention" for a norm of the attention sublayer (its DyT alpha starts
        higher by the DyT paper's rule: ``kernels.norms.Norm``)."""
        spec = self.submodules_config.norm
        site_of = {"site": site} if getattr(spec, "module", None) is Norm else {}
        return build_module(spec, config=self.config,
                            hidden_size=hidden_size or self.config.hidden_size,
                            eps=self.config.layernorm_epsilon, **site_of)

    def compute(self, hidden_states: torch.Tensor, inputs: BranchInputs) -> torch.Tensor:
        """The layer's output from its input: the scheme's equations."""
        raise NotImplementedError

    def _bias_dropout(self, output_with_bias) -> torch.Tensor:
        output, bias = output_with_bias
        if bias is not None:
            output = output + bias
        return F.dropout(output, p=self.hidden_dropout, training=self.training)

    def attention(self, branch_input: torch.Tensor, inputs: BranchInputs) -> torch.Tensor:
        """The attention branch's output r (bias added, dropout applied)."""
        return self._bias_dropout(self.self_attention(branch_input, **inputs.attention))

    def feed_forward(self, branch_input: torch.Tensor, inputs: BranchInputs) -> torch.Tensor:
        """The MLP branch's output r (bias added, dropout applied)."""
        return self._bias_dropout(self.mlp(branch_input, padding_mask=inputs.padding_mask))

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
        inputs = BranchInputs(
            attention=dict(
                attention_mask=attention_mask, inference_context=inference_context,
                rotary_pos_emb=rotary_pos_emb, rotary_pos_cos=rotary_pos_cos,
                rotary_pos_sin=rotary_pos_sin, rotary_pos_cos_sin=rotary_pos_cos_sin,
                attention_bias=attention_bias, packed_seq_params=packed_seq_params,
                sequence_len_offset=sequence_len_offset,
            ),
            padding_mask=padding_mask,
        )
        output = self.compute(hidden_states, inputs)
        # The pipeline schedules free layer outputs through .data; they must not be views.
        output = make_viewless_tensor(inp=output, requires_grad=output.requires_grad,
                                      keep_graph=True)
        return output, context


LayerChoice = tuple[type[SchemeLayer], dict[str, Any]] | None
"""What a scheme file's ``layer(model, index)`` returns: the layer class of a block and its
spec parameters, or None for megatron's own Pre-Norm layer."""
