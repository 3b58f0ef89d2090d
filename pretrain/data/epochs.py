"""How a run's samples are shared among its prefixes, and how many passes over each that is.

megatron draws a blend's samples in proportion to the normalised weights, each prefix's from
its training split, and starts a prefix's next epoch silently when that split runs out: the
samples then repeat and the loss curve bends where they do. The start-up plan and the dry run
say how many epochs of each prefix the run reads, and warn above one.
"""

from __future__ import annotations

import logging
import math
from typing import NamedTuple

from pretrain.report.units import count, human
from runtime.errors import ConfigError

log = logging.getLogger("pretrain")

# Per-prefix lines up to this many prefixes; a larger blend gets one summary line.
LISTED_PREFIXES = 8


class Reading(NamedTuple):
    """What a run reads of one prefix: the tokens of its training split, and the passes over
    them its share of the run's samples makes."""

    prefix: str
    train_tokens: int
    epochs: float


def blend_weights(weights: list[float], prefixes: list[str], samples: int) -> list[float]:
    """The normalised blend weights (equal without data.weights), each finite and positive,
    their sum too (megatron divides by it). A prefix whose share of the run's ``samples`` is
    under one sample is named in a warning: the run may well not read it at all."""
    weights = list(weights) or [1.0] * len(prefixes)
    for prefix, weight in zip(prefixes, weights, strict=True):
        if not math.isfinite(weight) or weight <= 0:
            raise ConfigError(f"data.weights entry for '{prefix}' ({weight}) must be a finite "
                              "number > 0")
    total = sum(weights)
    if not math.isfinite(total):
        raise ConfigError(f"data.weights sum to {total}: give them on a smaller scale "
                          "(they are normalised)")
    shares = [w / total for w in weights]
    unread = [p for p, share in zip(prefixes, shares, strict=True) if share * samples < 1]
    if samples and unread:
        log.warning("data.weights give %s less than one of the run's %s training samples: %s",
                    count(len(unread), "prefix"), f"{samples:,}", ", ".join(unread[:3])
                    + (", ..." if len(unread) > 3 else ""))
    return shares


def log_epochs(reads: list[Reading]) -> None:
    """One line per prefix (a summary line for a large blend), and one warning naming every
    prefix read more than once."""
    if len(reads) <= LISTED_PREFIXES:
        for r in reads:
            log.info("data: %s: %s training tokens; the run reads %.2f epochs of them",
                     r.prefix, human(r.train_tokens), r.epochs)
    else:
        low = min(reads, key=lambda r: r.epochs)
        high = max(reads, key=lambda r: r.epochs)
        log.info("data: %s, %s training tokens; the run reads %.2f (%s) to %.2f (%s) epochs "
                 "of each", count(len(reads), "prefix"),
                 human(sum(r.train_tokens for r in reads)), low.epochs, low.prefix,
                 high.epochs, high.prefix)
    repeated = [r for r in reads if r.epochs > 1]
    if repeated:
        log.warning("the run reads more than one epoch of %s, so its samples repeat: %s; "
                    "from the second pass on the training loss also falls by memorising them, "
                    "and only the validation loss (documents the run never trains on) shows "
                    "what the model learned beyond them: expect it to stop falling, then rise",
                    count(len(repeated), "prefix"),
                    ", ".join(f"{r.prefix} {r.epochs:.2f}" for r in repeated[:LISTED_PREFIXES])
                    + (", ..." if len(repeated) > LISTED_PREFIXES else ""))


def log_long_documents(prefix: str, lengths, seq_length: int) -> None:
    """Say how many documents of ``prefix`` (``lengths``: tokens of each) are longer than a
    sample: megatron packs documents end to end and cuts samples of seq_length tokens, so a
    long document is split across samples and every part is trained on, the later parts
    without the document's beginning in their context."""
    longer = int((lengths > seq_length).sum())
    if longer:
        log.info("data: %s: %s of %s documents are longer than model.seq_length (%s tokens): "
                 "packing splits them across sequences and every part is trained on, each "
                 "part after the first without the document's beginning in its context",
                 prefix, f"{longer:,}", f"{len(lengths):,}", f"{seq_length:,}")

