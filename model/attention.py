"""Self-attention with per-head norms on Q, K and V (HybridNorm's QKV-norm).

megatron normalises Q and K per head (``q_layernorm``/``k_layernorm``) but not V; this
subclass adds the V norm with the same builder. The head norms have head_dim-sized weights
shared by every head, and each TP rank holds different heads, so their gradients are partial
per rank: megatron sums Q/K's by name when ``qk_layernorm`` is set; V's carry
``tp_partial_grad`` and :func:`runtime.grads.finalize_grads` sums them.

With the triton norm backend the three norms run as one kernel over the packed projection
(``kernels.triton_ops.qkv_norm``): each (token, K/V group) row is read once and Q, K and V are
written normalised and contiguous, instead of three norms over strided views of it. Where
megatron re-slices the projection across ranks (fewer K/V groups than TP ranks) the norms stay
separate.
"""

from __future__ import annotations

from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.spec_utils import build_module

from kernels.norms import Norm


class QKVNormSelfAttention(SelfAttention):
    def __init__(self, config, submodules, *args, **kwargs):
        super().__init__(config, submodules, *args, **kwargs)
        self.v_layernorm = build_module(
            submodules.q_layernorm, config=self.config,
            hidden_size=self.hidden_size_per_attention_head,
            eps=self.config.layernorm_epsilon,
        )
        for param in self.v_layernorm.parameters():
            param.sequence_parallel = False  # summed once, below, with or without SP
            param.tp_partial_grad = True
        norms = (self.q_layernorm, self.k_layernorm, self.v_layernorm)
        self.fused_norms = (all(isinstance(n, Norm) and n.fused_kernels for n in norms)
                            and self.config.num_query_groups >= self.world_size)

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None,
                                    output_gate=False, split_qkv=True):
        if self.fused_norms and split_qkv and not output_gate:
            from kernels import norm_library

            mixed, _ = super().get_query_key_value_tensors(hidden_states, key_value_states,
                                                           split_qkv=False)
            heads = (self.num_attention_heads_per_partition
                     // self.num_query_groups_per_partition)
            q_norm = self.q_layernorm
            return norm_library.qkv_norm(mixed, heads, self.hidden_size_per_attention_head,
                                       q_norm.eps, q_norm.is_rms, q_norm, self.k_layernorm,
                                       self.v_layernorm)
        query, key, value = super().get_query_key_value_tensors(
            hidden_states, key_value_states, output_gate=output_gate, split_qkv=split_qkv
        )
        return query, key, self.v_layernorm(value)
