"""``eval``: validation loss and perplexity of a checkpoint on the config's datasets."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from pretrain import identity
from pretrain.data import build_datasets
from pretrain.metrics import strict_json
from pretrain.start import weights_source
from pretrain.train import evaluate, preflight, setup
from runtime import weights


def evaluate_checkpoint(config, path: str) -> dict:
    """The checkpoint's model must be the config's (checked before loading); the data may be
    any, so a checkpoint can be scored on other validation data."""
    tokenizer = preflight(config, training=False)
    found = weights_source(path, identity.model_identity(config))
    chunks = setup(config)
    weights.load(chunks, found)
    _, valid = build_datasets(config, tokenizer)
    result = {"checkpoint": str(found), **evaluate(config, chunks, valid)}
    if dist.get_rank() == 0 and Path(config.run.dir).is_dir():
        with (Path(config.run.dir) / "eval.jsonl").open("a") as f:
            f.write(strict_json(result) + "\n")
    return result
