"""Shared fixtures-in-code for the tests: tiny configs, fixed batches, rank spawning."""

from __future__ import annotations

import os

import torch
import torch.multiprocessing as mp

from model.config import ModelConfig
from model.parallel import free_port

SEQ, MBS, VOCAB = 16, 2, 100


def tiny_model(scheme: str, **overrides) -> ModelConfig:
    fields = dict(
        residual_scheme=scheme, num_layers=4, hidden_size=32, num_attention_heads=4,
        num_query_groups=2, ffn_hidden_size=64, vocab_size=VOCAB, seq_length=SEQ,
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def batches(count: int, seed: int = 0, seq: int = SEQ, mbs: int = MBS) -> list[dict]:
    """Fixed microbatches of random tokens, identical in every process."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        tokens = torch.randint(0, VOCAB, (mbs, seq + 1), generator=gen)
        out.append({
            "tokens": tokens[:, :-1].contiguous(),
            "labels": tokens[:, 1:].contiguous(),
            "loss_mask": torch.ones(mbs, seq),
            "position_ids": torch.arange(seq).unsqueeze(0).expand(mbs, -1).contiguous(),
        })
    return out


def _bootstrap(rank: int, world: int, port: int, fn, args) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
        WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    fn(*args)


def spawn(world: int, fn, *args) -> None:
    """Run ``fn(*args)`` on ``world`` gloo ranks; raises if any rank fails."""
    mp.start_processes(_bootstrap, args=(world, free_port(), fn, args), nprocs=world,
                       join=True, start_method="spawn")
