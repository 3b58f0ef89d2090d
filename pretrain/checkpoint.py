"""Run checkpoints: model, optimizer, LR schedule, RNG and data position, saved atomically.

Layout under ``<run.dir>/checkpoints/``::

    step_00000100/        megatron torch_dist checkpoint + rng/rank<r>.pt + complete.json
    latest                name of the newest complete checkpoint

A checkpoint is written into ``.step_<n>.tmp`` and renamed only once every rank finished and
``complete.json`` exists, then ``latest`` is replaced atomically. A crash (even SIGKILL) during a
save leaves at most a stale ``.tmp`` folder; the previous checkpoint stays the latest. Model
and optimizer tensors carry global keys, so a checkpoint loads under any TP/PP/VP layout.
The data position is the step count (see :mod:`pretrain.data`).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, tensor_parallel
from torch.distributed.checkpoint.api import CheckpointException

from model import device
from model.checkpoint import load_model, model_sharded_state_dict
from model.config import ConfigError
from pretrain.optim import check_schedule, load_state, prime_state

COMPLETE = "complete.json"
# The distributed optimizer's state in its per-parameter (canonical) form, so a checkpoint
# reshards across TP/PP/DP; megatron 0.19 no longer writes its older flattened format.
OPTIMIZER_FORMAT = {"distrib_optim_sharding_type": "fully_reshardable"}
# torch.distributed.checkpoint wraps read errors in CheckpointException, a BaseException.
LOAD_ERRORS = (Exception, CheckpointException)
# Tests set this to a step number to SIGKILL the process in the middle of that step's save.
FAULT_KILL_IN_SAVE = "PRETRAIN_FAULT_KILL_IN_SAVE"


def _rank0() -> bool:
    return dist.get_rank() == 0


def _rng_state() -> dict:
    return {
        "python": random.getstate(), "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if device.uses_cuda() else None,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and device.uses_cuda():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _sharded_state(chunks, optimizer, scheduler, step: int, loading: bool) -> dict:
    state = model_sharded_state_dict(chunks)
    state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=loading,
                                                      metadata=OPTIMIZER_FORMAT)
    state["scheduler"] = scheduler.state_dict()
    state["step"] = step
    return state


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.glob("step_*") if (p / COMPLETE).is_file()]
    return sorted(found, key=lambda p: p.name)


def save(root: Path, step: int, chunks, optimizer, scheduler, keep_last: int) -> Path:
    final, tmp = root / f"step_{step:08d}", root / f".step_{step:08d}.tmp"
    if _rank0():
        if tmp.exists():
            shutil.rmtree(tmp)  # left by a crash during an earlier save
        tmp.mkdir(parents=True)
    dist.barrier()
    dist_checkpointing.save(_sharded_state(chunks, optimizer, scheduler, step, False), str(tmp))
    (tmp / "rng").mkdir(exist_ok=True)
    torch.save(_rng_state(), tmp / "rng" / f"rank{dist.get_rank()}.pt")
    if os.environ.get(FAULT_KILL_IN_SAVE) == str(step):
        os.kill(os.getpid(), signal.SIGKILL)  # fault injection: die with the save half done
    dist.barrier()
    if _rank0():
        (tmp / COMPLETE).write_text(json.dumps({"step": step,
                                                "world_size": dist.get_world_size()}))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        latest_tmp = root / "latest.tmp"
        latest_tmp.write_text(final.name)
        os.replace(latest_tmp, root / "latest")
        for old in complete_checkpoints(root)[:-keep_last]:
            shutil.rmtree(old)
    dist.barrier()
    return final


def resolve(path: Path) -> Path | None:
    """The checkpoint to resume from: ``path`` itself if it is one, else the newest complete
    one under it (``latest`` first). None when there is none."""
    if (path / COMPLETE).is_file():
        return path
    latest = path / "latest"
    if latest.is_file():
        candidate = path / latest.read_text().strip()
        if (candidate / COMPLETE).is_file():
            return candidate
    complete = complete_checkpoints(path)
    return complete[-1] if complete else None


def _load_error(directory: Path, err: Exception) -> ConfigError:
    text = str(err).strip()
    first_line = text.splitlines()[0] if text else type(err).__name__
    return ConfigError(f"checkpoint '{directory}' could not be loaded: {first_line}")


def load_weights(path: Path, chunks) -> Path:
    """Model weights only, from ``path`` (a checkpoint or a folder of them); returns the
    checkpoint used. For evaluation and for starting a run from given weights."""
    if not path.is_dir():
        raise ConfigError(f"checkpoint folder '{path}' does not exist")
    found = resolve(path)
    if found is None:
        raise ConfigError(f"checkpoint folder '{path}' holds no complete checkpoint")
    try:
        load_model(chunks, str(found))
    except LOAD_ERRORS as err:  # megatron raises many types for a damaged checkpoint
        raise _load_error(found, err) from None
    return found


def load(directory: Path, chunks, optimizer, scheduler) -> int:
    """Restore everything saved by :func:`save`; returns the step to continue from."""
    if not (directory / COMPLETE).is_file():
        raise ConfigError(f"checkpoint '{directory}' is not a complete checkpoint "
                          f"(no {COMPLETE})")
    prime_state(optimizer)
    try:
        sharded = _sharded_state(chunks, optimizer, scheduler, 0, loading=True)
        state = dist_checkpointing.load(sharded, str(directory))
    except LOAD_ERRORS as err:  # megatron raises many types for a damaged checkpoint
        raise _load_error(directory, err) from None
    for index, chunk in enumerate(chunks):
        key = "model" if len(chunks) == 1 else f"model{index}"
        getattr(chunk, "module", chunk).load_state_dict(state[key])
    check_schedule(scheduler, state["scheduler"])
    load_state(optimizer, state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    saved_world = json.loads((directory / COMPLETE).read_text())["world_size"]
    if saved_world == dist.get_world_size():  # RNG streams are per rank of one layout
        _set_rng_state(torch.load(directory / "rng" / f"rank{dist.get_rank()}.pt",
                                  weights_only=False))
    return int(state["step"])
