"""Helpers the benchmarks share: package versions, a fixed random batch, integer lists on the
command line, and timing that is GPU time on a GPU and wall time on the CPU (so a GPU
benchmark's code can be rehearsed on a CPU at a tiny size). Tables and generated blocks in the
docs are runtime.markdown's."""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from collections.abc import Callable, Iterator
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


@contextlib.contextmanager
def one_process() -> Iterator[None]:
    """megatron's process groups for this process alone (TP = PP = 1) on the scoped CPU layer,
    closed however the benchmark ends: what a benchmark that builds megatron models runs in."""
    from model.config import ParallelConfig
    from runtime import cpu_compat, parallel

    with cpu_compat.enabled():
        parallel.initialize(ParallelConfig())
        try:
            yield
        finally:
            parallel.destroy()


def _context_rank(rank: int, cp: int, port: int, fn, args, out) -> None:
    from model.config import ParallelConfig
    from runtime import cpu_compat, parallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(cp), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    with cpu_compat.enabled():
        parallel.initialize(ParallelConfig(cp=cp))
        try:
            result = fn(*args)
        finally:
            parallel.destroy()
    if rank == 0:
        out.put(result)


def on_context_ranks(cp: int, fn: Callable, *args):
    """``fn(*args)`` on ``cp`` gloo processes sharing each sequence (``parallel.cp``), one
    thread each, inside megatron's groups; rank 0's result (``fn`` and its result must
    pickle). What a benchmark of context parallelism runs its measurement in."""
    import torch.multiprocessing as mp

    from runtime.launcher import free_port

    out = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_context_rank, args=(cp, free_port(), fn, args, out), nprocs=cp,
                       join=True, start_method="spawn")
    return out.get()


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
