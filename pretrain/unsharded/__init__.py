"""A checkpoint of any layout as one whole model in one process: generation and lm-eval."""
