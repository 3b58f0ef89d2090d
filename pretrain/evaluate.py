"""``eval``: validation loss and perplexity of a checkpoint on the config's datasets."""

from __future__ import annotations

import json
from pathlib import Path

import torch.distributed as dist

from pretrain import checkpoint
from pretrain.data import build_datasets, check_data
from pretrain.train import evaluate, setup


def evaluate_checkpoint(config, path: str) -> dict:
    tokenizer, chunks = setup(config, training=False)
    found = checkpoint.load_weights(Path(path), chunks)
    check_data(config, tokenizer)
    _, valid = build_datasets(config, tokenizer)
    result = {"checkpoint": str(found), **evaluate(config, chunks, valid)}
    if dist.get_rank() == 0 and Path(config.run.dir).is_dir():
        with (Path(config.run.dir) / "eval.jsonl").open("a") as f:
            f.write(json.dumps(result) + "\n")
    return result
