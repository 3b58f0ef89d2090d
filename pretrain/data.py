"""Training and validation batches from Megatron indexed datasets.

megatron-core builds the datasets (GPTDataset, blended by BlendedMegatronDatasetBuilder,
split train/valid/test by document). Batches are then cut deterministically from the global
sample index: optimizer step k uses samples [k * G, (k + 1) * G), split into micro-batches,
each data-parallel rank taking its slice. The data position of a run is therefore just its
step count, which is what checkpoints store; resuming needs no sampler state.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

from model import device
from model.config import ConfigError
from pretrain.config import Config
from pretrain.prepare import check_dataset


def sample_counts(config: Config) -> tuple[int, int]:
    """Training and validation samples a run draws: every step's batch, and eval_iters
    batches at each evaluation (the start, every eval_interval, the end). Evaluation of a
    checkpoint asks for the same counts, so it sees exactly the validation set training saw."""
    r, batch = config.run, config.data.global_batch_size
    evaluations = r.steps // r.eval_interval + 2
    return r.steps * batch, evaluations * max(r.eval_iters, 1) * batch


def check_data(config: Config, tokenizer) -> None:
    """Every prefix readable, within the tokenizer's vocabulary, and giving each split the run
    reads at least one document: checked before the run folder is touched."""
    data = config.data
    if not data.prefixes:
        raise ConfigError("data.prefixes is empty: give at least one dataset prefix (PREFIX of "
                          "PREFIX.bin/.idx, e.g. from prepare-data)")
    dataset_config = _dataset_config(config, tokenizer)
    sizes = sample_counts(config)
    wanted = (sizes[0], sizes[1] if config.run.eval_iters else 0)
    for prefix in data.prefixes:
        count = check_dataset(prefix, tokenizer.vocab_size)
        _check_split_not_empty(prefix, count, data.split, dataset_config.split_matrix, wanted)


def _dataset_config(config: Config, tokenizer) -> GPTDatasetConfig:
    data = config.data
    weights = data.weights or [1.0] * len(data.prefixes)
    return GPTDatasetConfig(
        random_seed=config.run.seed,
        sequence_length=config.seq_length,
        blend=(list(data.prefixes), list(weights)),
        split=data.split,
        path_to_cache=data.cache_dir or f"{config.run.dir}/data_cache",
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
        mid_level_dataset_surplus=0.05,
    )


def build_datasets(config: Config, tokenizer):
    """(train, valid) GPTDatasets of data that passed :func:`check_data`. Rank 0 builds
    megatron's index cache first; the other ranks then read it, so no two processes write the
    same cache file."""
    dataset_config = _dataset_config(config, tokenizer)
    sizes = [*sample_counts(config), 0]

    def build():
        return BlendedMegatronDatasetBuilder(
            GPTDataset, sizes, lambda: True, dataset_config).build()

    if dist.get_rank() == 0:
        datasets = build()
        dist.barrier()
    else:
        dist.barrier()
        datasets = build()
    return datasets[0], datasets[1]


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
            raise ConfigError(
                f"data.split ({split!r}) gives the {name} split of '{prefix}' no document "
                f"({documents} documents in all); add documents or raise its share")


def _collate(samples: list[dict]) -> dict[str, torch.Tensor]:
    keys = ("tokens", "labels", "loss_mask", "position_ids")
    target = device.compute_device()
    return {k: torch.stack([s[k] for s in samples]).to(target, non_blocking=True)
            for k in keys}


def step_microbatches(dataset, step: int, global_batch: int, micro_batch: int) -> Iterator[dict]:
    """This rank's micro-batches of optimizer step ``step`` (sample-index arithmetic only)."""
    dp = parallel_state.get_data_parallel_world_size()
    rank = parallel_state.get_data_parallel_rank()
    start = step * global_batch
    for offset in range(0, global_batch, micro_batch * dp):
        first = start + offset + rank * micro_batch
        yield _collate([dataset[i % len(dataset)] for i in range(first, first + micro_batch)])


def microbatches_per_step(global_batch: int, micro_batch: int) -> int:
    return global_batch // (micro_batch * parallel_state.get_data_parallel_world_size())
