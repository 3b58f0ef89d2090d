"""Text to batches: documents, tokenizers, indexed datasets and the data position."""
