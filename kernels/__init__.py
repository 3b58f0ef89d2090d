"""Norm kernels for the hot path: the torch reference, the fused Triton kernels, and which of
them (or Transformer Engine's) a model is built with (``kernels.backend``)."""
