"""Core attention through ``torch.nn.functional.scaled_dot_product_attention``.

megatron's unfused ``DotProductAttention`` builds the full [b, heads, s, s] score matrix and
keeps the probabilities for backward: at seq 4096 with 16 heads that is 512 MiB per layer and
sequence in bf16, more than the rest of the layer's activations together. SDPA hands the same
computation to a fused kernel (flash, cuDNN or memory-efficient on GPU; a fused kernel on CPU),
whose memory grows with s rather than s^2. This module keeps megatron's core-attention contract
so a spec can swap it in for ``DotProductAttention`` wherever Transformer Engine is missing:

    in:  query [sq, b, np, hn], key/value [sk, b, ng, hn]   (np, ng: this TP rank's heads)
    out: context [sq, b, np * hn]

Grouped-query attention passes ``enable_gqa`` where the flash kernel can take it (CUDA, 16-bit,
head_dim <= 256); elsewhere SDPA would fall back to its unfused path for GQA, so K/V are
expanded per query head first, as megatron does.

Document attention (``model.documents``: the mask is document ids) takes one of three paths,
chosen when the module is built: on CUDA, flex attention with a block mask made from the ids
(compiled once; blocks outside every document are skipped and no s x s tensor is kept); on the
CPU, from sequences of SPLIT_FROM tokens on, one causal SDPA call per document, which measured
cheaper there than one call with the exact mask (0.75 against 2.08 times plain causal
attention at seq 2048 with ten documents, forward and backward; the masked call also keeps a
float copy of the mask per layer: ``bench.document_attention``), and below it SDPA with the
exact mask (same document and causal), where the calls' own cost dominates (a demo step of seq
128 took 1.25 times the plain step one call per document, 1.00 with the mask). The exact mask
also serves queries that are not the keys (decoding) and, on CUDA, attention dropout (flex
attention has none).

Under context parallelism (``parallel.cp``) each rank's queries meet the whole sequence's keys
(``model.context_parallel``): each of its two chunks is a call whose queries are the last of
its keys, bottom-right causal (flash attention's own rule on CUDA, through torch's
lower-right ``CausalBias``), with document ids flex attention on CUDA and the exact mask on
the CPU.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide
from torch.nn.attention.bias import causal_lower_right

from model import context_parallel, documents
from runtime import context, device

_FLASH_MAX_HEAD_DIM = 256
SPLIT_FROM = 512
"""Sequence length from which the CPU attends one document at a time (module docstring)."""


class DocumentKernel:
    FLEX = "flex"  # flex attention, block mask from the ids (CUDA)
    SPLIT = "split"  # one causal SDPA call per document (the CPU)
    MASK = "mask"  # SDPA with the exact [b, 1, s, s] boolean mask (any device)


def _flex_available() -> bool:
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


_compiled_flex = None


def _flex(q, k, v, block_mask, scale: float, gqa: bool):
    """flex attention, compiled on first use (uncompiled it computes the full score matrix)."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False) \
            if q.is_cuda else flex_attention
    return _compiled_flex(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa)


class SDPAttention(MegatronModule):
    """Drop-in ``core_attention`` for megatron's SelfAttention (same constructor and forward).

    ``native_gqa`` forces (True) or forbids (False) SDPA's ``enable_gqa``; None picks per call.
    """

    native_gqa: bool | None = None
    document_kernel: str | None = None
    """Forces the document-attention path (:class:`DocumentKernel`) for modules built after it
    is set; None picks flex attention on CUDA where torch has it, else one call per document
    from SPLIT_FROM tokens on and the exact mask below."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        unsupported = {
            "softmax_type other than vanilla": config.softmax_type != "vanilla",
            "window_size (sliding-window attention)": config.window_size is not None,
        }
        for what, present in unsupported.items():
            if present:
                raise ValueError(f"SDPA core attention does not support {what}")
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        tp_size = (pg_collection.tp.size() if pg_collection is not None
                   else parallel_state.get_tensor_model_parallel_world_size())
        self.hidden_size_per_attention_head = config.kv_channels
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, tp_size)
        self.num_query_groups_per_partition = divide(config.num_query_groups, tp_size)
        self.hidden_size_per_partition = (
            self.num_attention_heads_per_partition * self.hidden_size_per_attention_head
        )
        # megatron's query-key layer scaling divides the scale by the layer number and multiplies
        # it back inside the softmax: the same function, so only the plain scale is needed.
        self.softmax_scale = (softmax_scale if softmax_scale is not None
                              else 1.0 / math.sqrt(self.hidden_size_per_attention_head))
        self.dropout_p = config.attention_dropout if attention_dropout is None \
            else attention_dropout
        self.documents = self.document_kernel or (
            DocumentKernel.FLEX if device.uses_cuda() and _flex_available() else None)
        """The document path; None: by the sequence's length (:meth:`_document_kernel`)."""

    def _use_native_gqa(self, query: torch.Tensor) -> bool:
        if self.native_gqa is not None:
            return self.native_gqa
        return (query.is_cuda and query.dtype in (torch.float16, torch.bfloat16)
                and query.size(-1) <= _FLASH_MAX_HEAD_DIM)

    def _dropout_rng(self, dropout_p: float):
        """Dropout draws from megatron's model-parallel RNG stream (as DotProductAttention), so
        TP ranks, which hold different heads, drop independently and reproducibly."""
        if dropout_p > 0.0 and not self.config.sequence_parallel:
            return tensor_parallel.get_cuda_rng_tracker().fork()
        return contextlib.nullcontext()

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("SDPA core attention supports neither packed sequences nor an "
                             "attention bias; use attention_backend te")
        if context.size() > 1:
            if attention_mask is not None and not documents.is_document_ids(attention_mask):
                raise ValueError("context parallelism takes causal attention, with or without "
                                 "document ids; not a given mask")
            return context_parallel.attention(
                query, key, value, attention_mask,
                lambda q, k, v, ids: self._attend(q, k, v, ids, AttnMaskType.causal))
        return self._attend(query, key, value, attention_mask,
                            attn_mask_type or self.attn_mask_type)

    def _attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, mask_type: AttnMaskType) -> torch.Tensor:
        """[sq, b, heads x d]: the queries against the keys, the queries being the last sq of
        the sk positions (bottom-right aligned, as in decoding)."""
        sq, b, heads, head_dim = query.shape
        sk = key.size(0)
        groups = heads // key.size(2)
        # (the lower-right causal rule of sq < sk reaches flash attention without enable_gqa)
        gqa = groups > 1 and self._use_native_gqa(query) and sq == sk
        if groups > 1 and not gqa:
            key = key.repeat_interleave(groups, dim=2)
            value = value.repeat_interleave(groups, dim=2)

        dropout_p = self.dropout_p if self.training else 0.0
        # [s, b, h, d] -> [b, h, s, d]: a view; the kernels accept these strides.
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if documents.is_document_ids(attention_mask):
            attended = None
            kernel = self._document_kernel(sq)
            if kernel == DocumentKernel.FLEX and dropout_p == 0.0:
                block_mask = documents.flex_block_mask(attention_mask, sq, sk)
                attended = _flex(q, k, v, block_mask, self.softmax_scale, gqa)
            elif kernel == DocumentKernel.SPLIT and sq == sk:
                with self._dropout_rng(dropout_p):
                    attended = self._per_document(q, k, v, attention_mask, dropout_p, gqa)
            if attended is not None:
                return attended.permute(2, 0, 1, 3).reshape(sq, b, heads * head_dim)
        mask, causal = self._mask(attention_mask, mask_type, sq, sk)
        with self._dropout_rng(dropout_p):
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=causal,
                scale=self.softmax_scale, **({"enable_gqa": True} if gqa else {}),
            )
        # [b, h, sq, d] -> [sq, b, h * d]
        return out.permute(2, 0, 1, 3).reshape(sq, b, heads * head_dim)

    def _document_kernel(self, sq: int) -> str:
        if self.documents is not None:
            return self.documents
        if torch.compiler.is_compiling():
            # Inside a compiled block (kernels.compile) the spans of each document are host
            # values a graph cannot hold: they change every micro-batch. The exact mask is a
            # few fused elementwise ops there, and the block stays one graph at any length.
            return DocumentKernel.MASK
        return DocumentKernel.SPLIT if sq >= SPLIT_FROM else DocumentKernel.MASK

    def _per_document(self, q, k, v, attention_mask, dropout_p: float, gqa: bool):
        """[b, h, s, d]: one causal SDPA call for each document of each row."""
        rows = []
        for row, spans in enumerate(documents.spans(attention_mask)):
            parts = [F.scaled_dot_product_attention(
                q[row:row + 1, :, start:end], k[row:row + 1, :, start:end],
                v[row:row + 1, :, start:end], dropout_p=dropout_p, is_causal=True,
                scale=self.softmax_scale, **({"enable_gqa": True} if gqa else {}))
                for start, end in spans]
            rows.append(torch.cat(parts, dim=2))
        return torch.cat(rows, dim=0)

    @staticmethod
    def _mask(attention_mask, mask_type, sq: int, sk: int):
        """(keep-mask, lower-right causal bias or None, is_causal). megatron's masks mark
        positions to drop (True = masked); SDPA's boolean masks mark positions to keep.
        Document ids (``model.documents``) become the exact keep-mask."""
        if documents.is_document_ids(attention_mask):
            return documents.keep_mask(attention_mask, sq, sk), False
        if attention_mask is not None:
            return ~attention_mask.bool(), False
        if mask_type is not AttnMaskType.causal or sq == 1:  # sq == 1: one query sees all keys
            return None, False
        if sq == sk:
            return None, True
        # Queries are the last sq of sk positions (bottom-right aligned, as in decoding, and
        # a context-parallel chunk against the keys up to its end): flash attention's own
        # causal rule on CUDA, no mask formed; the CPU's kernel materialises it.
        return causal_lower_right(sq, sk), False
