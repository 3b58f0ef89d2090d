"""The run folder: created and checked before training, holding config and versions.

    <run.dir>/config.toml       resolved config (config-resume-N.toml when a resume differs)
    <run.dir>/versions.json     python, torch, megatron-core, git commit, world size
    <run.dir>/metrics.jsonl     one JSON object per logged step (pretrain.report.metrics)
    <run.dir>/checkpoints/      pretrain.run.checkpoint
    <run.dir>/wandb/            W&B run files (offline runs sync with `wandb sync`)
"""

from __future__ import annotations

import json
import platform
import subprocess
from importlib import metadata
from pathlib import Path

import torch
import torch.distributed as dist

from pretrain.config import Config, WandbMode, to_toml
from pretrain.paths import require_writable
from pretrain.report.wandb_settings import wandb_settings
from runtime import device
from runtime.errors import ConfigError


def run_metadata(parameters: int) -> dict:
    def version(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent, check=False).stdout.strip()
    except OSError:
        commit = ""
    return {
        "python": platform.python_version(), "torch": torch.__version__,
        "megatron_core": version("megatron-core"), "git_commit": commit or "unknown",
        "world_size": dist.get_world_size(), "parameters": parameters,
        "device": device.device_name(),
    }


def check_writable(config: Config) -> None:
    """Every folder a training start writes (the run folder, its checkpoints, the data cache,
    W&B's folder) accepts new files: checked before anything is written, by the dry run too."""
    run_dir = Path(config.run.dir)
    folders = [(run_dir, "run.dir"), (run_dir / "checkpoints", "the checkpoint folder"),
               (Path(config.data.cache_dir) if config.data.cache_dir else run_dir / "data_cache",
                "data.cache_dir" if config.data.cache_dir else "the data cache")]
    w = wandb_settings(config)
    if w.mode is not WandbMode.DISABLED:
        folders.append((Path(w.dir.value) / "wandb", f"W&B's folder ({w.dir.source})"))
    for folder, what in folders:
        require_writable(folder, what)


def prepare_run_dir(run_dir: Path, config: Config, parameters: int, resuming: bool) -> None:
    """Create the folder (rank 0), fail clearly if it is not writable, record the config.

    ``config.toml`` is the config of the run that wrote the checkpoints: until a checkpoint
    exists (``resuming`` False), each start replaces it, so a start that failed early leaves
    nothing behind for the next start or for ``eval --config RUN/config.toml`` to trip over.
    A resume with another config keeps the history as ``config-resume-N.toml``."""
    if dist.get_rank() == 0:
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            probe = run_dir / ".write-probe"
            probe.write_text("ok")
            probe.unlink()
        except OSError as err:
            raise ConfigError(f"run.dir '{run_dir}' is not writable: {err.strerror}") from None
        text = to_toml(config)
        target = run_dir / "config.toml"
        if not resuming:
            for stale in run_dir.glob("config-resume-*.toml"):
                stale.unlink()
            target.write_text(text)
        index = 1
        while target.exists() and target.read_text() != text:
            target = run_dir / f"config-resume-{index}.toml"
            index += 1
        target.write_text(text)
        (run_dir / "versions.json").write_text(json.dumps(run_metadata(parameters), indent=2))
    dist.barrier()
