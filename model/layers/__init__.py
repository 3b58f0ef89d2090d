"""One layer class per residual scheme; ``pre`` is megatron's own TransformerLayer."""
