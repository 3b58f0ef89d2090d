"""The routers watched through the real CLI: a tiny mixture-of-experts run logs its balancing
and z losses and its experts' loads to metrics.jsonl, experts.jsonl, W&B and the console, the
counts add up to the global batch, the report draws them; a dense run has none of it; and
pipeline, data x expert and tensor (sequence) parallel runs log what one process logs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.pretrain_fixtures import cli, metrics, train_args
from tests.wandb_reader import read_run

EXPERTS, TOPK, CAPACITY = 4, 2, 1.0
TOKENS = 8 * 32  # TINY's global batch x sequence length
MOE = [f"--model.num_experts={EXPERTS}", f"--model.moe_router_topk={TOPK}",
       "--model.moe_z_loss_coeff=1e-3", f"--model.moe_expert_capacity_factor={CAPACITY}"]
FIELDS = {"moe_aux_loss", "moe_z_loss", "moe_max_load", "moe_min_load", "moe_dropped",
          "moe_load/block00", "moe_load/block01"}


def _experts(run: Path) -> dict[int, dict]:
    """experts.jsonl by step (the last line of each step, as with metrics.jsonl)."""
    lines = [json.loads(line) for line in (run / "experts.jsonl").read_text().splitlines()]
    return {line["step"]: line for line in lines}


def _trained(records: list[dict]) -> list[dict]:
    return [r for r in records if "loss" in r]


@pytest.fixture(scope="module")
def moe_run(data, tmp_path_factory):
    """Four steps of a 2-block model with 4 experts, top-2, a z-loss and a capacity factor
    of 1 (so experts drop tokens), validation in between, W&B offline."""
    run = tmp_path_factory.mktemp("experts") / "run"
    done = cli(*train_args(data, run, *MOE, "--run.steps=4", "--run.eval_interval=2",
                           "--logging.wandb_mode=offline"))
    return run, done


@pytest.mark.slow
def test_the_counts_add_up_and_the_logged_numbers_are_theirs(moe_run):
    run, done = moe_run
    rows = _trained(metrics(run))
    counts = _experts(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and sorted(counts) == [1, 2, 3, 4]
    # a micro-batch of 4 x 32 tokens gives each expert at most 4 * 32 * 2 / 4 = 64
    capacity_per_step = 2 * 64
    for row in rows:
        assert FIELDS <= set(row), sorted(FIELDS - set(row))
        line = counts[row["step"]]
        assert line["tokens"] == TOKENS and line["topk"] == TOPK
        assert sorted(line["received"]) == sorted(line["dropped"]) == ["0", "1"]
        routed = dropped = 0
        for block, received in line["received"].items():
            assert len(received) == EXPERTS and max(received) <= capacity_per_step
            assert sum(received) + line["dropped"][block] == TOKENS * TOPK
            mean = sum(received) / EXPERTS
            assert row[f"moe_load/block{int(block):02d}"] == pytest.approx(max(received) / mean)
            routed += TOKENS * TOPK
            dropped += line["dropped"][block]
        assert routed == TOKENS * TOPK * 2  # every MoE block routed the whole global batch
        assert row["moe_dropped"] == pytest.approx(dropped / routed)
        assert row["moe_max_load"] == max(row["moe_load/block00"], row["moe_load/block01"])
        assert row["moe_min_load"] == pytest.approx(min(
            min(r) / (sum(r) / EXPERTS) for r in line["received"].values()))
        assert 0.5 < row["moe_aux_loss"] < 2 and row["moe_z_loss"] > 0
    assert any(r["moe_dropped"] > 0 for r in rows)  # the capacity factor did drop
    assert [r["step"] for r in metrics(run) if "val_loss" in r] == [0, 2, 4]
    # the console line, and no collapse in a healthy run
    lines = [line for line in done.stderr.splitlines() if "step 4/4" in line]
    assert len(lines) == 1
    assert f" aux {rows[-1]['moe_aux_loss']:.4f} load {rows[-1]['moe_max_load']:.2f} " in lines[0]
    assert "collapsed" not in done.stderr
    # W&B holds the same numbers at the same steps
    (wandb_file,) = sorted((run / "wandb").glob("offline-run-*/run-*.wandb"))
    _, history = read_run(wandb_file)
    for row in rows:
        (logged,) = [h for h in history if h["_step"] == row["step"] and "loss" in h]
        for key in FIELDS:
            assert logged[key] == pytest.approx(row[key], rel=1e-12), key
        # and every expert's load, which metrics.jsonl leaves to experts.jsonl
        for block, received in counts[row["step"]]["received"].items():
            mean = sum(received) / EXPERTS
            for expert, count in enumerate(received):
                key = f"moe_expert_load/block{int(block):02d}/e{expert:02d}"
                assert logged[key] == pytest.approx(count / mean, rel=1e-12), key
                assert key not in row


@pytest.mark.slow
def test_the_report_draws_the_routers(moe_run, tmp_path):
    run, _ = moe_run
    cli("report", str(run), "--output", str(tmp_path))
    assert (tmp_path / "experts.png").is_file() and (tmp_path / "expert_load.png").is_file()
    html = (tmp_path / "report.html").read_text()
    assert "Mixture of experts: router load and losses" in html
    assert "Load of each expert" in html and "the whole run, 4 logged steps (1-4)" in html


@pytest.mark.slow
def test_a_dense_run_has_no_expert_field_file_line_or_panel(data, tmp_path):
    run = tmp_path / "dense"
    done = cli(*train_args(data, run, "--run.steps=2", "--optim.warmup_steps=1",
                                "--data.valid_samples=0"))
    assert [r["step"] for r in metrics(run)] == [1, 2]
    assert not [k for r in metrics(run) for k in r if k.startswith("moe")]
    assert not (run / "experts.jsonl").exists()
    assert not [line for line in done.stderr.splitlines() if " aux " in line or " load " in line]
    cli("report", str(run))
    assert not (run / "report" / "experts.png").exists()
    assert not (run / "report" / "expert_load.png").exists()


@pytest.mark.slow
def test_pipeline_data_expert_and_tensor_parallel_runs_log_the_single_process_values(
        data, moe_run, tmp_path):
    """From the same weights, one step: PP=2 (each stage holds one MoE block, the last one
    logs) and DP=2 with EP=2 (each rank routes half the batch to experts split over both) log
    the numbers one process logs, the counts exactly. TP=2 with sequence parallelism (each
    rank routes half of every sequence) logs the same losses, and counts that add up to the
    same batch; what the capacity factor drops differs, since megatron applies it to each
    rank's slice of the micro-batch."""
    run, _ = moe_run
    common = [*MOE, "--run.steps=1", "--optim.warmup_steps=0", "--data.valid_samples=0",
              f"--run.init_from={run / 'checkpoints' / 'step_00000004'}"]
    logged = {}
    for name, layout, nproc in (("single", [], 1), ("pp2", ["--parallel.pp=2"], 2),
                                ("dp2ep2", ["--parallel.ep=2"], 2),
                                ("tp2sp", ["--parallel.tp=2",
                                           "--parallel.sequence_parallel=true"], 2)):
        cli(*train_args(data, tmp_path / name, *common, *layout), nproc=nproc)
        (row,) = _trained(metrics(tmp_path / name))
        logged[name] = (row, _experts(tmp_path / name)[1])
    reference, counts = logged["single"]
    for name in ("pp2", "dp2ep2"):
        row, line = logged[name]
        assert line == counts, name
        for key in FIELDS:
            assert row[key] == pytest.approx(reference[key], rel=1e-5), (name, key)
    row, line = logged["tp2sp"]
    # Split matrix products round otherwise, which can flip a near tie of the top-k choice
    # (seen: 6e-4 on the balancing loss); a loss left unreduced over TP would be half.
    assert row["moe_z_loss"] == pytest.approx(reference["moe_z_loss"], rel=1e-4)
    assert row["moe_aux_loss"] == pytest.approx(reference["moe_aux_loss"], rel=5e-3)
    assert line["tokens"] == TOKENS and sorted(line["received"]) == ["0", "1"]
    for block, received in line["received"].items():
        assert sum(received) + line["dropped"][block] == TOKENS * TOPK


@pytest.mark.slow
def test_the_first_lines_name_the_experts(moe_run):
    """The start line names the experts, the top-k, the MoE blocks and the active parameters
    (the total less the SwiGLU experts of width 128 a token skips in both blocks); the layout
    line the expert layout (pretrain.report.model_summary, as the dry run does)."""
    _, done = moe_run
    line = next(line for line in done.stderr.splitlines() if "training siamese: " in line)
    assert "parameters (2 layers x 64, 4 heads, 4 experts top-2 in 2 MoE blocks, " in line, line
    total = int(line.split("training siamese: ")[1].split(" parameters")[0].replace(",", ""))
    active = int(line.split("MoE blocks, ")[1].split(" active per token")[0].replace(",", ""))
    assert total - active == 2 * (EXPERTS - TOPK) * 3 * 64 * 128, line
    assert "layout: world 1 = tp 1 x pp 1 x dp 1; experts: ep 1 x etp 1 x pp 1 x expert dp 1; " \
        in done.stderr, done.stderr[:3000]
