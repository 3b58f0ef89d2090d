"""The run configuration: one dataclass per concern, loaded from TOML, overridden from the CLI.

Precedence is command line > file > its ``base`` file(s) > defaults. ``--optim.lr=1e-3`` sets
``[optim] lr``. Unknown sections or keys, values of the wrong type and impossible combinations
fail at load time with one :class:`~runtime.errors.ConfigError` line naming the field, the rule
and the value.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import json
import math
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from model.config import ModelConfig, ParallelConfig, require, validate_layout
from pretrain.config.data import (  # noqa: F401
    VALID_SET_FORM,
    VALID_SET_NAME,
    DataConfig,
    ValidSet,
    missing_files,
    valid_sets,
    validate_data,
)
from pretrain.config.kernels import (  # noqa: F401
    CompileBackend,
    KernelsConfig,
    validate_compile,
)
from pretrain.config.optim import (  # noqa: F401
    MUON_FIELDS,
    DecayStyle,
    MuonAdjustLr,
    OptimConfig,
    OptimName,
    WsdDecayShape,
    validate_muon,
    validate_muon_layout,
    validate_optim,
)
from pretrain.config.reporting import (  # noqa: F401
    DiagnosticsConfig,
    EvalConfig,
    LoggingConfig,
    ProfilingConfig,
    WandbMode,
    validate_eval,
    validate_profiling,
)
from pretrain.config.run import (  # noqa: F401
    GuardAction,
    GuardConfig,
    ParamsDtype,
    RunConfig,
    validate_guard,
    validate_run,
)
from pretrain.paths import require_file
from runtime.errors import ConfigError, Findings


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    run: RunConfig = field(default_factory=RunConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    diagnostics: DiagnosticsConfig = field(default_factory=DiagnosticsConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)

    @property
    def seq_length(self) -> int:
        """Tokens per training sequence."""
        return self.data.seq_length or self.model.seq_length

    def to_dict(self) -> dict[str, Any]:
        return {s.name: _plain(dataclasses.asdict(getattr(self, s.name)))
                for s in dataclasses.fields(self)}


def _plain(values: dict) -> dict:
    return {k: (v.value if hasattr(v, "value") else v) for k, v in values.items()}


def _check_type(where: str, value: Any, annotation: Any) -> Any:
    """Return ``value`` if it fits ``annotation`` (ints widen to floats), else raise."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(annotation):
            if option is type(None) and value is None:
                return None
        options = [a for a in typing.get_args(annotation) if a is not type(None)]
        for option in options[1:]:  # a value that fits a later option is taken as it
            with contextlib.suppress(ConfigError):
                return _check_type(where, value, option)
        return _check_type(where, value, options[0])
    if origin is list:
        (item,) = typing.get_args(annotation)
        if isinstance(value, str):  # one string for a list field (a file's "a" or "a,b")
            value = _list_items(value, item)
        if not isinstance(value, list):
            raise ConfigError(f"{where} ({value!r}) must be a list")
        return [_check_type(f"{where}[{i}]", v, item) for i, v in enumerate(value)]
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(annotation, type) and issubclass(annotation, str) and isinstance(value, str):
        return value  # StrEnum fields are checked by their dataclass
    if annotation is int and isinstance(value, bool):
        raise ConfigError(f"{where} ({value!r}) must be an integer")
    if isinstance(annotation, type) and not isinstance(value, annotation):
        raise ConfigError(f"{where} ({value!r}) must be of type {annotation.__name__}")
    return value


# Keys that were settings once, with what replaced them: an old config (a run folder's
# config.toml) then says what to change, not only that the key is unknown.
RETIRED_KEYS = {
    "run.eval_iters": "every evaluation now covers the whole validation set; remove it and set "
                      "data.valid_samples (sequences, a multiple of data.global_batch_size; "
                      "0: no validation)",
    "model.hybrid_prenorm_first_block": "use model.hybrid_first_block (\"hybrid\" for false; "
                                        "\"prenorm\" is HybridNorm* as the official code "
                                        "computes it, not the gated block 0 of earlier "
                                        "versions)",
}


# Keys that moved, with their new place: an old config (a run folder's config.toml) still
# loads, its value taking the new key unless that is set too.
MOVED_KEYS = {"run.max_nonfinite_steps": "guard.max_skipped"}


def _move_keys(raw: dict[str, Any]) -> None:
    for old, new in MOVED_KEYS.items():
        old_section, old_key = old.split(".")
        new_section, new_key = new.split(".")
        values = raw.get(old_section)
        if isinstance(values, dict) and old_key in values:
            value = values.pop(old_key)
            raw.setdefault(new_section, {}).setdefault(new_key, value)


def _build_section(name: str, cls: type, values: dict[str, Any]):
    """The section ``name`` of class ``cls`` from its TOML values: every unknown or retired
    key and every value of the wrong type is reported; the choices (which the class checks) once
    those pass."""
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    checked = {}
    with Findings() as found:
        for key, value in values.items():
            if f"{name}.{key}" in RETIRED_KEYS:
                found.add(ConfigError(f"{name}.{key} ({value!r}) is no longer a setting: "
                                      f"{RETIRED_KEYS[f'{name}.{key}']}"))
            elif key not in known:
                found.add(ConfigError(f"unknown config key {name}.{key}"
                                      f"{_did_you_mean(key, known, name)}; known keys: "
                                      f"{', '.join(sorted(known))}"))
            else:
                try:
                    checked[key] = _check_type(f"{name}.{key}", value, hints[key])
                except ConfigError as err:
                    found.add(err)
    return cls(**checked)




def _did_you_mean(word: str, known, prefix: str = "") -> str:
    close = difflib.get_close_matches(word, sorted(known), n=1, cutoff=0.6)
    return f" (did you mean {prefix + '.' if prefix else ''}{close[0]}?)" if close else ""


def _field_type(section: str, name: str) -> Any:
    """The annotation of ``[section] name``, or None when there is no such field."""
    cls = typing.get_type_hints(Config).get(section)
    return typing.get_type_hints(cls).get(name) if cls is not None else None


def _parse_scalar(text: str) -> Any:
    """A command-line value: parsed as a TOML value when it is one, else kept as a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(raw: dict[str, dict], overrides: list[str]) -> dict[str, dict]:
    """Apply ``--section.key=value`` arguments to a raw (TOML-shaped) config dict.

    A later override of a key replaces an earlier one, except that items given to a list
    field one by one (``--data.prefixes=a --data.prefixes=b``, or ``a,b``) add up; a TOML list
    (``--data.prefixes='["a", "b"]'``) always replaces."""
    for section, values in raw.items():
        require(isinstance(values, dict), f"config section [{section}] must be a table "
                f"([{section}] with key = value lines), not {values!r}")
    raw = {k: dict(v) for k, v in raw.items()}
    adding: set[str] = set()  # list keys whose items are being given one by one
    for item in overrides:
        body = item[2:] if item.startswith("--") else item
        key, sep, value = body.partition("=")
        section, dot, name = key.partition(".")
        if not sep or not dot or not name or "." in name:
            raise ConfigError(f"override {item!r} must look like --section.key=value"
                              f"{_section_hint(key, value) if sep and not dot else ''}")
        parsed = _parse_scalar(value)
        annotation = _field_type(section, name)
        if typing.get_origin(annotation) is list and not isinstance(parsed, list):
            items = _list_items(str(value), typing.get_args(annotation)[0])
            parsed = raw[section][name] + items if key in adding else items
            adding.add(key)
        else:
            adding.discard(key)
        raw.setdefault(section, {})[name] = parsed
    return raw


def _section_hint(name: str, value: str) -> str:
    """For an override without its section (--lr=1e-3): the sections that have the key."""
    owners = [section for section, cls in typing.get_type_hints(Config).items()
              if name in {f.name for f in dataclasses.fields(cls)}]
    return "".join(f" (did you mean --{owner}.{name}={value}?)" for owner in owners[:1]) or \
        f" (sections: {', '.join(f.name for f in dataclasses.fields(Config))})"


def _list_items(text: str, item: type) -> list:
    """``a,b`` or ``[a, b]`` (unquoted) as list items, each parsed unless the list holds
    strings."""
    body = text[1:-1] if text.startswith("[") and text.endswith("]") else text
    parts = (p.strip().strip("'\"") for p in body.split(","))
    return [part if item is str else _parse_scalar(part) for part in parts if part]


def read_toml(path: Path, chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A config file with its ``base`` resolved: ``base = "other.toml"`` (a path relative to
    this file) loads that file first, then this file's keys replace its keys one by one, so
    presets share one recipe and state only what differs. Bases may have bases of their own."""
    require_file(path, f"config file '{chain[-1]}': base" if chain else "config file")
    if path.resolve() in chain:
        cycle = " -> ".join(str(p) for p in (*chain, path.resolve()))
        raise ConfigError(f"config file '{path}': base files form a cycle ({cycle})")
    try:
        raw = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"config file '{path}' is not valid TOML: {err}") from None
    base = raw.pop("base", None)
    if base is None:
        return raw
    if not isinstance(base, str):
        raise ConfigError(f"config file '{path}': base ({base!r}) must be a file name")
    merged = read_toml(path.parent / base, (*chain, path.resolve()))
    for section, values in raw.items():
        if isinstance(values, dict) and isinstance(merged.get(section), dict):
            merged[section] = {**merged[section], **values}
        else:
            merged[section] = values
    return merged


def load_config(path: str | None, overrides: list[str] = (), training: bool = True,
                world_size: int | None = None, reads_data: bool = False) -> Config:
    """The config of ``path`` with ``overrides``, validated here, once: ``training=False``
    (eval) leaves out the rules only a training run needs (its LR schedule); ``world_size``
    (the launch's, for a command that builds process groups) adds the data-parallel rules;
    ``reads_data`` (a command that reads the tokenizer and the data next: train, eval) names
    the missing ones too when the config is refused. Every mistake found is reported
    (:func:`validate`)."""
    raw = read_toml(Path(path)) if path is not None else {}
    raw = apply_overrides(raw, list(overrides))
    _move_keys(raw)
    sections = {f.name: f for f in dataclasses.fields(Config)}
    built = {}
    with Findings() as found:  # every section's unknown keys, types and choices at once
        for name, values in raw.items():
            if name not in sections:
                found.add(ConfigError(f"unknown config section [{name}]"
                                      f"{_did_you_mean(name, sections)}; known sections: "
                                      f"{', '.join(sections)}"))
                continue
            try:
                built[name] = _build_section(name, typing.get_type_hints(Config)[name], values)
            except ConfigError as err:
                found.add(err)
    config = Config(**built)
    validate(config, world_size=world_size, training=training, reads_data=reads_data)
    return config


def fit_layout(config: Config, world_size: int) -> tuple[Config, str | None]:
    """The layout an evaluation of ``config``'s checkpoint runs on with ``world_size``
    processes: its own when tensor x pipeline parallelism divides the world, else one model
    per process (TP = PP = 1, data parallel over all), with the line that says so. A
    checkpoint reshards on load, so every layout reads every checkpoint; only the
    checkpoint's own layout does not fit fewer processes. Validated for ``world_size``."""
    p = config.parallel
    note = None
    if world_size % p.replica or world_size % (p.expert_tp * p.ep * p.pp):
        experts = f" x parallel.ep {p.ep}" if p.ep > 1 else ""
        context = f" x parallel.cp {p.cp}" if p.cp > 1 else ""
        note = (f"the checkpoint's layout (parallel.tp {p.tp}{context} x parallel.pp "
                f"{p.pp}{experts}) does not fit {world_size} "
                f"process{'es' if world_size > 1 else ''}: evaluating with parallel.tp 1"
                f"{' and parallel.cp 1' if context else ''}"
                f"{' and parallel.ep 1' if experts else ''} and parallel.pp 1 (checkpoints "
                "reshard on load)")
        config = dataclasses.replace(config, parallel=dataclasses.replace(
            p, tp=1, pp=1, vp=None, cp=1, sequence_parallel=False, ep=1, etp=None))
    validate(config, world_size=world_size, training=False)
    return config, note




def _require_finite(config: Config, found: Findings) -> None:
    """Every float field of every section is a finite number (TOML and the command line both
    accept inf and nan)."""
    for section in dataclasses.fields(config):
        values = getattr(config, section.name)
        for item in dataclasses.fields(values):
            value = getattr(values, item.name)
            if isinstance(value, float):
                found.require(math.isfinite(value),
                              f"{section.name}.{item.name} ({value}) must be a finite number")


def validate(config: Config, world_size: int | None = None, training: bool = True,
             reads_data: bool = False) -> None:
    """Rules across sections; ``world_size`` adds the data-parallel rules; ``training``
    the optimizer's and LR schedule's (evaluation needs neither).

    Every rule runs, and every one broken is reported, one line each (a single one as the
    ConfigError it always was; several as :class:`~runtime.errors.ConfigErrors`). What stays
    sequential, because a rule reads what another checks: the finite numbers first (every
    rule compares numbers); inside each of the model's, the layout's, the guard's and the
    compile's groups of rules (``found.check``), the first failure ends that group; the
    schedule after run.steps, the validation set after the batch sizes, the data-parallel
    rules after the layout and the batch sizes, each only where those passed. With
    ``reads_data``, a refused config also names the tokenizer and data files it names that do
    not exist (:func:`missing_files`), which the command would refuse next."""
    with Findings() as found:
        _require_finite(config, found)
    with Findings() as found:
        layout = found.check(validate_layout, config.model, config.parallel)
        steps = validate_run(config.run, found)
        found.check(validate_guard, config.guard)
        if training:  # neither applies to eval or the unsharded tools, on any world size
            found.check(validate_profiling, config.profiling, config.run.steps, world_size)
            validate_optim(config.optim, config.run.steps if steps else None, found)
            validate_muon_layout(config, found)
        batches = validate_data(config, found)
        validate_eval(config.eval, found)
        found.check(validate_compile, config.kernels, config.parallel.recompute,
                    config.model.attention_backend)
        dg, lg = config.diagnostics, config.logging
        found.require(dg.interval >= 0, f"diagnostics.interval ({dg.interval}) must be >= 0")
        found.require(dg.spike_factor > 1,
                      f"diagnostics.spike_factor ({dg.spike_factor}) must be > 1")
        found.require(dg.spike_window >= 1,
                      f"diagnostics.spike_window ({dg.spike_window}) must be >= 1")
        found.require(math.isfinite(lg.peak_tflops) and lg.peak_tflops >= 0,
                      f"logging.peak_tflops ({lg.peak_tflops}) must be >= 0 (0: from the "
                      "device name)")
        if world_size is not None and layout and batches:
            _validate_world(config, world_size, found)
        if found.errors and reads_data:
            for error in missing_files(config):
                found.add(error)


def _validate_world(config: Config, world_size: int, found: Findings) -> None:
    """The data-parallel rules of ``world_size`` processes (a valid layout and batch sizes
    given). Whole model replicas first: the rest only where they pass (the expert groups'
    product shares pp and, by default, tp with the replica's: one cause, one line); the
    virtual pipeline's micro-batches only where a step is whole micro-batches."""
    p, d = config.parallel, config.data
    model_parallel = p.replica
    sizes = "parallel.tp x parallel.cp x parallel.pp" if p.cp > 1 else "parallel.tp x parallel.pp"
    if not found.require(world_size % model_parallel == 0,
                         f"world size ({world_size}) must be divisible by {sizes} "
                         f"({model_parallel})"):
        return
    expert_parallel = p.expert_tp * p.ep * p.pp
    # megatron lays its expert groups (etp x ep x pp, the rest expert data parallel) over
    # the same ranks as the dense ones and refuses a world they do not tile.
    found.require(world_size % expert_parallel == 0,
                  f"world size ({world_size}) must be divisible by parallel.etp x parallel.ep x "
                  f"parallel.pp ({p.expert_tp} x {p.ep} x {p.pp} = {expert_parallel})")
    dp = world_size // model_parallel
    step = d.micro_batch_size * dp
    whole = found.require(d.global_batch_size % step == 0,
                          f"data.global_batch_size ({d.global_batch_size}) must be divisible by "
                          f"data.micro_batch_size x data-parallel size ({d.micro_batch_size} x "
                          f"{dp})")
    if whole and p.vp is not None:
        micro = d.global_batch_size // step
        found.require(micro % p.pp == 0 and micro > p.pp,
                      f"micro-batches per step ({micro}) must be a multiple of parallel.pp "
                      f"({p.pp}) and larger than it with virtual pipelining")


def changed_settings(before: dict[str, dict], after: dict[str, dict]) -> dict[str, list]:
    """``{"section.key": [before, after]}`` for every setting both :meth:`Config.to_dict`
    results hold with different values. A key only one of them holds is a setting that was
    added or retired in between (an older checkpoint), not a change anyone made."""
    changes = {}
    for section in sorted(set(before) & set(after)):
        old, new = before[section], after[section]
        for key in sorted(set(old) & set(new)):
            if old[key] != new[key]:
                changes[f"{section}.{key}"] = [old[key], new[key]]
    return changes


def to_toml(config: Config) -> str:
    """The config as the TOML a run folder keeps (``config.toml``); unset fields left out."""
    lines = []
    for section, values in config.to_dict().items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            if value is not None:
                lines.append(f"{key} = {json.dumps(value)}")
        lines.append("")
    return "\n".join(lines)
