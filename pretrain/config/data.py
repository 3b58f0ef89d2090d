"""[data]: the training and validation data, batch sizes and tokenizer, and their rules (the
files themselves are read at a start: ``pretrain.data.checks``)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from model.config import check_sequence_split, require
from pretrain.paths import require_creatable, require_file
from runtime.errors import ConfigError, DataError, Findings, UserError

if TYPE_CHECKING:
    from pretrain.config import Config


def _is_weight(text: str) -> bool:
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


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


def validate_data(config: Config, found: Findings) -> bool:
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
    if found.require(0 <= d.seq_length <= config.model.seq_length,
                     f"data.seq_length ({d.seq_length}) must be <= model.seq_length "
                     f"({config.model.seq_length})") and d.seq_length:
        found.check(check_sequence_split, d.seq_length, "data.seq_length", config.parallel)
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
