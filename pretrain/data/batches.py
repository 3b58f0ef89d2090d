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
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

from model.documents import attention_mask, document_ids
from pretrain.config import Config, ValidSet, valid_sets
from pretrain.data.batch_ids import check_batch
from pretrain.data.position import START, DataPosition
from runtime import device

log = logging.getLogger("pretrain")


def sample_counts(config: Config, position: DataPosition = START) -> tuple[int, int]:
    """Training and validation samples a run draws: every step's batch (from ``position``
    on), and the validation set, data.valid_samples whatever the run's length and evaluation
    interval. megatron derives a split's sample order from the count it is asked for, so a
    fixed count is what keeps the validation set, and so a checkpoint's validation loss, the
    same in every run and in ``eval``."""
    d = config.data
    train = position.advance(config.run.steps, d.global_batch_size, config.seq_length).samples
    return train, d.valid_samples


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


def _collate(samples: list[dict], dataset, indices: list[int]) -> dict[str, torch.Tensor]:
    """One micro-batch (``samples``: items ``indices`` of ``dataset``) on the compute device,
    its token ids checked on the host first (pretrain.data.batch_ids), so an id outside the
    vocabulary is refused naming its file, not met in the embedding. With document attention
    (the dataset's ``reset_attention_mask``, created from data.document_attention) it carries
    the document ids as the model's attention mask (model.documents): megatron would build an
    s x s mask per sample instead."""
    keys = ("tokens", "labels", "loss_mask", "position_ids")
    host = {k: torch.stack([s[k] for s in samples]) for k in keys}
    check_batch(host, dataset, indices)
    target = device.compute_device()
    batch = {k: v.to(target, non_blocking=True) for k, v in host.items()}
    if dataset.config.reset_attention_mask:
        ids = document_ids(batch["tokens"], dataset.config.tokenizer.eod)
        batch["attention_mask"] = attention_mask(ids)
    return batch


def step_microbatches(dataset, start: int, global_batch: int,
                      micro_batch: int) -> Iterator[dict]:
    """This rank's micro-batches of the global batch of samples [start, start + global_batch)
    (sample-index arithmetic only), each checked before it is yielded, so before its
    forward."""
    dp = parallel_state.get_data_parallel_world_size()
    rank = parallel_state.get_data_parallel_rank()
    for offset in range(0, global_batch, micro_batch * dp):
        first = start + offset + rank * micro_batch
        indices = [i % len(dataset) for i in range(first, first + micro_batch)]
        yield _collate([dataset[i] for i in indices], dataset, indices)


def microbatches_per_step(global_batch: int, micro_batch: int) -> int:
    return global_batch // (micro_batch * parallel_state.get_data_parallel_world_size())
