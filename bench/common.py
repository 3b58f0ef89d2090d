"""Helpers the benchmarks share: package versions, a fixed random batch, integer lists on the
command line, markdown tables."""

from __future__ import annotations

import argparse
from importlib import metadata

import torch


def package_version(name: str) -> str:
    """The installed version of a distribution, read from its metadata (never imports it:
    importing Transformer Engine without CUDA breaks megatron-core)."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "absent"


def versions_line() -> str:
    cuda = f" (CUDA {torch.version.cuda})" if torch.version.cuda else ""
    return (f"torch {torch.__version__}{cuda}, megatron-core {package_version('megatron-core')}, "
            f"triton {package_version('triton')}, "
            f"transformer-engine {package_version('transformer-engine')}")


def random_batch(vocab: int, batch: int, seq: int, device: str | torch.device = "cpu",
                 seed: int = 0) -> dict[str, torch.Tensor]:
    """One microbatch in the schedule's format (tokens, labels, loss_mask, position_ids)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
    out = {
        "tokens": tokens[:, :-1],
        "labels": tokens[:, 1:],
        "loss_mask": torch.ones(batch, seq),
        "position_ids": torch.arange(seq).unsqueeze(0).expand(batch, -1),
    }
    return {k: v.contiguous().to(device) for k, v in out.items()}


def int_list(text: str) -> list[int]:
    """An argparse type: comma-separated integers."""
    try:
        return [int(v) for v in text.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}") from None


def markdown_table(header: list[str], rows: list[list[str]], right_from: int = 1) -> str:
    """A markdown table; columns from ``right_from`` on are right-aligned (numbers)."""
    align = ["---" if i < right_from else "---:" for i in range(len(header))]
    lines = [header, align, *rows]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in lines)
