"""Model weights in megatron's distributed checkpoint format (torch_dist).

Each rank contributes its shards under global keys, so a checkpoint written under one TP/PP/VP
layout loads under any other. Virtual pipeline chunks are stored as ``model0``, ``model1``...
like Megatron-LM does; their tensors still carry global layer numbers.
"""

from __future__ import annotations

import os

from megatron.core import dist_checkpointing


def model_sharded_state_dict(chunks: list) -> dict:
    unwrapped = [getattr(c, "module", c) for c in chunks]
    if len(unwrapped) == 1:
        return {"model": unwrapped[0].sharded_state_dict()}
    return {f"model{i}": c.sharded_state_dict() for i, c in enumerate(unwrapped)}


def save_model(chunks: list, directory: str) -> None:
    os.makedirs(directory, exist_ok=True)
    dist_checkpointing.save(model_sharded_state_dict(chunks), directory)


def load_model(chunks: list, directory: str) -> None:
    state = dist_checkpointing.load(model_sharded_state_dict(chunks), directory)
    load_chunks(chunks, state)


def load_chunks(chunks: list, state: dict) -> None:
    """Put a loaded state (keys as :func:`model_sharded_state_dict`) into the chunks, strictly:
    every parameter must be in it."""
    for index, chunk in enumerate(chunks):
        key = "model" if len(chunks) == 1 else f"model{index}"
        getattr(chunk, "module", chunk).load_state_dict(state[key], strict=True)
