"""What the console shows: our own lines, each logger under its own name, and none of the
third-party notices that say nothing about the run.

:func:`setup` runs first thing in every entry point (before megatron is imported: most of its
notices are import-time ``warnings.warn`` calls). It installs filters for exactly the notices
listed below, each with the reason it is noise here, and keeps megatron's logging at WARNING
under its own name (``[megatron] ...``), so what megatron does say is not mistaken for ours.
``--verbose`` (or ``PRETRAIN_VERBOSE=1``) drops every filter and shows megatron's INFO lines.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import warnings

# (category, start of the message, why it is noise for this framework's users)
KNOWN_WARNINGS: tuple[tuple[type[Warning], str, str], ...] = (
    (UserWarning, "Transformer Engine and Apex are not installed",
     "megatron's torch fallbacks are the intended path without TE/apex (CPU, or no TE)"),
    (UserWarning, "Apex is not installed", "the same, for megatron's norm fallback"),
    (UserWarning, "absl.logging is not installed", "megatron then uses stdlib logging, as we do"),
    (UserWarning, "full scope is deprecated",
     "megatron's own TransformerConfig default (CUDA graphs are not used here)"),
    (UserWarning, "MimoModelConfig is experimental",
     "import-time notice of a megatron model family this framework does not use"),
    (UserWarning, "The .grad attribute of a Tensor that is not a leaf Tensor",
     "megatron's DDP probes .grad of non-leaf parameters views; harmless"),
    (FutureWarning, "`torch.distributed.reduce_scatter_tensor` is deprecated",
     "called inside megatron's distributed optimizer, not by us"),
    (FutureWarning, "`torch.distributed.all_gather_into_tensor` is deprecated",
     "called inside megatron's distributed optimizer, not by us"),
    (FutureWarning, "Please use DTensor instead and we are deprecating ShardedTensor",
     "megatron's checkpoint format still uses ShardedTensor"),
    (UserWarning, "torch.distributed is disabled, unavailable or uninitialized",
     "torch.distributed.checkpoint's notice when a single process reads a checkpoint"),
    (UserWarning, "The argument order of load has been changed",
     "torch.distributed.checkpoint notice raised from megatron's loader"),
    (SyntaxWarning, "invalid escape sequence", "a docstring in megatron's source"),
    (UserWarning, "Could not determine rank from torch.distributed",
     "megatron's dataset reader logs through torch.distributed; the data checks read the data "
     "before process groups exist, so that mistakes fail in seconds"),
)

# Notices about CUDA that megatron gives on CPU ranks too, where they cannot apply; on a GPU
# they are advice and stay (filtered by :func:`quiet_cpu_notices`).
CPU_NOTICES: tuple[tuple[type[Warning], str, str], ...] = (
    (UserWarning, "When using sequence parallelism it is recommended to set",
     "CUDA_DEVICE_MAX_CONNECTIONS orders CUDA streams; a CPU rank has none"),
    (UserWarning, "When using async grad allreduce it is recommended to set",
     "the same hint for tensor-parallel linears, once per rank and layer type"),
)

# megatron log records (logger "megatron.*", level WARNING) that describe megatron itself.
KNOWN_MEGATRON_NOTICES: tuple[tuple[str, str], ...] = (
    ("full_param_layout not provided",
     "DDP computes the layout itself, which is what this framework wants"),
    ("MCore's async save is deprecated", "megatron's own default checkpoint strategy"),
    ("Building a BlendedDataset for a single MegatronDataset",
     "a one-prefix blend is the common case, not a problem"),
    ("GPTModel IS DEPRECATED", "GPTModel is the dense decoder megatron's own training uses"),
    ("encountered an error: ", "a checkpoint writer's failure (a full disk), which the run "
     "reports itself in one error line naming its cause (pretrain.run.failure)"),
)


class _DropKnownNotices(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(message.startswith(text) or text in message
                       for text, _ in KNOWN_MEGATRON_NOTICES)


class _PrintedElsewhere(logging.Filter):
    """Drops a record that a handler of its own logger family already printed: libraries
    such as datasets and huggingface_hub give their top logger a stderr handler and still
    pass records on to the root, so each of their lines would show twice."""

    def filter(self, record: logging.LogRecord) -> bool:
        logger = logging.getLogger(record.name)
        while logger is not None and logger is not logging.root:
            if logger.handlers:
                return False
            if not logger.propagate:
                break
            logger = logger.parent
        return True


class _ShortName(logging.Formatter):
    """``[pretrain] ...`` for ours, ``[megatron] ...`` for megatron's (its top-level name)."""

    def format(self, record: logging.LogRecord) -> str:
        record.short = record.name.split(".", 1)[0]
        return super().format(record)


_verbose = False


def setup(verbose: bool = False) -> None:
    """Console logging and warning filters for one process (idempotent)."""
    global _verbose
    verbose = _verbose = verbose or os.environ.get("PRETRAIN_VERBOSE") == "1"
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_ShortName("[%(short)s] %(message)s"))
    handler.addFilter(_PrintedElsewhere())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
    logging.getLogger("pretrain").setLevel(logging.INFO)
    megatron = logging.getLogger("megatron")
    megatron.setLevel(logging.INFO if verbose else logging.WARNING)
    if verbose:
        return
    handler.addFilter(_DropKnownNotices())
    for category, text, _why in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(text), category=category)


def quiet_other_ranks(is_logging_rank: bool, keep_warnings: bool = True) -> None:
    """Only the rank that holds the loss prints progress; the others keep warnings (unless
    not ``keep_warnings``) and errors. Called twice by a launch: with the launcher's rank 0
    and no warnings elsewhere before the process groups exist (every rank runs the same
    start-up checks, so their lines would repeat once per rank), then with the rank that
    holds the loss."""
    quiet = logging.WARNING if keep_warnings else logging.ERROR
    logging.getLogger("pretrain").setLevel(logging.INFO if is_logging_rank else quiet)


def quiet_cpu_notices() -> None:
    """Once the process knows it computes on the CPU: drop megatron's CUDA advice
    (:data:`CPU_NOTICES`), unless the console is verbose."""
    if not _verbose:
        for category, text, _why in CPU_NOTICES:
            warnings.filterwarnings("ignore", message=re.escape(text), category=category)
