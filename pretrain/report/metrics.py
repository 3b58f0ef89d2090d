"""Metrics to ``<run.dir>/metrics.jsonl`` and Weights & Biases, from the rank holding the loss.

Only one rank logs: the first tensor- and data-parallel rank of the last pipeline stage, where
the loss lives. wandb is imported lazily, so a disabled run never touches it. A resumed run
reuses the W&B run id stored in the run folder and so continues the same W&B run, on one step
axis: W&B keeps one row per step and refuses steps below its last one, so steps trained a
second time (after a crash, the steps between the last checkpoint and the crash; after a
rollback, those since the checkpoint rolled back to) go to metrics.jsonl only, until the run
passes the last step W&B holds; a one-line notice says so.
metrics.jsonl is strict JSON: a non-finite value is written as null. Readers of metrics.jsonl
should take the last record of each step.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import uuid
from pathlib import Path

from megatron.core import parallel_state

from pretrain.config import Config, WandbMode
from pretrain.report.wandb_settings import RUN_FILE, wandb_settings, with_the_runs_project
from runtime.errors import ConfigError

log = logging.getLogger("pretrain")


def is_logging_rank() -> bool:
    return (parallel_state.is_pipeline_last_stage(ignore_virtual=True)
            and parallel_state.get_tensor_model_parallel_rank() == 0
            and parallel_state.get_data_parallel_rank() == 0
            and parallel_state.get_context_parallel_rank() == 0)


STEP = re.compile(rb'"step": (\d+)')


def last_step(path: Path) -> int:
    """The highest step a metrics.jsonl holds (-1: none), read without parsing each line."""
    if not path.is_file():
        return -1
    with path.open("rb") as f:
        return max((int(m.group(1)) for line in f if (m := STEP.search(line))), default=-1)


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
        self.wandb_high = -1
        """The highest step the W&B run holds."""
        self._held_back: int | None = None
        """The first step of the range being kept from W&B (None: none is)."""
        if not self.active:
            return
        w, warning = with_the_runs_project(wandb_settings(config), run_dir)
        log.info("%s", w.text())
        if warning and w.mode is not WandbMode.DISABLED:
            log.warning("%s", warning)
        if w.mode is WandbMode.DISABLED:
            return
        for var, sub in (("WANDB_CACHE_DIR", "cache"), ("WANDB_CONFIG_DIR", "config"),
                         ("WANDB_DATA_DIR", "data")):
            os.environ.setdefault(var, str(Path(w.dir.value) / "wandb" / sub))
        import wandb

        id_file = run_dir / "wandb_run_id"
        if id_file.is_file():  # the W&B run holds every step metrics.jsonl holds
            run_id = id_file.read_text().strip()
            self.wandb_high = last_step(self.path)
        else:
            run_id = uuid.uuid4().hex[:12]
        try:
            self.wandb_run = wandb.init(
                project=w.project.value, entity=w.entity.value or None,
                group=w.group.value or None, name=w.name.value, id=run_id, resume="allow",
                mode=w.mode.value, dir=w.dir.value, config={**config.to_dict(), **extra_config},
            )
        except Exception as err:  # the server went away after the start's check
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ConfigError(f"W&B could not start the run ({w.mode.value}): {first}; train "
                              "offline (--logging.wandb_mode=offline) and `wandb sync` later"
                              ) from None
        id_file.write_text(run_id)  # only once W&B holds the run it names
        (run_dir / RUN_FILE).write_text(json.dumps(
            {"id": run_id, "project": w.project.value, "entity": w.entity.value
             or getattr(self.wandb_run, "entity", "") or ""}) + "\n")
        log.info("W&B run %s (%s) in %s", run_id, w.mode.value, self.wandb_run.dir)

    def log(self, record: dict, wandb_only: dict | None = None) -> None:
        """``record`` to metrics.jsonl and W&B; ``wandb_only`` (many numbers a W&B chart
        reads well and a jsonl line does not, such as every expert's load) to W&B alone, in
        the same row."""
        if not self.active:
            return
        with self.path.open("a") as f:
            f.write(strict_json(record) + "\n")
        if self.wandb_run is not None and self._to_wandb(record["step"]):
            self.wandb_run.log({**{k: v for k, v in record.items() if k != "step"},
                                **(wandb_only or {})}, step=record["step"])

    def _to_wandb(self, step: int) -> bool:
        """Whether a record of ``step`` goes to W&B: a step above the last it holds, or that
        step again while this process is still on it (a rollback's record, diagnostics)."""
        if step > self.wandb_high or (step == self.wandb_high and self._held_back is None):
            if self._held_back is not None:
                self._held_back = None
            self.wandb_high = step
            return True
        if self._held_back is None:
            self._held_back = step
            log.info("W&B already holds steps up to %d: the steps trained again from %d on "
                     "go to metrics.jsonl only until step %d", self.wandb_high, step,
                     self.wandb_high + 1)
        return False

    def log_changes(self, step: int, changes: dict[str, list]) -> None:
        """Settings a resume changed (``{"section.key": [old, new]}``), from ``step`` on:
        a line of settings_changes.jsonl in the run folder, the W&B run's config (which then
        holds the values in force) and its summary (``settings_changes/<key>``: old -> new at
        step)."""
        if not self.active or not changes:
            return
        with (self.path.parent / "settings_changes.jsonl").open("a") as f:
            f.write(strict_json({"step": step, "changes": changes}) + "\n")
        if self.wandb_run is None:
            return
        sections: dict[str, dict] = {}
        for key, (_, new) in changes.items():
            section, _, name = key.partition(".")
            sections.setdefault(section, {})[name] = new
        for section, values in sections.items():
            merged = {**dict(self.wandb_run.config.get(section, {})), **values}
            self.wandb_run.config.update({section: merged}, allow_val_change=True)
        for key, (old, new) in changes.items():
            self.wandb_run.summary[f"settings_changes/{key}"] = \
                f"{json.dumps(old)} -> {json.dumps(new)} at step {step}"

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
