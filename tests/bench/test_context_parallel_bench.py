"""``python -m bench.context_parallel`` at a tiny size: both tables, the attention's kept bytes
per token of a rank's share independent of the length (linear in the tokens) and larger at
CP=2 (the gathered K and V), and the on-paper exchange of the 32K preset as the arithmetic of
its shape gives it."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from pretrain.config import load_config
from pretrain.report.dry_run import context_parallel_bytes
from tests.pretrain_fixtures import REPO, env

pytestmark = pytest.mark.slow  # two processes


def test_the_bench_prints_both_tables():
    """As a user runs it: its own process (its CP=1 half sets megatron's groups up)."""
    done = subprocess.run([sys.executable, "-m", "bench.context_parallel", "--seqs=64,128",
                           "--rounds=1", "--heads=2", "--groups=1", "--head-dim=16"],
                          cwd=REPO, env=env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    rows = re.findall(r"^\| ([\d,]+) \| [\d.,]+ \| [\d.,]+ \| [\d.]+ \| ([\d,]+) \| ([\d,]+) \|$",
                      out, re.M)
    assert [r[0] for r in rows] == ["64", "128"], out
    one, two = ({int(r[i].replace(",", "")) for r in rows} for i in (1, 2))
    assert len(one) == 1 and len(two) == 1, ("bytes per token vary with the length", rows)
    # CP=2 keeps the whole sequence's K and V, 2 x 16 values per K/V head and token of the
    # sequence, 2 x 2 x 16 bf16 bytes per token of a rank's share, more than CP=1's local ones
    assert two.pop() > one.pop(), rows
    assert "| siamese-32k.toml | 32,768 | 2 | 32 | 4.00 |" in out, out


def test_the_exchange_is_the_shape_arithmetic():
    """siamese-32k at 64 GPUs: per layer and micro-batch K and V of 8 groups x 64 over 32,768
    tokens in bf16, half of it from the other rank, forward and backward, 16 layers, 128 /
    32 micro-batches per data-parallel rank."""
    config = load_config("configs/paper/long/siamese-32k.toml")
    expected = 2 * (8 * 64) * 32768 * 2 * (1 / 2) * 2 * 16 * (128 // 32)
    assert context_parallel_bytes(config, dp=32) == expected
    recompute = load_config("configs/paper/long/siamese-32k.toml", ["--parallel.recompute=full"])
    assert context_parallel_bytes(recompute, dp=32) == expected * 3 / 2  # forward twice
