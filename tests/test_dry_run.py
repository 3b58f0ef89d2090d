"""`train --dry-run` resolves a preset and reports sizes and layout without training."""

import re
from pathlib import Path

import pytest

from tests.pretrain_fixtures import cli

PRESETS = sorted((Path(__file__).parent.parent / "configs").glob("*.toml"))


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_every_preset_dry_runs(preset, tmp_path):
    done = cli("train", "--config", str(preset), "--dry-run", f"--run.dir={tmp_path / 'run'}")
    out = done.stdout
    assert "[model]" in out and "residual_scheme" in out
    params = int(re.search(r"parameters: ([\d,]+)", out).group(1).replace(",", ""))
    assert params > 0
    assert re.search(r"tokens per step: [\d,]+; steps: [\d,]+", out)
    assert "layout: world" in out
    assert not (tmp_path / "run").exists(), "a dry run must not create the run folder"


def test_dry_run_reflects_overrides_and_layout():
    done = cli("train", "--config", "configs/demo-cpu.toml", "--dry-run",
               "--model.residual_scheme=pre", "--parallel.tp=2", "--data.global_batch_size=64",
               extra_env={"WORLD_SIZE": "8"})
    out = done.stdout
    assert 'residual_scheme = "pre"' in out
    assert "world 8 = tp 2 x pp 1 x dp 4" in out
    assert "tokens per step: 8,192" in out  # 64 sequences x 128 tokens
