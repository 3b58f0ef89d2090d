"""Metrics to ``<run.dir>/metrics.jsonl`` and Weights & Biases, from the rank holding the loss.

Only one rank logs: the first tensor- and data-parallel rank of the last pipeline stage, where
the loss lives. wandb is imported lazily, so a disabled run never touches it. A resumed run
reuses the W&B run id stored in the run folder and so continues the same W&B run.
metrics.jsonl is strict JSON: a non-finite value is written as null. Readers of metrics.jsonl
should take the last record of each step: after a crash, the steps
between the last checkpoint and the crash are trained again and logged a second time.
"""

from __future__ import annotations

import json
import logging
import math
import netrc
import os
import uuid
from pathlib import Path

from megatron.core import parallel_state

from pretrain.config import Config, WandbMode
from runtime.errors import ConfigError

log = logging.getLogger("pretrain")


def is_logging_rank() -> bool:
    return (parallel_state.is_pipeline_last_stage(ignore_virtual=True)
            and parallel_state.get_tensor_model_parallel_rank() == 0
            and parallel_state.get_data_parallel_rank() == 0)


def _has_credentials() -> bool:
    """WANDB_API_KEY or a netrc entry for api.wandb.ai (what `wandb login` writes)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return bool(netrc.netrc().authenticators("api.wandb.ai"))
    except (OSError, netrc.NetrcParseError):
        return False


def resolve_wandb_mode(mode: WandbMode) -> WandbMode:
    """``auto`` means online when credentials exist (WANDB_API_KEY or a netrc entry)."""
    if mode is not WandbMode.AUTO:
        return mode
    return WandbMode.ONLINE if _has_credentials() else WandbMode.OFFLINE


def check_wandb(config: Config) -> None:
    """``online`` without credentials would stop the run at wandb.init, after the run folder
    was written, with wandb's own traceback; say it before anything starts."""
    if config.logging.wandb_mode is WandbMode.ONLINE and not _has_credentials():
        raise ConfigError("logging.wandb_mode ('online') needs W&B credentials: set "
                          "WANDB_API_KEY or run `wandb login`, or use offline (then "
                          "`wandb sync RUN/wandb/offline-run-*`) or auto")


def strict_json(record: dict) -> str:
    """One JSON line; NaN and Inf (a diverged loss) become null, which every JSON reader
    accepts (Python's default writes the non-standard bare NaN)."""
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
             for k, v in record.items()}
    return json.dumps(clean, allow_nan=False)


class MetricsLogger:
    def __init__(self, config: Config, run_dir: Path, extra_config: dict):
        self.active = is_logging_rank()
        self.path = run_dir / "metrics.jsonl"
        self.wandb_run = None
        if not self.active:
            return
        mode = resolve_wandb_mode(config.logging.wandb_mode)
        if mode is WandbMode.DISABLED:
            return
        for var, sub in (("WANDB_CACHE_DIR", "cache"), ("WANDB_CONFIG_DIR", "config"),
                         ("WANDB_DATA_DIR", "data")):
            os.environ.setdefault(var, str(run_dir / "wandb" / sub))
        import wandb

        id_file = run_dir / "wandb_run_id"
        run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:12]
        id_file.write_text(run_id)
        lg = config.logging
        self.wandb_run = wandb.init(
            project=lg.project, entity=lg.entity or None, group=lg.group or None,
            name=lg.name or run_dir.name, id=run_id, resume="allow", mode=mode,
            dir=str(run_dir), config={**config.to_dict(), **extra_config},
        )
        log.info("W&B run %s (%s) in %s", run_id, mode, self.wandb_run.dir)

    def log(self, record: dict) -> None:
        if not self.active:
            return
        with self.path.open("a") as f:
            f.write(strict_json(record) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in record.items() if k != "step"},
                               step=record["step"])

    def log_evaluation(self, name: str, step: int, values: dict[str, float]) -> None:
        """Scores computed after the run (lm-eval of a checkpoint) into the run's W&B run as
        ``<name>/<key>``, plotted against their own axis ``<name>/step``, the checkpoint's step:
        W&B drops rows whose step is below the run's last one, so they cannot use its step."""
        if self.wandb_run is None:
            return
        self.wandb_run.define_metric(f"{name}/step")
        self.wandb_run.define_metric(f"{name}/*", step_metric=f"{name}/step")
        self.wandb_run.log({f"{name}/step": step,
                            **{f"{name}/{key}": value for key, value in values.items()}})

    def finish(self) -> None:
        if self.wandb_run is not None:
            self.wandb_run.finish()
