"""[run] and [guard]: the run folder, steps, checkpoints, seeds and watchdogs; the spike guard;
and their rules."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

from model.config import coerce_choices, require
from pretrain.paths import require_creatable
from runtime.errors import Findings

if TYPE_CHECKING:
    pass


class ParamsDtype(StrEnum):
    AUTO = "auto"  # bf16 on a GPU, fp32 on the CPU
    FP32 = "fp32"
    BF16 = "bf16"


@dataclass
class RunConfig:
    """Length, evaluation, checkpointing and safety limits of one run."""

    dir: str = "runs/default"
    """The run folder: config, metrics, checkpoints (docs/run-folder.md). A start whose
    run folder holds a checkpoint resumes from the newest one."""
    steps: int = 100
    """Optimizer steps the run trains; the learning-rate schedule ends here. Raise it on a
    resume (with optim.override_schedule) to extend a run."""
    seed: int = 1234
    """Seeds the initial weights (each drawn from the seed and its name, the same under every
    parallel layout), the order of the training samples and dropout."""
    log_interval: int = 1
    """Every this many steps (and at the last), a record to metrics.jsonl and W&B, the
    stragglers' measurement and, off a terminal, one progress line."""
    eval_interval: int = 50
    """Validate every this many steps (and at the start and the end), on the whole validation
    set (data.valid_samples)."""
    save_interval: int = 0
    """Checkpoint every this many steps (0: only at the end and on a signal)."""
    keep_last: int = 2
    """Checkpoints to keep; older complete ones are deleted."""
    async_save: bool = False
    """Write checkpoints in the background (megatron-core's async save): a save blocks
    training only while the state is taken off the training path (copied from the GPU; on a
    CPU the writer is a forked process, whose pages keep the saved state), and the checkpoint
    counts once every rank's write ended and it is complete, about the step its write ends.
    The next save and the end of the run wait for it; a failed write stops the run as a
    failed save does. Costs host memory of up to one more copy of the state while it writes
    (pretrain/run/saver.py)."""
    allow_data_change: bool = False
    """Resume even though the data differs from the checkpoint's (other prefixes or weights,
    split, seed, global batch or sequence length): the run continues from the checkpoint's
    data position (samples and tokens consumed) on the new data. Otherwise such a resume is
    refused, naming what changed."""
    init_from: str = ""
    """Start a new run from the model weights of this checkpoint (fresh optimizer, step 0):
    a checkpoint of this framework, or a Hugging Face Llama folder (config.json +
    safetensors) for a ``pre`` model of the same shape. Ignored when the run folder already
    holds a checkpoint to resume from."""
    params_dtype: ParamsDtype = ParamsDtype.AUTO
    """auto (bf16 on GPU, fp32 on CPU), fp32 or bf16."""
    deterministic: bool = False
    """Bit-reproducible GPU kernels (cuBLAS, NCCL, SDPA backward; see runtime.device), so the
    same command, or a resume, gives identical losses on a GPU too. Costs some throughput."""
    hang_timeout: float = 1800.0
    """Seconds a rank may make no progress before it writes the Python stacks of all its
    threads to <run.dir>/hangs/rank<r>-<time>.txt and exits with status 4, so the job can be
    restarted from its latest checkpoint (0: off; pretrain/train/watchdog.py). The limit for
    start-up, validation, saves and the first 10 steps; after those a step may take 10 x the
    median step time, at least 300 s, never more than this."""
    straggler_ratio: float = 1.5
    """Every run.log_interval steps the slowest rank's step time and its ratio to the median
    rank's are logged (step_time_max, slowest_rank, slowest_ratio); a ratio above this is
    also a console warning (pretrain/train/stragglers.py)."""

    def __post_init__(self) -> None:
        coerce_choices("run", self)


class GuardAction(StrEnum):
    STOP = "stop"  # end the run (exit 3) naming the latest checkpoint
    ROLLBACK = "rollback"  # reload the latest checkpoint and skip the batches after it


@dataclass
class GuardConfig:
    """What a bad step does (``pretrain/train/guard.py``). A step with a NaN/Inf loss or
    gradient never updates the weights; with ``spikes`` neither does an outlier step. Skipped
    steps are counted and logged; ``max_skipped`` of them in a row trigger ``action``."""

    spikes: bool = False
    """Skip the update of a step whose loss or gradient norm exceeds the mean of the last
    ``window`` updated steps by more than ``sigma`` standard deviations (OLMo-core's rule)."""
    window: int = 128
    """Updated steps whose loss and gradient norm the spike rule compares against."""
    sigma: float = 6.0
    """Standard deviations above the window's mean that make a step a spike."""
    warmup: int = 64
    """Updated steps the window must hold before the spike rule judges (the first steps of a
    run move fast and would all look like outliers)."""
    max_skipped: int = 3
    """Skipped steps in a row (spikes or NaN/Inf) that trigger ``action``."""
    action: GuardAction = GuardAction.STOP
    """stop: end the run naming its latest checkpoint; rollback: reload the latest checkpoint
    and skip the ``rollback_skip_batches`` batches that follow it (PaLM's recipe)."""
    rollback_skip_batches: int = 100
    """Global batches a rollback skips after the checkpoint it reloads."""
    max_rollbacks: int = 3
    """Rollbacks one run may make (checkpointed with the run); one more stops it."""

    def __post_init__(self) -> None:
        coerce_choices("guard", self)


def validate_run(r: RunConfig, found: Findings) -> bool:
    """run's own ranges; whether run.steps is a step count the schedule can be checked with."""
    steps = found.require(r.steps >= 1, f"run.steps ({r.steps}) must be >= 1")
    for name in ("log_interval", "eval_interval", "keep_last"):
        value = getattr(r, name)
        found.require(value >= 1, f"run.{name} ({value}) must be >= 1")
    found.require(0 <= r.seed < 2**31, f"run.seed ({r.seed}) must be in [0, 2**31)")
    found.check(require_creatable, r.dir, "run.dir")
    found.require(r.save_interval >= 0, f"run.save_interval ({r.save_interval}) must be >= 0")
    found.require(r.hang_timeout >= 0,
                  f"run.hang_timeout ({r.hang_timeout}) must be >= 0 seconds (0: no watchdog)")
    found.require(r.straggler_ratio > 1,
                  f"run.straggler_ratio ({r.straggler_ratio}) must be > 1")
    return steps


def validate_guard(g: GuardConfig) -> None:
    for name in ("window", "max_skipped", "rollback_skip_batches"):
        value = getattr(g, name)
        require(value >= 1, f"guard.{name} ({value}) must be >= 1")
    require(g.sigma > 0, f"guard.sigma ({g.sigma}) must be > 0")
    require(2 <= g.warmup <= g.window, f"guard.warmup ({g.warmup}) must be in [2, guard.window "
            f"({g.window})]: the spike rule needs a mean and a standard deviation")
    require(g.max_rollbacks >= 0, f"guard.max_rollbacks ({g.max_rollbacks}) must be >= 0")
