"""Where a run starts, checked before a process group, a model or the run folder is touched.

A resume must be of the same model (always) on the same data (unless allowed: see
pretrain.run.identity), from a run folder whose config.toml was not edited behind the command's
back; ``run.init_from`` must hold the same model. All of it reads only small files, so a
mistake fails in seconds. Every other setting may change on resume (a lower optim.clip_grad,
another optim.beta2); what changed against the checkpoint's settings is returned, for the run
to print and record.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import NamedTuple

from pretrain.config import Config, changed_settings
from pretrain.data.checks import Data
from pretrain.data.position import START, DataPosition
from pretrain.hf import llama as hf_llama
from pretrain.optim import SCHEDULE_SETTINGS
from pretrain.run import checkpoint, identity
from runtime.errors import CheckpointError, ConfigError


class StartPoint(NamedTuple):
    """Where a run begins: the checkpoint it resumes (None: a fresh run), that checkpoint's
    record and the data position; the checkpoint whose weights a fresh run starts from
    (run.init_from), and this run's identity (pretrain.run.identity.run_identity)."""

    previous: Path | None
    record: dict
    position: DataPosition
    weights: Path | None
    identity: dict
    changes: dict = {}
    """On resume, each setting that differs from the checkpoint's: ``{"section.key": [old,
    new]}`` (empty for a checkpoint written before checkpoints recorded their settings)."""


def _config_edited(record: dict, run_dir: Path, config_path: str | None) -> str | None:
    """The complaint when RUN/config.toml was edited since the run wrote it while this command
    reads another file, so the edit would be silently ignored."""
    own = run_dir / "config.toml"
    saved = record.get("config_sha256")
    if saved is None or not own.is_file() or config_path is None:
        return None
    if Path(config_path).resolve() == own.resolve() or sha256(own) == saved:
        return None
    return (f"'{own}' was edited after the run wrote it, but this command reads --config "
            f"{config_path}; resume with `train --run.dir={run_dir}` (no --config) to use the "
            "edited file, or undo the edit")


def sha256(path: Path) -> str:
    """Content hash of a run-folder file (config.toml, recorded in each checkpoint)."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _init_source(path: str, config: Config) -> Path:
    """run.init_from: a megatron checkpoint of this model (or of it at a shorter
    seq_length and another RoPE base: a context extension), or a Hugging Face Llama folder
    whose config matches it (``pretrain.hf.llama``)."""
    if hf_llama.is_hf_folder(path):
        hf_llama.check(path, config.model)
        return Path(path)
    return checkpoint.weights_source(path, config, extension=True)


def check_start(config: Config, config_path: str | None, data: Data) -> StartPoint:
    """What this start resumes or loads, checked against the config before a tensor is read:
    the model and its tokenizer (always), the data (on resume; ``data``: as the data checks
    read it), edits of RUN/config.toml."""
    r, d = config.run, config.data
    run_dir = Path(r.dir)
    current = identity.run_identity(config, data.fingerprints)
    previous = checkpoint.resolve(run_dir / "checkpoints")
    if previous is None:
        weights = _init_source(r.init_from, config) if r.init_from else None
        return StartPoint(None, {}, START, weights, current)
    record = checkpoint.read_record(previous)
    try:
        identity.check_model(record.get("model"), current["model"], previous)
        identity.check_tokenizer(record.get("tokenizer"), config, previous)
        identity.check_data(record.get("data"), current["data"], r.allow_data_change, previous)
        identity.check_optimizer_layout(record.get("settings"), config, previous)
        identity.check_documents(record.get("settings"), config, previous)
    except CheckpointError as err:  # the folder may simply be another run's
        raise CheckpointError(f"{err} (run.dir '{run_dir}' holds a run this start would "
                              "resume; for a new run choose another --run.dir)") from None
    edited = _config_edited(record, run_dir, config_path)
    if edited:
        raise ConfigError(edited)
    position = checkpoint.position(record, d.global_batch_size, config.seq_length)
    changes = changed_settings(record["settings"], config.to_dict()) \
        if "settings" in record else {}
    _check_schedule(changes, config, run_dir, position.step)
    return StartPoint(previous, record, position, None, current, changes)


def _check_schedule(changes: dict, config: Config, run_dir: Path, step: int) -> None:
    """A start whose schedule differs from the checkpoint's is refused unless
    optim.override_schedule says to follow the new one. The refusal says first that the
    folder holds a run this start would resume: the usual cause is a new run pointed at an
    old run's folder, where taking the override would silently extend that run. (A
    checkpoint without recorded settings is checked when its schedule loads:
    ``pretrain.optim.check_schedule``.)"""
    if config.optim.override_schedule:
        return
    differ = {k: v for k, v in changes.items() if k in SCHEDULE_SETTINGS}
    if differ:
        shown = ", ".join(f"{key} {old} -> {new}" for key, (old, new) in differ.items())
        raise ConfigError(
            f"run.dir '{run_dir}' holds a run at step {step} that this start would resume, "
            f"with another schedule ({shown}); for a new run choose another --run.dir, or "
            "set --optim.override_schedule=true to continue that run on the new schedule")
