"""Helpers the benchmarks and the lab share: package versions, a fixed random batch, integer
lists on the command line, markdown tables, generated blocks in the docs, and timing that is
GPU time on a GPU and wall time on the CPU (so a GPU benchmark's code can be rehearsed on a CPU
at a tiny size)."""

from __future__ import annotations

import argparse
import re
import statistics
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

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


def fill_blocks(text: str, tag: str, generated: dict[str, str]) -> str:
    """``text`` with the body of every ``<!-- TAG: NAME -->`` ... ``<!-- /TAG -->`` block
    replaced by ``generated[NAME]``: how a page carries a table made from a results file. A
    block no generator knows is an error (it would otherwise go stale unnoticed)."""
    pattern = re.compile(rf"(<!-- {tag}: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /{tag} -->)",
                         re.DOTALL)

    def fill(match: re.Match) -> str:
        if match["name"] not in generated:
            raise SystemExit(f"{tag}: unknown block {match['name']!r}")
        return match[1] + generated[match["name"]] + "\n" + match[4]

    return pattern.sub(fill, text)


def refresh_docs(docs: list[Path], tag: str, generated: dict[str, str], source: str,
                 write: bool) -> int:
    """Rewrite (``write``) or check the generated blocks of ``docs``: 0 if up to date or
    rewritten, else 1 with one line naming the stale pages."""
    stale = []
    for doc in docs:
        text = doc.read_text()
        new = fill_blocks(text, tag, generated)
        if new != text:
            stale.append(doc.name)
            if write:
                doc.write_text(new)
    if stale and not write:
        print(f"{tag}: out of date with {source}: {', '.join(stale)}")
        return 1
    return 0


class Mark:
    """A point in time inside a step: a CUDA event on a GPU (GPU time, recorded without
    synchronising), the wall clock on the CPU."""

    def __init__(self) -> None:
        self._event = torch.cuda.Event(enable_timing=True) if torch.cuda.is_available() else None
        self._wall = 0.0

    def record(self) -> None:
        if self._event is not None:
            self._event.record()
        else:
            self._wall = time.perf_counter()

    def seconds_since(self, earlier: Mark) -> float:
        """Seconds from ``earlier`` to this mark (waits for this mark's event on a GPU)."""
        if self._event is not None:
            self._event.synchronize()
            return earlier._event.elapsed_time(self._event) / 1e3
        return self._wall - earlier._wall


def time_ms(fn: Callable[[], object], rounds: int, warm: bool = True) -> float:
    """Time of one call of ``fn`` in ms, the median over ``rounds``: on a GPU each round is
    ``triton.testing.do_bench``'s median (GPU time, many launches, warm-up included); on the
    CPU the wall time of one call, after one warm-up call unless ``warm`` is False (the
    caller warmed it)."""
    if torch.cuda.is_available():
        from triton.testing import do_bench

        return statistics.median(do_bench(fn, return_mode="median") for _ in range(rounds))
    if warm:
        fn()
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        samples.append(1e3 * (time.perf_counter() - start))
    return statistics.median(samples)
