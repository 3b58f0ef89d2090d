"""Two-stream (SiameseNorm) and baseline transformers on megatron-core."""
