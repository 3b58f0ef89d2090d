"""Norm kernels for the hot path: one dispatch point over torch reference and fused backends."""
