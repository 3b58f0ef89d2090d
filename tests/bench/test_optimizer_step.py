"""bench.optimizer_step at a tiny size: one row per width, Muon's parameters exactly the block
matrices (QKV 3h^2, projection h^2, SwiGLU fc1 8h^2 and fc2 4h^2 per block), both times
measured."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.pretrain_fixtures import REPO

pytestmark = pytest.mark.slow  # its own process: the benchmark opens its process group


def test_the_table_has_a_row_per_width_with_muons_share():
    out = subprocess.run([sys.executable, "-m", "bench.optimizer_step", "--widths", "32,64",
                          "--layers", "2", "--steps", "1", "--seq", "16", "--vocab", "256"],
                         cwd=REPO, capture_output=True, text=True, check=True, timeout=300).stdout
    rows = [line for line in out.splitlines() if line.startswith("| 2 x")]
    assert [r.split("|")[1].strip() for r in rows] == ["2 x 32", "2 x 64"]
    for row, width in zip(rows, (32, 64), strict=True):
        cells = [c.strip() for c in row.split("|")[2:-1]]
        assert int(cells[1].replace(",", "")) == 2 * 16 * width * width
        assert float(cells[2]) > 0 and float(cells[3]) > 0
