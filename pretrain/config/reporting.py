"""[logging], [diagnostics], [eval] and [profiling]: what a run reports and measures, and their
rules."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

from model.config import coerce_choices, require
from pretrain.paths import require_folder
from runtime.errors import Findings

if TYPE_CHECKING:
    pass


class WandbMode(StrEnum):
    AUTO = "auto"  # online with credentials, else offline
    ONLINE = "online"
    OFFLINE = "offline"
    DISABLED = "disabled"


@dataclass
class LoggingConfig:
    """Weights & Biases; metrics always go to <run.dir>/metrics.jsonl as well."""

    wandb_mode: WandbMode = WandbMode.AUTO
    """online | offline | disabled | auto (WANDB_MODE if set, else online with credentials,
    else offline)."""
    project: str = ""
    """Empty: WANDB_PROJECT, else "siamesenorm". Likewise entity (WANDB_ENTITY), group
    (WANDB_RUN_GROUP) and name (WANDB_NAME, else the run folder's name): a value set here wins
    over W&B's own variable (pretrain/report/wandb_settings.py)."""
    entity: str = ""
    """W&B entity (user or team); empty: WANDB_ENTITY, else the account's default."""
    group: str = ""
    """W&B run group; empty: WANDB_RUN_GROUP, else none."""
    name: str = ""
    """W&B run name, also the title of the run's report; empty: WANDB_NAME, else the run
    folder's name."""
    peak_tflops: float = 0.0
    """The accelerator's dense bf16 peak TFLOP/s for MFU (0: known from the device name; no
    MFU is reported for a device not in pretrain.report.throughput.PEAK_TFLOPS)."""

    def __post_init__(self) -> None:
        coerce_choices("logging", self)


@dataclass
class DiagnosticsConfig:
    """Per-stream diagnostics (``pretrain/train/diagnostics.py``) to metrics.jsonl and W&B."""

    interval: int = 0
    """Every this many steps, log each block's stream RMS and the gradient norm reaching each
    stream, and the final merge's stream shares; loss spikes are checked every step (0: off,
    and no hook is ever registered)."""
    spike_factor: float = 1.3
    """A step whose loss exceeds this factor x the median of the last spike_window losses is
    logged as a loss-spike event."""
    spike_window: int = 50
    """Recent losses whose median a step's loss is compared with (spike_factor)."""


@dataclass
class EvalConfig:
    """Downstream tasks (lm-evaluation-harness) scored on the live model while it trains
    (``pretrain/train/downstream.py``), every rank taking part whatever the layout."""

    downstream_tasks: list[str] = field(default_factory=list)
    """lm-eval task names (its registry, or the YAML tasks of ``include_path``) scored by
    log-likelihood: multiple choice and perplexity tasks. Empty: none."""
    downstream_interval: int = 0
    """Score the tasks every this many steps and at the end (0: at the end only)."""
    downstream_limit: int = 100
    """At most this many documents per task each time (0: all), the first ones of the task's
    evaluation split, so every evaluation scores the same documents."""
    include_path: str = ""
    """A folder of local lm-eval task YAML files (a task over local files needs no network)."""
    num_fewshot: int = 0
    """Examples each prompt is given (lm-eval's --num_fewshot)."""


@dataclass
class ProfilingConfig:
    """A torch.profiler trace of chosen steps and a CUDA memory snapshot on out-of-memory,
    written to <run.dir>/profile (``pretrain/train/profiling.py``, docs/training.md)."""

    first_step: int = 0
    """The first step to trace, numbered as the console numbers steps (from 1); 0: no trace.
    Megatron-LM's --profile-step-start."""
    steps: int = 1
    """Steps traced from first_step on, into one Chrome-trace file per rank:
    <run.dir>/profile/rank<R>-step<FIRST>-<LAST>.pt.trace.json (Perfetto, TensorBoard)."""
    ranks: list[int] = field(default_factory=lambda: [0])
    """The global ranks that trace (Megatron-LM's --profile-ranks)."""
    record_shapes: bool = False
    """Record each operator's input shapes (torch.profiler's record_shapes)."""
    profile_memory: bool = False
    """Record each operator's allocations and frees (torch.profiler's profile_memory)."""
    with_stack: bool = False
    """Record the Python source line of each operator (torch.profiler's with_stack; larger
    traces, slower steps)."""
    memory_snapshot: bool = False
    """On a CUDA device, every rank records its allocator's history from the start
    (torch.cuda.memory._record_memory_history), and a step that runs out of memory writes it
    to <run.dir>/profile/rank<R>-oom-step<N>.pickle before the error ends the run (open it at
    https://pytorch.org/memory_viz). Costs a little time per allocation. Nothing on the CPU."""


def validate_eval(ev: EvalConfig, found: Findings) -> None:
    for name in ("downstream_interval", "downstream_limit", "num_fewshot"):
        value = getattr(ev, name)
        found.require(value >= 0, f"eval.{name} ({value}) must be >= 0")
    if ev.include_path:
        found.check(require_folder, ev.include_path, "eval.include_path")


def validate_profiling(p: ProfilingConfig, steps: int, world_size: int | None) -> None:
    require(p.first_step >= 0, f"profiling.first_step ({p.first_step}) must be >= 0 (0: no "
            "trace)")
    require(p.steps >= 1, f"profiling.steps ({p.steps}) must be >= 1")
    last = p.first_step + p.steps - 1
    require(not p.first_step or last <= steps, f"profiling.first_step + profiling.steps - 1 "
            f"({p.first_step} + {p.steps} - 1 = {last}) must be <= run.steps ({steps}): the "
            "traced steps must be steps of the run")
    require(not p.first_step or bool(p.ranks), "profiling.ranks ([]) must name at least one "
            "rank to trace with profiling.first_step set")
    for rank in p.ranks if p.first_step else ():
        require(rank >= 0, f"profiling.ranks entry {rank} must be >= 0 (a global rank)")
        require(world_size is None or rank < world_size, f"profiling.ranks entry {rank} must "
                f"be < the world size ({world_size})")
