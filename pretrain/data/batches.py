"""Training and validation batches from Megatron indexed datasets.

megatron-core builds the datasets (GPTDataset, blended by BlendedMegatronDatasetBuilder,
split train/valid/test by document). Batches are then cut deterministically from the global
sample index: optimizer step k uses samples [k * G, (k + 1) * G), split into micro-batches,
each data-parallel rank taking its slice. The data position of a run is therefore its step
count (and, after an allowed batch change, the samples consumed before it: see
pretrain.data.position.DataPosition), which is what checkpoints store; resuming needs no sampler
state. megatron's sample-index cache is checked before it is read (megatron writes it
non-atomically, so a killed start can leave a truncated file that it would trust).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.blended_megatron_dataset_config import (
    convert_split_vector_to_split_matrix,
    parse_and_normalize_split,
)
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDataset

from model.documents import attention_mask, document_ids
from pretrain.config import Config, ValidSet, valid_sets
from pretrain.data.epochs import Reading, blend_weights, log_epochs
from pretrain.data.position import START, DataPosition
from pretrain.data.verify import check_dataset, check_files
from pretrain.report.units import count, human
from runtime import device
from runtime.errors import ConfigError, DataError

log = logging.getLogger("pretrain")


# Bytes of megatron's sample index per training sample (sample, shuffle and blending
# indices, int64 each, plus the document index), for the up-front size check.
INDEX_BYTES_PER_SAMPLE = 40


def sample_counts(config: Config, position: DataPosition = START) -> tuple[int, int]:
    """Training and validation samples a run draws: every step's batch (from ``position``
    on), and the validation set, data.valid_samples whatever the run's length and evaluation
    interval. megatron derives a split's sample order from the count it is asked for, so a
    fixed count is what keeps the validation set, and so a checkpoint's validation loss, the
    same in every run and in ``eval``."""
    d = config.data
    train = position.advance(config.run.steps, d.global_batch_size, config.seq_length).samples
    return train, d.valid_samples


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


def check_data(config: Config, tokenizer, training: bool = True) -> None:
    """Every prefix readable, made by this tokenizer (where its record says), within its
    vocabulary, and giving each split the run reads at least one document, and every further
    validation set (data.valid_sets) too: checked before the run folder is touched. When
    ``training``, logs how many epochs of each prefix the run reads, warning above one; eval
    reads no training sample, so it hears nothing of the run's epochs or blend shares."""
    data = config.data
    _check_index_size(config)
    if not data.prefixes:
        raise ConfigError("data.prefixes is empty: give at least one dataset prefix (PREFIX of "
                          "PREFIX.bin/.idx, e.g. from prepare-data)")
    wanted = sample_counts(config)
    weights = blend_weights(data.weights, data.prefixes, wanted[0] if training else 0)
    for prefix in data.prefixes:  # a missing or cut file among many fails before any scan
        check_files(prefix)
    # megatron's own split arithmetic, without building a dataset config (that logs through
    # torch.distributed, which does not exist yet at this point)
    split_matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(data.split))
    capacity, unrecorded, reads = [], [], []
    for prefix, weight in zip(data.prefixes, weights, strict=True):
        checked = check_dataset(prefix, tokenizer)
        if checked.tokenizer is None:
            unrecorded.append(prefix)
        _check_split_not_empty(prefix, checked.documents, data.split, split_matrix, wanted)
        lengths = _sequence_lengths(prefix)
        train_tokens = _split_tokens(lengths, split_matrix[0])
        reads.append(Reading(prefix, train_tokens,
                             wanted[0] * weight * config.seq_length / max(train_tokens, 1)))
        if data.valid_samples:
            capacity.append((prefix, weight, _split_sequences(config, lengths,
                                                              split_matrix[1])))
    if unrecorded:
        log.info("%s without a record of the tokenizer that made them (made elsewhere, or "
                 "by an older version): the tokenizer is not checked (%s)",
                 count(len(unrecorded), "data prefix"), ", ".join(unrecorded[:3])
                 + (", ..." if len(unrecorded) > 3 else ""))
    if training:
        log_epochs(reads)
    _check_valid_set_fits(config, capacity)
    for valid_set in valid_sets(data):
        _check_further_set(config, valid_set, tokenizer)


def _dataset_config(config: Config, tokenizer, **source) -> GPTDatasetConfig:
    """The run's datasets: ``source`` names them (megatron's ``blend`` and ``split``, or
    ``blend_per_split``); by default data.prefixes, data.weights and data.split."""
    data = config.data
    if not source:
        weights = data.weights or [1.0] * len(data.prefixes)
        source = {"blend": (list(data.prefixes), list(weights)), "split": data.split}
    return GPTDatasetConfig(
        random_seed=config.run.seed,
        sequence_length=config.seq_length,
        **source,
        path_to_cache=data.cache_dir or f"{config.run.dir}/data_cache",
        tokenizer=tokenizer,
        reset_position_ids=data.reset_position_ids,
        reset_attention_mask=data.document_attention,  # carried to _collate; no s x s mask
        eod_mask_loss=data.eod_mask_loss,
        create_attention_mask=False,
        mid_level_dataset_surplus=0.05,
    )


def build_datasets(config: Config, tokenizer, position: DataPosition = START):
    """(train, valid) GPTDatasets of data that passed :func:`check_data`, sized for a run
    continuing from ``position``."""
    datasets = _build(_dataset_config(config, tokenizer), [*sample_counts(config, position), 0])
    return datasets[0], datasets[1]


def build_valid_sets(config: Config, tokenizer) -> list[tuple[ValidSet, GPTDataset]]:
    """The further validation sets (data.valid_sets, checked by :func:`check_data`), each
    every document of its prefix: megatron's validation split of a separate distribution
    (``blend_per_split``), asked for the set's own sample count, so, as for the default set,
    which sequences it holds depends on the data, run.seed, the sequence length and that
    count alone."""
    built = []
    for valid_set in valid_sets(config.data):
        dataset_config = _dataset_config(
            config, tokenizer, blend_per_split=[None, ([valid_set.prefix], None), None])
        built.append((valid_set, _build(dataset_config, [0, valid_set.samples, 0])[1]))
    return built


def _build(dataset_config: GPTDatasetConfig, sizes: list[int]) -> list:
    """megatron's datasets of ``sizes`` (train, valid, test samples). Rank 0 checks and builds
    megatron's index cache first; the other ranks then read it, so no two processes write the
    same cache file."""

    def build():
        return BlendedMegatronDatasetBuilder(
            GPTDataset, sizes, lambda: True, dataset_config).build()

    if dist.get_rank() == 0:
        drop_damaged_cache(Path(dataset_config.path_to_cache))
        datasets = build()
        dist.barrier()
    else:
        dist.barrier()
        datasets = build()
    return datasets


def drop_damaged_cache(folder: Path) -> None:
    """Remove every cached index set with an unreadable file, so megatron rebuilds it. It
    writes description.txt and then each .npy in place; a set with a missing file is rebuilt
    by megatron itself, a truncated .npy would be trusted and fail to load."""
    for path in sorted(folder.glob("*.npy")) if folder.is_dir() else ():
        try:
            np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError, EOFError):
            group = path.name.rsplit("-", 1)[0]  # <hash>-<Class>-<split>
            log.warning("data cache file %s is damaged (an interrupted write); rebuilding",
                        path)
            for member in folder.glob(f"{group}-*"):
                member.unlink(missing_ok=True)


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


def _sequence_lengths(prefix: str) -> np.ndarray:
    """The token count of every sequence of ``prefix`` (megatron splits a prefix by
    sequence), read from its .idx."""
    dataset = IndexedDataset(prefix)  # the lengths are a view of its memory map: copied
    lengths = np.array(dataset.sequence_lengths, dtype=np.int64)
    del dataset
    return lengths


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


def _check_further_set(config: Config, valid_set: ValidSet, tokenizer) -> None:
    """A set of data.valid_sets passes the checks of a training prefix (readable, every token
    id within the tokenizer's vocabulary: a set tokenised with a larger vocabulary fails
    here) and holds its sample count without repeating a sample, the default set's rule;
    refused otherwise, naming the largest count that works."""
    name, prefix, samples = valid_set
    try:
        documents = check_dataset(prefix, tokenizer).documents
    except DataError as err:
        raise DataError(f"data.valid_sets '{name}': {err}") from None
    available = _split_sequences(config, _sequence_lengths(prefix), (0.0, 1.0))
    if samples <= available:
        return
    batch = config.data.global_batch_size
    largest = available // batch * batch
    fix = (f"the largest SAMPLES that fits is {largest} (a multiple of "
           f"data.global_batch_size {batch})" if largest else
           f"not even one global batch ({batch}) fits: add documents")
    raise DataError(
        f"data.valid_sets '{name}' asks '{prefix}' for {samples} validation sequences of "
        f"{config.seq_length} tokens, but its {documents} documents hold {available}; {fix}")


def _collate(samples: list[dict], dataset_config: GPTDatasetConfig) -> dict[str, torch.Tensor]:
    """One micro-batch on the compute device. With document attention (the dataset's
    ``reset_attention_mask``, created from data.document_attention) it carries the document
    ids as the model's attention mask (model.documents): megatron would build an s x s mask
    per sample instead."""
    keys = ("tokens", "labels", "loss_mask", "position_ids")
    target = device.compute_device()
    batch = {k: torch.stack([s[k] for s in samples]).to(target, non_blocking=True)
             for k in keys}
    if dataset_config.reset_attention_mask:
        ids = document_ids(batch["tokens"], dataset_config.tokenizer.eod)
        batch["attention_mask"] = attention_mask(ids)
    return batch


def step_microbatches(dataset, start: int, global_batch: int,
                      micro_batch: int) -> Iterator[dict]:
    """This rank's micro-batches of the global batch of samples [start, start + global_batch)
    (sample-index arithmetic only)."""
    dp = parallel_state.get_data_parallel_world_size()
    rank = parallel_state.get_data_parallel_rank()
    for offset in range(0, global_batch, micro_batch * dp):
        first = start + offset + rank * micro_batch
        yield _collate([dataset[i % len(dataset)] for i in range(first, first + micro_batch)],
                       dataset.config)


def microbatches_per_step(global_batch: int, micro_batch: int) -> int:
    return global_batch // (micro_batch * parallel_state.get_data_parallel_world_size())
