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
import re
import tomllib
import types
import typing
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, NamedTuple

from kernels.backend import NormBackend
from model.backends import TransformerImpl
from model.config import ModelConfig, ParallelConfig, coerce_choices, require, validate_layout
from pretrain.paths import require_creatable, require_file, require_folder
from runtime.errors import ConfigError, DataError, Findings, UserError


class CompileBackend(StrEnum):
    INDUCTOR = "inductor"  # generated kernels
    AOT_EAGER = "aot_eager"  # Dynamo and AOTAutograd's capture, run by eager torch
    EAGER = "eager"  # Dynamo's capture only


class ParamsDtype(StrEnum):
    AUTO = "auto"  # bf16 on a GPU, fp32 on the CPU
    FP32 = "fp32"
    BF16 = "bf16"


class WandbMode(StrEnum):
    AUTO = "auto"  # online with credentials, else offline
    ONLINE = "online"
    OFFLINE = "offline"
    DISABLED = "disabled"


class DecayStyle(StrEnum):
    COSINE = "cosine"
    LINEAR = "linear"
    CONSTANT = "constant"
    WSD = "wsd"  # warm-up, stable, decay


class WsdDecayShape(StrEnum):
    LINEAR = "linear"
    COSINE = "cosine"
    MINUS_SQRT = "minus_sqrt"


class OptimName(StrEnum):
    ADAMW = "adamw"
    MUON = "muon"  # Muon for the blocks' linear weights, AdamW for every other parameter


class MuonAdjustLr(StrEnum):
    """torch.optim.Muon's ``adjust_lr_fn``: how a matrix's shape scales its learning rate."""

    MATCH_RMS_ADAMW = "match_rms_adamw"  # 0.2 sqrt(max(rows, cols)): AdamW's update RMS
    ORIGINAL = "original"  # sqrt(max(1, rows / cols)), Keller Jordan's


@dataclass
class OptimConfig:
    """AdamW (or Muon for the blocks' linear weights) with linear warm-up from 0 to ``lr``,
    then a decay to ``min_lr`` at run.steps."""

    name: OptimName = OptimName.ADAMW
    """The optimizer: adamw for every parameter, or muon: torch.optim.Muon for the blocks'
    attention and MLP linear weights and AdamW (this section's other fields) for the rest
    (embeddings, output layer, norms, biases, gates, scalars, a scheme's own matrices);
    docs/training.md#muon."""
    lr: float = 3e-4
    """Peak learning rate, reached at the end of the warm-up."""
    min_lr: float = 3e-5
    """Learning rate at run.steps, the end of the decay (constant decay_style: unused)."""
    warmup_steps: int = 10
    """Steps of the linear warm-up from 0 to lr."""
    decay_style: DecayStyle = DecayStyle.COSINE
    """How the learning rate falls from lr to min_lr between the warm-up and run.steps:
    cosine, linear, constant (stays at lr), or wsd (warm-up, stable at lr, then a decay over
    the last wsd_decay_steps steps)."""
    wsd_decay_steps: int = 0
    """decay_style wsd: the steps of the final decay to min_lr, ending at run.steps (> 0 and
    at most run.steps - warmup_steps). A run that may be extended keeps its stable phase:
    resume with more run.steps before the decay begins."""
    wsd_decay_shape: WsdDecayShape = WsdDecayShape.LINEAR
    """decay_style wsd: the shape of the final decay: linear, cosine, or minus_sqrt
    (1 - sqrt(fraction of the decay done))."""
    weight_decay: float = 0.1
    """AdamW's decoupled weight decay, constant over the run, on weight matrices only (linear
    layers, embeddings, a scheme's projections): norms, biases, gates, learned scalars and
    mixing coefficients get none (each parameter's role, model/decay.py)."""
    beta1: float = 0.9
    """Adam's decay rate of the gradient's running mean (first moment)."""
    beta2: float = 0.95
    """Adam's decay rate of the squared gradient's running mean (second moment)."""
    eps: float = 1e-8
    """Added to the square root of the second moment in Adam's denominator."""
    clip_grad: float = 1.0
    """Clip the global gradient norm to this value (0 disables clipping)."""
    fused: bool = True
    """Without TE or apex: step with torch's fused AdamW kernel and multi-tensor gradient
    norm/clip/copy (pretrain/optim.py); false keeps megatron's torch fallback as it is. With
    TE or apex megatron uses their fused Adam either way."""
    override_schedule: bool = False
    """On resume, follow this config's schedule (lr, min_lr, warmup_steps, decay_style, the
    wsd fields, weight_decay, muon_lr, muon_weight_decay, run.steps) where it differs from the
    checkpoint's, keeping the optimizer's moments; otherwise a difference is an error naming
    the field."""
    muon_lr: float = 0.0
    """name muon: the Muon matrices' peak learning rate (0: lr). It follows the same warm-up
    and decay, ending at muon_lr x min_lr / lr. With muon_adjust_lr_fn match_rms_adamw the
    default (AdamW's lr) is the intended one."""
    muon_weight_decay: float = 0.1
    """name muon: the Muon matrices' decoupled weight decay (torch.optim.Muon multiplies a
    weight by 1 - lr x weight_decay each step), constant over the run."""
    muon_momentum: float = 0.95
    """name muon: the decay rate of Muon's momentum buffer, in [0, 1)."""
    muon_nesterov: bool = True
    """name muon: orthogonalise the Nesterov look-ahead of the momentum instead of the momentum
    itself."""
    muon_ns_steps: int = 5
    """name muon: Newton-Schulz iterations that orthogonalise each update, in [1, 99]."""
    muon_adjust_lr_fn: MuonAdjustLr = MuonAdjustLr.MATCH_RMS_ADAMW
    """name muon: torch.optim.Muon's learning-rate adjustment by a matrix's shape (rows x
    cols). match_rms_adamw (0.2 sqrt(max(rows, cols)), from "Muon is Scalable for LLM
    Training") gives the orthogonalised update the RMS of a typical AdamW update, so AdamW's
    learning rate and weight decay carry over: the default, since this framework's presets are
    tuned for AdamW and muon_lr defaults to lr. original (sqrt(max(1, rows / cols)), Keller
    Jordan's) wants a learning rate some 10-50x AdamW's."""

    def __post_init__(self) -> None:
        coerce_choices("optim", self)


@dataclass
class DataConfig:
    """Megatron indexed datasets (``prefix.bin`` / ``prefix.idx``) and how batches are cut."""

    prefixes: list[str] = field(default_factory=list)
    """Dataset prefixes; several are blended by ``weights``."""
    weights: list[float] = field(default_factory=list)
    """Blend weights, one per prefix (default: equal)."""
    tokenizer: str = ""
    """The tokenizer the datasets were tokenised with: a sentencepiece .model file, or a Hugging
    Face tokenizer.json (or a folder holding one, e.g. GPT-NeoX-20B's)."""
    split: str = "98,2,0"
    """train,valid,test split of each dataset's documents."""
    seq_length: int = 0
    """Tokens per training sequence (0: model.seq_length, the longest the model accepts)."""
    micro_batch_size: int = 4
    """Sequences one forward and backward pass takes on each data-parallel rank; a step
    accumulates global_batch_size / (micro_batch_size x data-parallel size) of them. Sets
    activation memory, not the training result."""
    global_batch_size: int = 8
    """Sequences per optimizer step (micro-batches are accumulated to reach it)."""
    cache_dir: str = ""
    """Where megatron caches its sample indices (default: <run.dir>/data_cache)."""
    valid_samples: int = 1024
    """Sequences in the validation set: the first valid_samples samples of the validation
    split in megatron's seeded order. Every evaluation (during training and ``eval``) covers
    all of them, in batches of global_batch_size (so it must be a multiple of it), so a
    checkpoint evaluates to the same number whatever run.steps or run.eval_interval. The
    validation split must hold them without repeating one (refused otherwise: a repeated
    sample would count twice). 0: no validation during training."""
    valid_sets: list[str] = field(default_factory=list)
    """Further validation sets, each ``NAME=PREFIX[:SAMPLES]`` (``"wiki=data/wiki:256"``):
    every document of the Megatron dataset PREFIX is held out, and every evaluation (during
    training and ``eval``) also reports the loss over its first SAMPLES sequences (default
    valid_samples; a multiple of global_batch_size) as val/NAME/loss, val/NAME/ppl and
    val/NAME/samples, next to the default set's val_loss. NAME: letters, digits, _ and -,
    each used once. A set must be tokenised with ``tokenizer`` and hold SAMPLES sequences
    without repeating one. Not part of a checkpoint's data identity (it changes no training
    sample), so a resume may add or drop sets."""
    document_attention: bool = False
    """Each token attends only to the earlier tokens of its own document: documents end at the
    tokenizer's end-of-document token, which belongs to the document it ends (Megatron-LM's
    --reset-attention-mask). Off: every token attends to every earlier token of its sequence,
    across documents, as in the paper's runs. Needs attention_backend sdpa or local (auto
    picks sdpa): SDPA with the exact mask on the CPU, flex attention on CUDA."""
    reset_position_ids: bool = False
    """Positions restart at 0 after each end-of-document token (--reset-position-ids). With
    RoPE and document_attention it changes nothing (a document sees only distances within
    itself); it matters with learned positions, or without document_attention."""
    eod_mask_loss: bool = False
    """No loss where the input is an end-of-document token (--eod-mask-loss): the next
    document's first token is not predicted from the end of the one before."""

    def __post_init__(self) -> None:
        # Megatron-LM's weighted form, ["0.3", "data/a", "0.7", "data/b"], as its users write
        # it: split into prefixes and weights.
        pairs = self.prefixes
        if (not self.weights and len(pairs) >= 2 and len(pairs) % 2 == 0
                and all(_is_weight(w) for w in pairs[::2])):
            self.weights = [float(w) for w in pairs[::2]]
            self.prefixes = list(pairs[1::2])


VALID_SET_NAME = re.compile(r"[A-Za-z0-9_-]+")
VALID_SET_FORM = "NAME=PREFIX[:SAMPLES], e.g. 'wiki=data/wiki_text_document:256'"


class ValidSet(NamedTuple):
    """One further validation set of data.valid_sets: its metrics are val/<name>/*."""

    name: str
    prefix: str
    samples: int


def valid_sets(data: DataConfig) -> list[ValidSet]:
    """data.valid_sets parsed; a malformed entry, a bad name or sample count, or a name used
    twice is one ConfigError line naming the entry, each entry's its own. Whether each prefix
    exists and holds its samples is checked with the data (pretrain.data.checks.check_data)."""
    sets: list[ValidSet] = []
    with Findings() as found:
        for entry in data.valid_sets:
            try:
                one = _valid_set(entry, data)
            except ConfigError as err:
                found.add(err)
                continue
            if found.require(one.name not in {s.name for s in sets}, f"data.valid_sets names "
                             f"{one.name!r} twice: each set needs its own name (its metrics "
                             "are val/NAME/loss)"):
                sets.append(one)
    return sets


def _entry_parts(entry: str) -> tuple[str, str, str, bool]:
    """NAME, PREFIX and SAMPLES ("" when not given) of a data.valid_sets entry, as written,
    and whether it has its '='."""
    name, equals, rest = (part.strip() for part in entry.partition("="))
    head, colon, tail = rest.rpartition(":")
    prefix, count = (head.strip(), tail.strip()) if colon and "/" not in tail else (rest, "")
    return name, prefix, count, bool(equals)


def _valid_set(entry: str, d: DataConfig) -> ValidSet:
    where = f"data.valid_sets entry {entry!r}"
    name, prefix, count, equals = _entry_parts(entry)
    require(bool(equals and prefix), f"{where} must look like {VALID_SET_FORM}")
    require(VALID_SET_NAME.fullmatch(name) is not None, f"{where}: NAME ({name!r}) must be "
            "letters, digits, _ or - (it names the metrics val/NAME/loss)")
    require(not prefix.endswith((".bin", ".idx")), f"{where} names a file; give the dataset "
            f"prefix without .bin/.idx ('{prefix[:-4]}')")
    if not count:
        require(d.valid_samples > 0, f"{where} gives no SAMPLES and data.valid_samples is 0: "
                f"give its size ({name}={prefix}:SAMPLES)")
        return ValidSet(name, prefix, d.valid_samples)
    require(count.lstrip("-").isdigit(), f"{where}: SAMPLES ({count!r}) must be an integer")
    samples = int(count)
    require(samples > 0, f"{where}: SAMPLES ({samples}) must be > 0")
    require(samples % d.global_batch_size == 0, f"{where}: SAMPLES ({samples}) must be a "
            f"multiple of data.global_batch_size ({d.global_batch_size}): an evaluation is "
            "whole batches")
    return ValidSet(name, prefix, samples)


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
class KernelsConfig:
    """Which implementation computes the norms (``kernels/backend.py``), resolved once when the
    model is built."""

    norm_backend: NormBackend = NormBackend.AUTO
    """auto | torch | triton | te. auto: the fused Triton kernels on a CUDA machine with Triton,
    else the torch reference."""
    compile: bool = False
    """Compile each transformer block with torch.compile (model/compiled.py): blocks of one
    class share their compiled code, the schedules, recompute wrappers, embedding and loss stay
    eager. Compilation happens in the first step, which the console reports with its
    seconds; later starts load it from compile_cache. Off by default until a GPU run has timed
    it; the CPU demo's config turns it on, where it pays for itself (docs/compile.md).
    generate, lm-eval and export-hf run eager whatever this says."""
    compile_backend: CompileBackend = CompileBackend.INDUCTOR
    """With compile: inductor (generated code), or aot_eager / eager (Dynamo's capture only,
    no code generation: for checking graph breaks and recompiles quickly)."""
    compile_cache: str = ""
    """With compile: the folder of inductor's and Triton's compiled artifacts, read and
    written by every rank, so a restart or resume reuses them; a folder every node sees lets
    a multi-node run share them ("": <run.dir>/compile_cache). Where its filesystem refuses
    flock, which inductor's cache locks need, a node-local folder in TMPDIR instead, said at
    the start (docs/run-folder.md)."""
    cuda_graphs: bool = False
    """With compile and the inductor backend on a CUDA device: capture each compiled block's
    kernels as CUDA graphs (inductor's cudagraph trees, torch.compile's reduce-overhead),
    replayed every step to cut kernel-launch overhead. Refused without CUDA. Untested on a
    GPU so far (docs/compile.md)."""

    def __post_init__(self) -> None:
        coerce_choices("kernels", self)


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


def _is_weight(text: str) -> bool:
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


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
    if world_size % (p.tp * p.pp) or world_size % (p.expert_tp * p.ep * p.pp):
        experts = f" x parallel.ep {p.ep}" if p.ep > 1 else ""
        note = (f"the checkpoint's layout (parallel.tp {p.tp} x parallel.pp {p.pp}{experts}) "
                f"does not fit {world_size} process{'es' if world_size > 1 else ''}: "
                f"evaluating with parallel.tp 1{' and parallel.ep 1' if experts else ''} and "
                "parallel.pp 1 (checkpoints reshard on load)")
        config = dataclasses.replace(config, parallel=dataclasses.replace(
            p, tp=1, pp=1, vp=None, sequence_parallel=False, ep=1, etp=None))
    validate(config, world_size=world_size, training=False)
    return config, note


FP32_MAX = 3.4028234663852886e38


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
        steps = _validate_run(config.run, found)
        found.check(_validate_guard, config.guard)
        if training:  # neither applies to eval or the unsharded tools, on any world size
            found.check(_validate_profiling, config.profiling, config.run.steps, world_size)
            _validate_optim(config.optim, config.run.steps if steps else None, found)
            _validate_muon_layout(config, found)
        batches = _validate_data(config, found)
        _validate_eval(config.eval, found)
        found.check(_validate_compile, config.kernels, config.parallel.recompute,
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


def _validate_run(r: RunConfig, found: Findings) -> bool:
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


def _validate_optim(o: OptimConfig, steps: int | None, found: Findings) -> None:
    """The optimizer's and the schedule's rules; the schedule's only with a valid run.steps
    (``steps``), min_lr only with a valid lr, the first step's size only with both lr and
    beta1 valid."""
    lr = found.require(o.lr > 0, f"optim.lr ({o.lr}) must be > 0")
    if lr:
        found.require(0 <= o.min_lr <= o.lr,
                      f"optim.min_lr ({o.min_lr}) must be in [0, optim.lr]")
    if steps is not None and found.require(
            0 <= o.warmup_steps < steps, f"optim.warmup_steps ({o.warmup_steps}) must be >= 0 "
            f"and < run.steps ({steps})"):
        if o.decay_style is DecayStyle.WSD:
            decaying = steps - o.warmup_steps
            found.require(0 < o.wsd_decay_steps <= decaying, f"optim.wsd_decay_steps "
                          f"({o.wsd_decay_steps}) must be in [1, run.steps - "
                          f"optim.warmup_steps = {decaying}] with optim.decay_style wsd")
    if o.decay_style is not DecayStyle.WSD:
        found.require(o.wsd_decay_steps == 0, f"optim.wsd_decay_steps ({o.wsd_decay_steps}) "
                      f"applies only to optim.decay_style wsd, not {o.decay_style}; set it to 0")
    found.require(o.clip_grad >= 0, f"optim.clip_grad ({o.clip_grad}) must be >= 0")
    found.require(o.weight_decay >= 0, f"optim.weight_decay ({o.weight_decay}) must be >= 0")
    found.require(o.eps > 0, f"optim.eps ({o.eps}) must be > 0")
    betas = [found.require(0 <= getattr(o, name) < 1,
                           f"optim.{name} ({getattr(o, name)}) must be in [0, 1)")
             for name in ("beta1", "beta2")]
    if lr and betas[0]:
        first_step = o.lr / (1 - o.beta1)  # Adam's bias-corrected step size at step 1
        found.require(first_step < FP32_MAX, f"optim.lr ({o.lr}) / (1 - optim.beta1) must be "
                      f"< {FP32_MAX:.3g} (the largest fp32 number; the optimizer's first step)")
    _validate_muon(o, found)


MUON_FIELDS = ("muon_lr", "muon_weight_decay", "muon_momentum", "muon_nesterov",
               "muon_ns_steps", "muon_adjust_lr_fn")
"""The optim fields that apply only to optim.name muon."""


def _validate_muon(o: OptimConfig, found: Findings) -> None:
    """Muon's ranges with optim.name muon; with adamw, a Muon field set away from its default
    (it would be silently ignored)."""
    if o.name is not OptimName.MUON:
        defaults = OptimConfig()
        for name in MUON_FIELDS:
            value = getattr(o, name)
            found.require(value == getattr(defaults, name),
                          f"optim.{name} ({value}) applies only to optim.name muon, not "
                          f"{o.name}; set --optim.name=muon or remove it")
        return
    found.require(o.muon_lr >= 0, f"optim.muon_lr ({o.muon_lr}) must be >= 0 (0: optim.lr)")
    found.require(o.muon_weight_decay >= 0,
                  f"optim.muon_weight_decay ({o.muon_weight_decay}) must be >= 0")
    found.require(0 <= o.muon_momentum < 1,
                  f"optim.muon_momentum ({o.muon_momentum}) must be in [0, 1)")
    found.require(1 <= o.muon_ns_steps < 100,
                  f"optim.muon_ns_steps ({o.muon_ns_steps}) must be in [1, 99]")


def _validate_muon_layout(config: Config, found: Findings) -> None:
    """What Muon does not support yet (docs/limits.md): routed experts on Transformer Engine's
    grouped GEMM, whose per-expert weights are not the block linears Muon steps (they would
    silently stay with AdamW). With ``auto`` the build refuses them where TE is chosen."""
    if config.optim.name is not OptimName.MUON or not config.model.num_experts:
        return
    found.require(config.model.transformer_impl is not TransformerImpl.TE,
                  "optim.name muon does not step the routed experts of "
                  "model.transformer_impl te (Transformer Engine's grouped GEMM) yet: set "
                  "--model.transformer_impl=local")


def _validate_data(config: Config, found: Findings) -> bool:
    """data's rules; whether both batch sizes are >= 1 (the validation sets' rules, and the
    data-parallel ones, divide by them and run only then)."""
    d = config.data
    if d.cache_dir:
        found.check(require_creatable, d.cache_dir, "data.cache_dir")
    for prefix in d.prefixes:
        found.require(not prefix.endswith((".bin", ".idx")),
                      f"data.prefixes entry '{prefix}' names a file; give the dataset prefix "
                      f"without .bin/.idx ('{prefix[:-4]}')")
    batches = all([found.require(getattr(d, name) >= 1,
                                 f"data.{name} ({getattr(d, name)}) must be >= 1")
                   for name in ("micro_batch_size", "global_batch_size")])
    if found.require(d.valid_samples >= 0, f"data.valid_samples ({d.valid_samples}) must be "
                     ">= 0 (0: no validation)") and batches:
        found.require(d.valid_samples % d.global_batch_size == 0,
                      f"data.valid_samples ({d.valid_samples}) must be a multiple of "
                      f"data.global_batch_size ({d.global_batch_size}): an evaluation is "
                      "whole batches")
    if batches:
        found.check(valid_sets, d)
    found.require(0 <= d.seq_length <= config.model.seq_length,
                  f"data.seq_length ({d.seq_length}) must be <= model.seq_length "
                  f"({config.model.seq_length})")
    found.require(not d.weights or len(d.weights) == len(d.prefixes),
                  f"data.weights has {len(d.weights)} entries but data.prefixes has "
                  f"{len(d.prefixes)}")
    found.require(all(w > 0 for w in d.weights), f"data.weights ({d.weights}) must all be > 0")
    found.require(not (d.document_attention and config.model.attention_backend == "te"),
                  "data.document_attention needs model.attention_backend sdpa or local (te's "
                  "packed format is not wired in): set --model.attention_backend=sdpa")
    parts = d.split.split(",")
    found.require(len(parts) == 3 and all(p.strip().replace(".", "", 1).isdigit() for p in parts)
                  and sum(float(p) for p in parts) > 0,
                  f"data.split ({d.split!r}) must be three non-negative numbers like '98,2,0'")
    return batches


def _validate_eval(ev: EvalConfig, found: Findings) -> None:
    for name in ("downstream_interval", "downstream_limit", "num_fewshot"):
        value = getattr(ev, name)
        found.require(value >= 0, f"eval.{name} ({value}) must be >= 0")
    if ev.include_path:
        found.check(require_folder, ev.include_path, "eval.include_path")


def _validate_world(config: Config, world_size: int, found: Findings) -> None:
    """The data-parallel rules of ``world_size`` processes (a valid layout and batch sizes
    given). Whole model replicas first: the rest only where they pass (the expert groups'
    product shares pp and, by default, tp with the replica's: one cause, one line); the
    virtual pipeline's micro-batches only where a step is whole micro-batches."""
    p, d = config.parallel, config.data
    model_parallel = p.tp * p.pp
    if not found.require(world_size % model_parallel == 0,
                         f"world size ({world_size}) must be divisible by parallel.tp x "
                         f"parallel.pp ({model_parallel})"):
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


def missing_files(config: Config) -> list[UserError]:
    """The files train and eval read that do not exist (the tokenizer, each data prefix's and
    each further validation set's .bin), each worded as their data checks
    (``pretrain.data.checks``) word it. Only added to a config refused for other reasons:
    alone, a missing file is refused by those checks, after a dry run's plan (which a login
    node without the data may ask for)."""
    wanted = []
    if config.data.tokenizer:
        wanted.append((config.data.tokenizer, "tokenizer", ""))
    wanted += [(prefix + ".bin", "data file", "") for prefix in config.data.prefixes]
    for entry in config.data.valid_sets:  # its SAMPLES and NAME may be refused by the rules
        name, prefix, _, equals = _entry_parts(entry)
        if equals and prefix and not prefix.endswith((".bin", ".idx")):
            wanted.append((prefix + ".bin", "data file", f"data.valid_sets '{name}': "))
    found = []
    for path, what, where in wanted:
        if not Path(path).exists():
            try:
                require_file(path, what, DataError)
            except DataError as err:
                found.append(DataError(f"{where}{err}"))
    return found


def _validate_compile(k: KernelsConfig, recompute: str, attention: str) -> None:
    require(not (k.compile and recompute == "selective"),
            "kernels.compile (true) and parallel.recompute (selective) do not compose: "
            "megatron's checkpoint of core attention saves and restores the RNG state inside "
            "the block, which breaks its graph; use parallel.recompute full or none")
    # megatron's DotProductAttention forks the RNG tracker around its dropout (a state saved
    # and restored) and reads a tensor's value on the host: several breaks in every block.
    require(not (k.compile and attention == "local"),
            "kernels.compile (true) and model.attention_backend (local) do not compose: "
            "megatron's DotProductAttention forks the RNG tracker for its dropout and reads a "
            "value on the host, which break every block's graph; use model.attention_backend "
            "sdpa (or auto), or kernels.compile false")
    if k.cuda_graphs:
        require(k.compile, "kernels.cuda_graphs (true) needs kernels.compile true: the graphs "
                "are captured around the compiled blocks")
        require(k.compile_backend is CompileBackend.INDUCTOR,
                f"kernels.cuda_graphs (true) needs kernels.compile_backend inductor, not "
                f"{k.compile_backend}")


def _validate_guard(g: GuardConfig) -> None:
    for name in ("window", "max_skipped", "rollback_skip_batches"):
        value = getattr(g, name)
        require(value >= 1, f"guard.{name} ({value}) must be >= 1")
    require(g.sigma > 0, f"guard.sigma ({g.sigma}) must be > 0")
    require(2 <= g.warmup <= g.window, f"guard.warmup ({g.warmup}) must be in [2, guard.window "
            f"({g.window})]: the spike rule needs a mean and a standard deviation")
    require(g.max_rollbacks >= 0, f"guard.max_rollbacks ({g.max_rollbacks}) must be >= 0")


def _validate_profiling(p: ProfilingConfig, steps: int, world_size: int | None) -> None:
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
