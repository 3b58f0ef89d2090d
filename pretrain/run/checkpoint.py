"""Run checkpoints: model, optimizer, LR schedule, RNG and data position, saved atomically.

Layout under ``<run.dir>/checkpoints/``::

    step_00000100/        megatron torch_dist checkpoint + rng/rank<r>.pt + complete.json
    latest                name of the newest complete checkpoint (for people and scripts)

A checkpoint is written into ``.step_<n>.tmp`` and renamed only once every rank finished and
``complete.json`` exists, then ``latest`` is replaced atomically, each step synced to the disk
before the next names it. A crash (even SIGKILL, or of the machine) or a full disk during a
save leaves at most a stale ``.tmp`` folder, which the next training start removes
(:func:`remove_unfinished`); the previous checkpoint stays the latest. With
``run.async_save`` the tensors are written in the background between :func:`start` and
:func:`complete` (:mod:`pretrain.run.saver`), to the same effect.
Resuming takes the newest complete checkpoint (``latest`` is only a hint). Model
and optimizer tensors carry global keys, so a checkpoint loads under any TP/PP/VP layout.
``complete.json`` also records what the checkpoint is (:mod:`pretrain.run.identity`): its model,
its data and data position, checked before any tensor is read. Weights that are not finite
are never saved (pretrain.train.loop checks before each save).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import pickle
import random
import shutil
from pathlib import Path
from typing import NoReturn

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, tensor_parallel

from pretrain.config import Config
from pretrain.data.position import DataPosition
from pretrain.optim import (
    adopt_schedule,
    check_schedule,
    load_schedule,
    load_state,
    prime_state,
    schedule_state,
    sharded_optimizer_state,
)
from pretrain.run import identity
from pretrain.run.failure import save_failure
from runtime import device, weights
from runtime.errors import CheckpointError
from runtime.parallel import any_rank
from runtime.write_results import reported_in_a_file

log = logging.getLogger("pretrain")

COMPLETE = "complete.json"
# The distributed optimizer's state in its per-parameter (canonical) form, so a checkpoint
# reshards across TP/PP/DP; megatron 0.19 no longer writes its older flattened format.
OPTIMIZER_FORMAT = {"distrib_optim_sharding_type": "fully_reshardable"}


def _rank0() -> bool:
    return dist.get_rank() == 0


# Constructors a pickled numpy array needs: RNG files written before RNG states were saved as
# tensors hold numpy's state as an array. Allowed explicitly, so every RNG file is read with
# weights_only=True; the tensor files are read by runtime.checkpoint_reader, complete.json is
# JSON: no file of a checkpoint can name code that runs on load.
NUMPY_ARRAY_GLOBALS = [np._core.multiarray._reconstruct, np.ndarray, np.dtype,
                       type(np.dtype(np.uint32))]


def rng_state() -> dict:
    """Every generator a step draws from, as tensors and plain values only (so loading it
    needs no pickled objects)."""
    version, mt_state, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": [version, torch.tensor(mt_state, dtype=torch.int64), gauss],
        "numpy": [name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if device.uses_cuda() else None,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def read_rng_state(path: Path) -> dict:
    """An RNG file of :func:`rng_state`, or of an earlier version (numpy's state pickled as
    an array, Python's as a tuple). A file naming any other object is refused unread."""
    try:
        with torch.serialization.safe_globals(NUMPY_ARRAY_GLOBALS):
            state = torch.load(path, weights_only=True)
    except pickle.UnpicklingError:
        raise CheckpointError(f"'{path}' holds objects other than tensors and plain values; "
                              "refused, since loading them could run code") from None
    return settable_rng_state(state)


def settable_rng_state(state: dict) -> dict:
    """A :func:`rng_state` (saved or held in memory) in the form :func:`set_rng_state`
    takes: Python's and numpy's states back in their own types."""
    version, mt_state, gauss = state["python"]
    name, keys, pos, has_gauss, cached = state["numpy"]
    return {**state, "python": (version, tuple(int(v) for v in mt_state), gauss),
            "numpy": (name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached)}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and device.uses_cuda():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _sharded_state(chunks, optimizer, scheduler, step: int, loading: bool) -> dict:
    state = weights.sharded_state(chunks)
    state["optimizer"] = sharded_optimizer_state(optimizer, state, loading, OPTIMIZER_FORMAT)
    state["scheduler"] = schedule_state(scheduler)
    state["step"] = step
    return state


def saved_state(chunks, optimizer, scheduler, step: int) -> dict:
    """What a checkpoint of ``step`` holds, as megatron's sharded state to save."""
    return _sharded_state(chunks, optimizer, scheduler, step, loading=False)


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.glob("step_*") if (p / COMPLETE).is_file()]
    return sorted(found, key=lambda p: p.name)


def save(root: Path, step: int, chunks, optimizer, scheduler, keep_last: int,
         record: dict) -> Path:
    """Save atomically; ``record`` (what the checkpoint is) goes into complete.json. A failed
    write on any rank (a full disk) removes the partial folder on every rank and raises one
    CheckpointError. (pretrain.run.saver also writes in the background, between the same
    :func:`start` and :func:`complete`.)"""
    tmp = start(root, step)
    failure = None
    try:
        with reported_in_a_file():  # no Manager process (runtime.write_results)
            dist_checkpointing.save(saved_state(chunks, optimizer, scheduler, step), str(tmp))
        save_rng_state(tmp)
    except weights.LOAD_ERRORS as err:  # megatron wraps a worker's OSError in several types
        failure = err
    return complete(root, step, tmp, keep_last, record, failure)


def remove_unfinished(root: Path) -> list[Path]:
    """Remove every ``.step_N.tmp`` under ``root``: saves that never completed (a crash, a
    second Ctrl-C, a background write given up on). Only for a start holding the run's lock,
    before its first save: no other process can be writing one then. A save of step N
    replaces only its own ``.step_N.tmp``, and a resume rarely saves the step a stop save was
    cut short at, so without this one could stay for good. Returns what was removed (one
    that cannot be is left to the save of its step, which replaces it or fails naming it)."""
    found = sorted(root.glob(".step_*.tmp"))
    for folder in found:
        shutil.rmtree(folder, ignore_errors=True)
    return [folder for folder in found if not folder.exists()]


def start(root: Path, step: int) -> Path:
    """The empty folder a save of ``step`` is written into, ``.step_N.tmp``, made by rank 0
    (one a crash left is replaced); every rank gets its path, or the same CheckpointError."""
    tmp = root / f".step_{step:08d}.tmp"
    failure = None
    if _rank0():
        try:
            if tmp.exists():
                shutil.rmtree(tmp)  # left by a crash during an earlier save
            tmp.mkdir(parents=True)
        except OSError as err:
            failure = err
    # Each reduction here and in complete() is also the barrier between the phases, so that a
    # rank that failed alone never leaves the others waiting in a collective it skipped.
    if any_rank(failure is not None):
        abandon(root, step, tmp, failure)
    return tmp


def _sync(folder: Path) -> None:
    """Flush ``folder``'s entries (files made or renamed in it) to the disk: what a rename or
    complete.json then vouches for must survive a power loss or node crash, not only a
    process crash (megatron syncs the tensor files it writes). A file system that cannot sync
    a folder (some network and FUSE ones: EINVAL) orders its metadata itself."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as err:
        if err.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def _write_synced(path: Path, write) -> None:
    """``write(file)`` into a new binary file ``path``, synced before it is closed."""
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def save_rng_state(tmp: Path) -> None:
    """This rank's RNG file in the checkpoint folder being written (synced)."""
    (tmp / "rng").mkdir(exist_ok=True)
    _write_synced(tmp / "rng" / f"rank{dist.get_rank()}.pt",
                  lambda f: torch.save(rng_state(), f))


def complete(root: Path, step: int, tmp: Path, keep_last: int, record: dict,
             failure: BaseException | None) -> Path:
    """Every rank, once its write into ``tmp`` ended (``failure``: how it failed, if it did):
    complete.json last, the rename to ``step_N``, ``latest``, and the pruning to ``keep_last``
    complete checkpoints. A failure on any rank removes the folder instead (abandon). Each step
    is on the disk before the next vouches for it: the RNG files and complete.json synced,
    then the folder's entries, then, after the renames, the checkpoints folder's."""
    final = root / f"step_{step:08d}"
    if not any_rank(failure is not None) and _rank0():
        try:
            text = json.dumps({"step": step, "world_size": dist.get_world_size(), **record})
            _write_synced(tmp / COMPLETE, lambda f: f.write(text.encode()))
            _sync(tmp / "rng")
            _sync(tmp)
        except OSError as err:
            failure = err
    if any_rank(failure is not None):
        abandon(root, step, tmp, failure)
    if _rank0():
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        latest_tmp = root / "latest.tmp"
        try:
            latest_tmp.write_text(final.name)
            os.replace(latest_tmp, root / "latest")
        except OSError as err:  # the checkpoint is complete; `latest` is only a hint
            log.warning("could not update %s: %s", root / "latest", err.strerror)
        try:
            _sync(root)
        except OSError as err:  # renamed already: a later sync (the next save) covers it
            log.warning("could not sync %s: %s", root, err.strerror)
        for old in complete_checkpoints(root)[:-keep_last]:
            shutil.rmtree(old)
    dist.barrier()
    return final


def abandon(root: Path, step: int, tmp: Path, failure: BaseException | None) -> NoReturn:
    """Every rank, when the save of ``step`` failed on some rank (``failure``: this rank's
    error, None if another rank's): the partial folder goes, and one CheckpointError names
    the step and the checkpoint that is still the latest."""
    if _rank0():
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    reason = save_failure(failure, root) if failure is not None else "failed on another rank"
    raise CheckpointError(f"saving checkpoint step {step} to '{root}' failed ({reason}); "
                          f"{latest_text(root)}")


def resolve(path: Path) -> Path | None:
    """The checkpoint to resume from: ``path`` itself if it is one, else the newest complete
    one under it. ``latest`` is not trusted over what is on disk: a copy or a manual edit can
    leave it naming an older checkpoint. None when there is none."""
    if (path / COMPLETE).is_file():
        return path
    complete = complete_checkpoints(path)
    return complete[-1] if complete else None


def latest_text(root: Path) -> str:
    """Which checkpoint a stopped run can resume from, for error messages."""
    found = resolve(root)
    return f"the latest checkpoint is {found}" if found else "no checkpoint was written yet"


def find(path: Path) -> Path:
    """The checkpoint ``path`` names (itself or the newest under it), or a CheckpointError."""
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"checkpoint '{path}' is a file; give a checkpoint folder or a "
                              "run's checkpoints/ folder")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint folder '{path}' does not exist")
    found = resolve(path)
    if found is None:
        raise CheckpointError(f"checkpoint folder '{path}' holds no complete checkpoint")
    return found


def read_record(directory: Path) -> dict:
    """complete.json of a checkpoint, after checking that the files megatron and the resume
    need are there; one CheckpointError naming the file otherwise."""
    try:
        record = json.loads((directory / COMPLETE).read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"checkpoint '{directory}' is damaged: {COMPLETE} is not "
                              f"readable JSON ({weights.first_line(err)})") from None
    if not isinstance(record, dict) or not all(isinstance(record.get(k), int)
                                               for k in ("step", "world_size")):
        raise CheckpointError(f"checkpoint '{directory}' is damaged: {COMPLETE} lacks its "
                              "step and world_size")
    if not (directory / ".metadata").is_file():
        raise CheckpointError(f"checkpoint '{directory}' is damaged: its tensor index "
                              "(.metadata) is missing")
    missing = [f"rng/rank{r}.pt" for r in range(record["world_size"])
               if not (directory / "rng" / f"rank{r}.pt").is_file()]
    if missing:
        raise CheckpointError(f"checkpoint '{directory}' is damaged: {missing[0]} is missing "
                              f"({len(missing)} of {record['world_size']} RNG files)")
    return record


def position(record: dict, global_batch: int, seq_length: int) -> DataPosition:
    """The data position a checkpoint was saved at (older checkpoints: step x batch)."""
    if "position" in record:
        return DataPosition(**record["position"])
    return DataPosition().advance(record["step"], global_batch, seq_length)


def load(directory: Path, record: dict, chunks, optimizer, scheduler) -> None:
    """Restore everything saved by :func:`save` (``record``: its :func:`read_record`)."""
    prime_state(optimizer)
    state = weights.read(_sharded_state(chunks, optimizer, scheduler, 0, loading=True), directory)
    weights.put(chunks, state)
    check_schedule(scheduler, state["scheduler"])
    adopt_schedule(state["optimizer"], state["scheduler"], scheduler)
    load_state(optimizer, state["optimizer"])
    load_schedule(scheduler, state["scheduler"])
    if record["world_size"] == dist.get_world_size():  # RNG streams are per rank of a layout
        set_rng_state(read_rng_state(directory / "rng" / f"rank{dist.get_rank()}.pt"))


def weights_source(path: str, config: Config, extension: bool = False) -> Path:
    """The checkpoint ``path`` names (for eval, the unsharded tools and run.init_from), after
    checking that it holds ``config``'s model and was trained with its tokenizer.
    ``extension`` (run.init_from): the model may take longer sequences and another RoPE base
    (:func:`pretrain.run.identity.extension_fields`)."""
    found = find(Path(path))
    record = read_record(found)
    current = identity.model_identity(config)
    identity.check_model(record.get("model"), current, found,
                         identity.extension_fields(current) if extension else ())
    identity.check_tokenizer(record.get("tokenizer"), config, found)
    return found


def run_folder(checkpoint: Path) -> Path:
    """The folder results about ``checkpoint`` belong in: its run folder
    (RUN/checkpoints/step_N), else the folder holding it."""
    parent = checkpoint.resolve().parent
    return parent.parent if parent.name == "checkpoints" else parent
