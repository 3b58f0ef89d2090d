"""Every check a dataset passes before a run folder is written, made in one pass in the order
below: :func:`check_data` is the one entry (``pretrain.build.preflight`` calls it for training
and ``eval``), and each check it makes is below it in this file. It reads each dataset once
(its ``.idx``, its record, the size of its ``.bin``, a few pages of it) and returns what it
read (:class:`Data`), so the start's later steps read no data file again: the run's identity
(``pretrain.run.identity``) takes each ``.idx``'s fingerprint from it.

1. The run's sample count fits this machine's memory as megatron's sample index.
2. Every dataset's files exist and its ``.idx`` is structurally sound
   (:mod:`pretrain.data.index`: sizes, pointers, document indices): each training prefix's,
   then each further validation set's (data.valid_sets), all before any scan, so a damaged
   file among a hundred fails first.
3. Each training prefix in turn: its ``.bin`` has the size its index describes; its record
   (:mod:`pretrain.data.record`) agrees with the files, names the tokenizer that made it (when
   known: then it must be this run's) and gives its lowest and highest token id, which must
   lie in the tokenizer's vocabulary; each split the run reads gets at least one document.
4. The validation split holds data.valid_samples without repeating a sample; each further
   validation set passes 3's checks of its files and holds its samples.
5. With data.document_attention, documents end with the tokenizer's end-of-document token
   (else every sequence is one document: said once).
6. For training, a tokenizer that does not give back the text it encodes
   (:mod:`pretrain.data.round_trip`) only with datasets whose record allows it.

Every failure is one DataError or ConfigError line naming the file or field, the rule and the
value. Every check costs the same at any corpus size: the token ids come from the record,
scanned once when there is none; since the record is trusted while the .bin keeps its size and
time, every micro-batch's ids are checked again where they are read
(:mod:`pretrain.data.batch_ids`). What a training start logs here: the epochs of each prefix
(:mod:`pretrain.data.epochs`).
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any, NamedTuple

import numpy as np
from megatron.core.datasets.blended_megatron_dataset_config import (
    convert_split_vector_to_split_matrix,
    parse_and_normalize_split,
)

from pretrain.config import Config, ValidSet, valid_sets
from pretrain.data import index as idx
from pretrain.data import record, round_trip
from pretrain.data.batches import sample_counts
from pretrain.data.epochs import Reading, blend_weights, log_epochs, log_long_documents
from pretrain.paths import require_file
from pretrain.report.units import count, human
from runtime.errors import ConfigError, DataError

log = logging.getLogger("pretrain")

# Bytes of megatron's sample index per training sample (sample, shuffle and blending
# indices, int64 each, plus the document index), for the up-front size check.
INDEX_BYTES_PER_SAMPLE = 40


def _check_index_size(config: Config) -> None:
    """An absurd run.steps makes megatron build a sample index larger than memory (hours of
    silence, then an out-of-memory kill): refuse it with the estimate."""
    samples = sum(sample_counts(config))
    need = samples * INDEX_BYTES_PER_SAMPLE
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > memory:
        raise ConfigError(
            f"run.steps ({config.run.steps:,}) x data.global_batch_size "
            f"({config.data.global_batch_size}) needs {samples:,} samples, whose index would "
            f"take ~{human(need)}B, more than this machine's memory "
            f"({human(memory)}B); lower run.steps")


class Dataset(NamedTuple):
    """One dataset as the start's checks found it: its documents and tokens, and its record
    as :func:`pretrain.data.record.current` gave it (the tokenizer that made it, its id range,
    the .idx's fingerprint now, its allowances). It holds no open file (a memory map holds
    one, and a blend may have thousands of prefixes)."""

    prefix: str
    documents: int
    tokens: int
    record: dict[str, Any]

    @property
    def tokenizer(self) -> dict[str, Any] | None:
        """The tokenizer its record names (None: made elsewhere, or before records)."""
        return self.record["tokenizer"]

    @property
    def fingerprint(self) -> str:
        return self.record["idx_fingerprint"]


class Data(NamedTuple):
    """What :func:`check_data` read: the training prefixes (data.prefixes, in order) and the
    further validation sets (data.valid_sets, in order)."""

    training: list[Dataset]
    further: list[Dataset]

    @property
    def fingerprints(self) -> list[str]:
        """Each training prefix's .idx fingerprint, for the run's data identity."""
        return [d.fingerprint for d in self.training]


def check_data(config: Config, tokenizer, training: bool = True) -> Data:
    """The data of ``config`` against ``tokenizer``, steps 1-6 of the module's docstring in
    one pass, before the run folder is touched; returns what was read. When ``training``,
    logs how many epochs of each prefix the run reads, warning above one, and checks that a
    lossy tokenizer is allowed; eval reads no training sample, so it hears nothing of the
    run's epochs or blend shares."""
    data = config.data
    _check_index_size(config)
    if not data.prefixes:
        raise ConfigError("data.prefixes is empty: give at least one dataset prefix (PREFIX of "
                          "PREFIX.bin/.idx, e.g. from prepare-data)")
    wanted = sample_counts(config)
    weights = blend_weights(data.weights, data.prefixes, wanted[0] if training else 0)
    further = valid_sets(data)
    indices = [read_index(prefix) for prefix in data.prefixes]  # all before any scan
    further_indices = [_in_set(s, read_index, s.prefix) for s in further]
    # megatron's own split arithmetic, without building a dataset config (that logs through
    # torch.distributed, which does not exist yet at this point)
    split_matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(data.split))
    datasets, capacity, reads = [], [], []
    for prefix, weight, index in zip(data.prefixes, weights, indices, strict=True):
        datasets.append(check_dataset(prefix, tokenizer, index))
        _check_split_not_empty(prefix, index.document_count, data.split, split_matrix, wanted)
        train_tokens = _split_tokens(index.lengths, split_matrix[0])
        reads.append(Reading(prefix, train_tokens,
                             wanted[0] * weight * config.seq_length / max(train_tokens, 1)))
        if training:
            log_long_documents(prefix, index.lengths, config.seq_length)
        if data.valid_samples:
            capacity.append((prefix, weight, _split_sequences(config, index.lengths,
                                                              split_matrix[1])))
    unrecorded = [d.prefix for d in datasets if d.tokenizer is None]
    if unrecorded:
        log.info("%s without a record of the tokenizer that made them (made elsewhere, or "
                 "by an older version): the tokenizer is not checked (%s)",
                 count(len(unrecorded), "data prefix"), ", ".join(unrecorded[:3])
                 + (", ..." if len(unrecorded) > 3 else ""))
    if training:
        log_epochs(reads)
    _check_valid_set_fits(config, capacity)
    checked = Data(datasets, [_check_further_set(config, valid_set, tokenizer, index)
                              for valid_set, index in zip(further, further_indices,
                                                          strict=True)])
    if data.document_attention:
        _check_documents_end(data.prefixes, indices, tokenizer)
    if training:
        _check_round_trip(config, tokenizer, checked)
    return checked


def read_index(prefix: str) -> idx.Index:
    """Both files of ``prefix`` exist and its .idx is structurally sound."""
    for suffix in (".bin", ".idx"):
        require_file(prefix + suffix, "data file", DataError)
    return idx.read(prefix + ".idx")


def check_dataset(prefix: str, tokenizer, index: idx.Index | None = None) -> Dataset:
    """Check ``prefix`` (its ``index`` if already read) against ``tokenizer``: its .bin's
    size, its record, the tokenizer the record names (its content hash), the token ids
    against the vocabulary."""
    index = index or read_index(prefix)
    tokens, documents = index.tokens, index.document_count
    size = os.path.getsize(prefix + ".bin")
    if size != tokens * index.dtype.itemsize:
        raise DataError(f"data file '{prefix}.bin' has {size} bytes but '{prefix}.idx' "
                        f"describes {tokens * index.dtype.itemsize} (truncated or damaged)")
    if tokens == 0:
        raise DataError(f"data prefix '{prefix}' holds no tokens")
    ids = np.memmap(prefix + ".bin", dtype=index.dtype, mode="r", shape=(tokens,))
    facts = record.current(prefix, ids, documents)
    if facts["tokens"] != tokens or facts["documents"] != documents:
        raise DataError(f"data record '{record.path_of(prefix)}' describes {facts['tokens']:,} "
                        f"tokens in {facts['documents']:,} documents, '{prefix}.idx' "
                        f"{tokens:,} in {documents:,}; delete the record to scan again")
    made_by = facts["tokenizer"]
    current = record.tokenizer_entry(tokenizer)
    if made_by is not None and made_by["sha256"] != current["sha256"]:
        raise DataError(
            f"data prefix '{prefix}' was made with another tokenizer: '{made_by['path']}' "
            f"#{made_by['sha256'][:8]} ({made_by['vocab_size']:,} pieces), data.tokenizer is "
            f"'{current['path']}' #{current['sha256'][:8]} ({current['vocab_size']:,} "
            "pieces); prepare the data again with data.tokenizer, or set it to the data's")
    if facts["max_id"] >= tokenizer.vocab_size:
        raise DataError(f"data prefix '{prefix}' has token id {facts['max_id']} >= tokenizer "
                        f"vocab_size {tokenizer.vocab_size}")
    if facts["min_id"] < 0:
        raise DataError(f"data prefix '{prefix}' has negative token id {facts['min_id']}")
    return Dataset(prefix, documents, tokens, facts)


# Documents whose last token is looked at, per prefix, for data.document_attention.
ENDS_SAMPLED = 64


def _check_documents_end(prefixes: list[str], indices: list[idx.Index], tokenizer) -> None:
    """Document attention cuts sequences at the end-of-document token; data prepared without
    it (another pipeline's) has none, and every sequence silently becomes one document. The
    last token of up to ENDS_SAMPLED documents of each prefix is read (a few pages at any
    corpus size); where none is the token, that is said once."""
    missing = []
    for prefix, index in zip(prefixes, indices, strict=True):
        ids = np.memmap(prefix + ".bin", dtype=index.dtype, mode="r")
        last = [int(ids[index.pointers[s] // index.dtype.itemsize + index.lengths[s] - 1])
                for s in index.documents[1:][:ENDS_SAMPLED] - 1 if index.lengths[s] > 0]
        if last and tokenizer.eod not in last:
            missing.append(prefix)
    if missing:
        log.warning("data.document_attention is on, but none of the first %d documents of %s "
                    "ends with the end-of-document token (id %d): attention is not cut at "
                    "document ends there (%s)", ENDS_SAMPLED,
                    count(len(missing), "data prefix"), tokenizer.eod,
                    ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else ""))


def _check_split_not_empty(prefix: str, documents: int, split: str, split_matrix,
                           wanted: tuple[int, int]) -> None:
    """megatron splits each prefix by document, rounding ``share * documents``; a split that
    gets no document but is asked for samples makes GPTDataset loop forever looking for
    tokens (and a zero share returns no dataset at all). Catch both here, with the numbers the
    user can change. ``wanted`` is the (train, valid) sample count the run will read."""
    for name, bounds, samples in zip(("train", "valid"), split_matrix, wanted, strict=False):
        if samples == 0:
            continue
        first, last = (int(round(b * documents)) for b in bounds or (0.0, 0.0))
        if last <= first:
            raise DataError(
                f"data.split ({split!r}) gives the {name} split of '{prefix}' no document "
                f"({documents} documents in all); add documents or raise its share")


def _split_tokens(lengths: np.ndarray, bounds) -> int:
    """Tokens in the split of a prefix whose sequence lengths are ``lengths``."""
    if not bounds:
        return 0
    first, last = (int(round(b * len(lengths))) for b in bounds)
    return int(lengths[first:last].sum())


def _split_sequences(config: Config, lengths: np.ndarray, bounds) -> int:
    """Sequences of seq_length the split holds without repeating one: a sample reads
    seq_length + 1 tokens; consecutive samples share one."""
    return max(_split_tokens(lengths, bounds) - 1, 0) // config.seq_length


def largest_valid_samples(capacity: list[tuple[str, float, int]], global_batch: int) -> int:
    """The largest data.valid_samples (a multiple of the global batch) for which every prefix
    (``capacity``: prefix, weight, sequences its split holds) can give its share."""
    fits = min(available / weight for _, weight, available in capacity)
    value = int(fits) // global_batch * global_batch
    while value > 0 and any(math.ceil(value * weight) > available
                            for _, weight, available in capacity):
        value -= global_batch  # float rounding at the boundary
    return value


def _check_valid_set_fits(config: Config, capacity: list[tuple[str, float, int]]) -> None:
    """The validation split of every prefix holds its share of data.valid_samples (megatron
    asks each prefix for ceil(valid_samples x weight)) without repeating a sample. megatron
    would make up a shortfall with a second pass over the split, and a repeated sample counts
    twice in every evaluation; refused instead, naming the largest value that works."""
    d = config.data
    for prefix, weight, available in capacity:
        wanted = math.ceil(d.valid_samples * weight)
        if available >= wanted:
            continue
        largest = largest_valid_samples(capacity, d.global_batch_size)
        fix = (f"the largest data.valid_samples that fits is {largest} (a multiple of "
               f"data.global_batch_size {d.global_batch_size}), or raise the validation share"
               if largest else
               f"not even one global batch ({d.global_batch_size}) fits: raise the validation "
               "share or add documents")
        raise DataError(
            f"data.valid_samples ({d.valid_samples}) asks '{prefix}' for {wanted} validation "
            f"sequences of {config.seq_length} tokens, but its validation split (data.split "
            f"{d.split!r}) holds {available}; {fix}")


def _in_set(valid_set: ValidSet, check, *args):
    """``check(*args)`` for a set of data.valid_sets, its DataError naming the set."""
    try:
        return check(*args)
    except DataError as err:
        raise DataError(f"data.valid_sets '{valid_set.name}': {err}") from None


def _check_further_set(config: Config, valid_set: ValidSet, tokenizer,
                       index: idx.Index) -> Dataset:
    """A set of data.valid_sets (``index``: its .idx, read) passes the checks of a training
    prefix (readable, every token id within the tokenizer's vocabulary: a set tokenised with
    a larger vocabulary fails here) and holds its sample count without repeating a sample,
    the default set's rule; refused otherwise, naming the largest count that works."""
    name, prefix, samples = valid_set
    dataset = _in_set(valid_set, check_dataset, prefix, tokenizer, index)
    documents = dataset.documents
    available = _split_sequences(config, index.lengths, (0.0, 1.0))
    if samples <= available:
        return dataset
    batch = config.data.global_batch_size
    largest = available // batch * batch
    fix = (f"the largest SAMPLES that fits is {largest} (a multiple of "
           f"data.global_batch_size {batch})" if largest else
           f"not even one global batch ({batch}) fits: add documents")
    raise DataError(
        f"data.valid_sets '{name}' asks '{prefix}' for {samples} validation sequences of "
        f"{config.seq_length} tokens, but its {documents} documents hold {available}; {fix}")


def _check_round_trip(config: Config, tokenizer, data: Data) -> None:
    """A tokenizer that does not give back the text it encodes trains only on datasets
    prepared with that allowance (:mod:`pretrain.data.round_trip`), which their records
    say."""
    lost = round_trip.loss(tokenizer, round_trip.PROBE)
    if lost is None:
        return
    for dataset in [*data.training, *data.further]:
        if not dataset.record.get("lossy_tokenizer"):
            raise DataError(
                f"data.tokenizer '{config.data.tokenizer}' does not give back the text it "
                f"encodes ({lost}), and '{dataset.prefix}' was not prepared with "
                "--allow-lossy-tokenizer: prepare it again with a lossless tokenizer, or "
                "with --allow-lossy-tokenizer to train on this one's ids")
    log.warning("data.tokenizer '%s' loses text (%s); its datasets were prepared with "
                "--allow-lossy-tokenizer", config.data.tokenizer, lost)
