"""megatron's ``DotProductAttention`` (the ``local`` attention backend), taking document ids.

With document attention (``model.documents``) the mask reaching core attention is document
ids; this subclass turns them into megatron's boolean mask (True = masked: another document or
a later position) and has its softmax apply that mask as given. megatron's fused causal softmax
ignores any mask, so for such a call its mask type is ``padding`` (the given mask, which already
holds causality) rather than ``causal``.
"""

from __future__ import annotations

from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from model import documents


class LocalAttention(DotProductAttention):
    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if not documents.is_document_ids(attention_mask):
            return super().forward(query, key, value, attention_mask, attn_mask_type,
                                   attention_bias, packed_seq_params)
        masked = ~documents.keep_mask(attention_mask, query.size(0), key.size(0))
        softmax = self.scale_mask_softmax
        own_type, softmax.attn_mask_type = softmax.attn_mask_type, AttnMaskType.padding
        try:
            return super().forward(query, key, value, masked, AttnMaskType.padding,
                                   attention_bias, packed_seq_params)
        finally:
            softmax.attn_mask_type = own_type
