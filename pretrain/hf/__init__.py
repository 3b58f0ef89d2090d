"""Hugging Face interop: Llama weight maps, model and tokenizer export, the remote code."""
