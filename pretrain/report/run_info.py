"""What a run is, for the report's title and config table: RUN/config.toml and versions.json,
with the settings its resumes changed (settings_changes.jsonl) applied.

config.toml is the config of the run's first start; a resume that changes settings (a run
extended with --run.steps and --optim.override_schedule) records each change, in order, in
settings_changes.jsonl, relative to the checkpoint it resumed. Applied in that order they give
the plan the run ended with, so a run extended from 40 to 50 steps shows 50 planned steps, and
40 as what applied until step 40. Read from that record rather than from the newest
config-resume-N.toml: a resume back to an earlier config writes no new file, and a copied run
folder keeps no reliable modification times.

Read as plain TOML and JSON rather than through ``pretrain.config``: the report describes the
run as it was written, also a run of an older version whose config the current loader would
refuse, and must not import torch. Either file may be missing (a run stopped before it wrote
them); what it would have told is then left out. A file that exists but cannot be parsed is
bad input, named in one line.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pretrain.report.series import SettingsChange
from runtime.errors import DataError

# The config fields the report's table shows, in this order, with their labels.
CONFIG_ROWS = (
    ("model.residual_scheme", "scheme"),
    ("model.num_layers", "blocks"),
    ("model.hidden_size", "hidden size"),
    ("model.num_attention_heads", "attention heads"),
    ("model.ffn_hidden_size", "FFN size"),
    ("model.seq_length", "sequence length"),
    ("model.vocab_size", "vocabulary"),
    ("data.global_batch_size", "global batch (sequences)"),
    ("data.micro_batch_size", "micro-batch (sequences)"),
    ("optim.lr", "peak LR"),
    ("optim.min_lr", "final LR"),
    ("optim.warmup_steps", "warm-up steps"),
    ("optim.weight_decay", "weight decay"),
    ("optim.clip_grad", "gradient clipping"),
    ("run.steps", "steps planned"),
    ("run.params_dtype", "parameter dtype"),
    ("parallel.tp", "tensor parallel"),
    ("parallel.pp", "pipeline parallel"),
)
VERSION_ROWS = (
    ("parameters", "parameters"), ("world_size", "world size"), ("device", "device"),
    ("git_commit", "commit"), ("torch", "torch"), ("megatron_core", "megatron-core"),
)


@dataclass
class RunInfo:
    """The run's name, and its config (as it ended) and versions as flat ``section.key``
    values; ``earlier``: for each setting a resume changed, the values it had before, each
    with the step it applied until."""

    name: str
    config: dict[str, object] = field(default_factory=dict)
    versions: dict[str, object] = field(default_factory=dict)
    earlier: dict[str, list[tuple[object, int]]] = field(default_factory=dict)

    def apply(self, changes: Sequence[SettingsChange]) -> None:
        """The settings each resume changed, in the order they were made: the config becomes
        the one the run ended with."""
        for change in changes:
            for key, (old, new) in change.changes.items():
                self.earlier.setdefault(key, []).append((old, change.step))
                if new is None:  # a setting unset again (config.toml leaves unset ones out)
                    self.config.pop(key, None)
                else:
                    self.config[key] = new

    def title(self) -> str:
        """``name: scheme, L x H (P parameters), commit abc1234``, from what is known."""
        parts = []
        scheme = self.config.get("model.residual_scheme")
        if scheme:
            parts.append(str(scheme))
        layers, hidden = self.config.get("model.num_layers"), self.config.get("model.hidden_size")
        if layers and hidden:
            size = f"{layers} x {hidden}"
            if isinstance(self.versions.get("parameters"), int):
                size += f" ({self.versions['parameters']:,} parameters)"
            parts.append(size)
        commit = self.versions.get("git_commit")
        if isinstance(commit, str) and commit and commit != "unknown":
            parts.append(f"commit {commit[:7]}")
        return f"{self.name}: {', '.join(parts)}" if parts else self.name

    def rows(self) -> list[tuple[str, str]]:
        """(label, value) of the config and versions the report's table shows; a setting a
        resume changed gives its earlier values too: ``50 (40 until step 40)``."""
        out = [(label, _text(self.config.get(key)) + self._before(key))
               for key, label in CONFIG_ROWS if key in self.config or key in self.earlier]
        out += [(label, _text(self.versions[key])) for key, label in VERSION_ROWS
                if key in self.versions]
        return out

    def _before(self, key: str) -> str:
        if key not in self.earlier:
            return ""
        return " (" + ", ".join(f"{_text(old)} until step {step}"
                                for old, step in self.earlier[key]) + ")"


def _text(value) -> str:
    if value is None:
        return "unset"
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10_000:
        return f"{value:,}"
    if isinstance(value, list):
        return ", ".join(str(v) for v in value)
    return str(value)


def _flat(sections: dict) -> dict[str, object]:
    return {f"{section}.{key}": value for section, table in sections.items()
            if isinstance(table, dict) for key, value in table.items()}


def read_run_info(run_dir: Path, changes: Sequence[SettingsChange] = ()) -> RunInfo:
    """The run's name (logging.name, else the folder's name), config and versions, with the
    settings ``changes`` (settings_changes.jsonl's lines) applied."""
    config_path, versions_path = run_dir / "config.toml", run_dir / "versions.json"
    config, versions = {}, {}
    if config_path.is_file():
        try:
            config = _flat(tomllib.loads(config_path.read_text()))
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as err:
            raise DataError(f"config file '{config_path}' cannot be read as TOML: {err}") \
                from None
    if versions_path.is_file():
        try:
            versions = json.loads(versions_path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise DataError(f"versions file '{versions_path}' cannot be read as JSON: {err}") \
                from None
        if not isinstance(versions, dict):
            raise DataError(f"versions file '{versions_path}' must hold a JSON object, got "
                            f"{type(versions).__name__}")
    name = config.get("logging.name") or run_dir.resolve().name
    info = RunInfo(str(name), config, versions)
    info.apply(changes)
    return info
