"""Model weights in megatron's distributed checkpoint format (torch_dist): the one load path.

Each rank contributes its shards under global keys, so weights written under one TP/PP/VP
layout load under any other. Virtual pipeline chunks are stored as ``model0``, ``model1``...
like Megatron-LM does; their tensors still carry global layer numbers. Run checkpoints
(``pretrain.run.checkpoint``) add the optimizer, schedule and RNG around the same model state and
load it through :func:`read` and :func:`put`.
"""

from __future__ import annotations

import os
from pathlib import Path

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.dist_checkpointing.dict_utils import nested_values
from torch.distributed.checkpoint.api import CheckpointException

from runtime import checkpoint_reader
from runtime.errors import CheckpointError
from runtime.write_results import reported_in_a_file

# torch.distributed.checkpoint wraps read errors in CheckpointException, a BaseException, and
# megatron raises many other types for a damaged checkpoint.
LOAD_ERRORS = (Exception, CheckpointException)


def sharded_state(chunks: list) -> dict:
    """The model part of a checkpoint: ``model`` (or ``model0``, ``model1``... per chunk)."""
    unwrapped = [getattr(c, "module", c) for c in chunks]
    if len(unwrapped) == 1:
        return {"model": unwrapped[0].sharded_state_dict()}
    return {f"model{i}": c.sharded_state_dict() for i, c in enumerate(unwrapped)}


def save(chunks: list, directory: str | Path) -> None:
    """The model weights alone (tests and tools; runs save through pretrain.run.checkpoint)."""
    os.makedirs(directory, exist_ok=True)
    with reported_in_a_file():  # no Manager process (runtime.write_results)
        dist_checkpointing.save(sharded_state(chunks), str(directory))


def first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def check_shapes(sharded: dict, directory: str | Path) -> None:
    """Every model tensor has the checkpoint's global shape: megatron would otherwise load
    the overlap of a larger or smaller tensor (a vocabulary change) without a word."""
    saved = checkpoint_reader.tensors_metadata(Path(directory))
    for tensor in nested_values(sharded):
        if isinstance(tensor, ShardedTensor) and tensor.key in saved:
            want, have = tuple(saved[tensor.key].global_shape), tuple(tensor.global_shape)
            if want != have:
                raise CheckpointError(f"checkpoint '{directory}' holds another model: tensor "
                                      f"{tensor.key} is {list(want)} there, {list(have)} here")


def read(sharded: dict, directory: str | Path) -> dict:
    """Load ``sharded`` (a state with the model's tensors, and possibly more) after checking
    its shapes; any failure is one CheckpointError naming the checkpoint. No file is read in a
    way that could run code it names (runtime.checkpoint_reader)."""
    try:
        check_shapes(sharded, directory)
        return checkpoint_reader.load(sharded, Path(directory))
    except CheckpointError:
        raise
    except LOAD_ERRORS as err:
        raise CheckpointError(f"checkpoint '{directory}' could not be loaded: "
                              f"{first_line(err)}") from None


def put(chunks: list, state: dict) -> None:
    """Put a loaded state (keys as :func:`sharded_state`) into the chunks, strictly: every
    parameter must be in it."""
    for index, chunk in enumerate(chunks):
        key = "model" if len(chunks) == 1 else f"model{index}"
        getattr(chunk, "module", chunk).load_state_dict(state[key], strict=True)


def load(chunks: list, directory: str | Path) -> None:
    """The weights of the checkpoint ``directory`` into the chunks (any layout)."""
    put(chunks, read(sharded_state(chunks), directory))
