"""`train --dry-run` resolves a preset and reports sizes and layout without training, then
runs every check a start makes: exit 0 where a start would begin, else the start's one
`error:` line and exit 2. The presets read data this machine does not have (the demo's is made
by `make demo`, the paper's by the cluster set-up), so here their refusals name a missing
tokenizer or dataset; tests/pretrain/test_pretrain_errors.py dry-runs with real data."""

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from pretrain.config import load_config
from pretrain.report.units import human
from tests.pretrain_fixtures import REPO, cli, env

pytestmark = pytest.mark.slow


def _is_preset(path: Path) -> bool:
    """Training configs, in sub-folders too. Not presets: bases that presets build on (named
    _*.toml) and sweep descriptions (a [sweep] table, read by lab.lr_sweep)."""
    return not path.name.startswith("_") and "sweep" not in tomllib.loads(path.read_text())


PRESETS = sorted(filter(_is_preset, (REPO / "configs").rglob("*.toml")))
PAPER = [p for p in PRESETS if p.is_relative_to(REPO / "configs" / "paper")]
GPUS = (8, 32, 64)  # the paper presets' layouts are for these GPU counts
GPU_MEMORY_GIB = 80 * 1e9 / 2**30
# The MoE presets whose activations (four streams) put them over 75% of an 80 GB GPU on 8 GPUs,
# where each rank holds all of its experts' optimizer state, by the estimate for the GPU nodes
# (megatron's fusions on); docs/moe.md advises full recomputation there, which
# test_moe_presets_dry_run_on_8_32_and_64_gpus runs.
RECOMPUTE_ON_8 = {str(REPO / "configs" / "paper" / "moe" / f"{scheme}-lr1e-3.toml")
                  for scheme in ("hc",)}


def _check_report(out: str) -> float:
    """The dry run's report holds what a user needs before launching; returns the memory total."""
    assert "[model]" in out and "residual_scheme" in out
    params = int(re.search(r"parameters: ([\d,]+)", out).group(1).replace(",", ""))
    assert params > 0
    assert re.search(r"tokens per step: [\d,]+; steps: [\d,]+", out)
    assert "layout: world" in out
    memory = re.search(r"activations \(estimate\): [\d.]+ GiB; total about ([\d.]+) GiB", out)
    assert memory, out
    return float(memory.group(1))


def _check_verdict(status: int, err: str) -> None:
    """A start here passes, or is refused for the data or tokenizer this machine lacks."""
    if status != 0:
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert status == 2 and len(errors) == 1 and "does not exist" in errors[0], err[-2000:]
        assert "tokenizer" in errors[0] or "data file" in errors[0], errors


@pytest.mark.parametrize("preset", [p for p in PRESETS if p not in PAPER],
                         ids=lambda p: p.stem)
def test_every_preset_dry_runs(preset, tmp_path):
    done = cli("train", "--config", str(preset), "--dry-run", f"--run.dir={tmp_path / 'run'}",
               check=False)
    _check_report(done.stdout)
    _check_verdict(done.returncode, done.stderr)
    assert not (tmp_path / "run").exists(), "a dry run must not create the run folder"


# Every paper preset through the real `python -m pretrain train --dry-run` entry point, in one
# process: there are dozens (every residual scheme x every run), and a process per preset would
# spend most of its time importing torch and megatron. The dry run prints at the smallest
# recommended GPU count (the most memory per GPU); the larger ones re-check only the layout.
_PAPER_DRY_RUNS = """
import contextlib, io, json, os, sys
from pretrain.__main__ import main
from pretrain.config import load_config, validate
run_dir, gpus, out = sys.argv[2], [int(n) for n in sys.argv[3].split(",")], {}
user_env = {**os.environ, "WORLD_SIZE": sys.argv[1]}
for preset in sys.argv[4:]:
    os.environ.clear()  # each dry run starts as from the shell: its one-rank set-up sets RANK
    os.environ.update(user_env)
    report, errors = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(report), contextlib.redirect_stderr(errors):
        status = main(["train", "--config", preset, "--dry-run", f"--run.dir={run_dir}"])
    for world in gpus[1:]:
        validate(load_config(preset), world_size=world)
    out[preset] = [status, report.getvalue(), errors.getvalue()]
print(json.dumps(out))
"""


def test_every_paper_preset_dry_runs_and_fits_8_32_and_64_gpus(tmp_path):
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", _PAPER_DRY_RUNS, str(GPUS[0]), str(run_dir),
         ",".join(map(str, GPUS)), *map(str, PAPER)],
        cwd=REPO, env=env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    reports = json.loads(done.stdout.strip().splitlines()[-1])
    assert sorted(reports) == sorted(map(str, PAPER))
    for preset, (status, out, err) in reports.items():
        _check_verdict(status, err)
        if "/long/" in preset:  # a context extension: each sequence over cp ranks
            cp = load_config(preset).parallel.cp
            assert cp > 1 and (f"layout: world {GPUS[0]} = tp 1 x cp {cp} x pp 1 x dp "
                               f"{GPUS[0] // cp}") in out, preset
            assert f"each rank holds {load_config(preset).seq_length // cp:,} tokens" in out
        else:
            assert f"layout: world {GPUS[0]} = tp 1 x pp 1 x dp {GPUS[0]}" in out, preset
        if "/1.3b/" in preset:  # 8.0672e9 by Megatron-LM's own expression (test_throughput.py)
            assert "Megatron-LM's formula): 8.07 GFLOP" in out, preset
        memory = _check_report(out)
        if preset in RECOMPUTE_ON_8:  # docs/moe.md: these run with full recompute on 8 GPUs
            assert memory >= 0.75 * GPU_MEMORY_GIB, (f"{preset} fits 8 GPUs without "
                                                      f"recompute now: update docs/moe.md", out)
        else:
            assert memory < 0.75 * GPU_MEMORY_GIB, (preset, out)  # room for the rest
    assert not run_dir.exists(), "a dry run must not create the run folder"


# The MoE presets' memory falls with the world size (the experts' optimizer state is sharded
# over world / 8 expert data-parallel ranks), so the test above, at 8 GPUs, holds the largest;
# this one prints the other two for the highest (hc) and the paper's scheme, and runs the
# advice for the presets over the bound on 8 GPUs (RECOMPUTE_ON_8) exactly as docs/moe.md
# gives it.
_MOE_DRY_RUNS = """
import contextlib, io, json, os, sys
from pretrain.__main__ import main
out, user_env = {}, dict(os.environ)
for entry in sys.argv[2:]:
    world, preset, *overrides = entry.split(" ")
    os.environ.clear()
    os.environ.update({**user_env, "WORLD_SIZE": world})
    report, errors = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(report), contextlib.redirect_stderr(errors):
        status = main(["train", "--config", preset, "--dry-run", f"--run.dir={sys.argv[1]}",
                       *overrides])
    out[entry] = [status, report.getvalue(), errors.getvalue()]
print(json.dumps(out))
"""
RECOMPUTE_ADVICE = "--parallel.recompute=full"  # docs/moe.md, "Layouts on 8, 32 and 64 GPUs"


# A world size the layout cannot take (4 ranks for expert parallelism 8): the plan up to the
# layout, with the world sizes it takes, then the rule's one line (docs/training.md, "Dry run").
REFUSED = "4 configs/paper/moe/siamese-lr1e-3.toml"


def test_moe_presets_dry_run_on_8_32_and_64_gpus(tmp_path):
    runs = [f"{world} configs/paper/moe/{scheme}-lr1e-3.toml"
            for scheme in ("siamese", "hc") for world in (32, 64)]
    runs += [f"8 {Path(preset).relative_to(REPO)} {RECOMPUTE_ADVICE}"
             for preset in sorted(RECOMPUTE_ON_8)]
    runs.append(REFUSED)
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", _MOE_DRY_RUNS,
                           str(tmp_path / "run"), *runs],
                          cwd=REPO, env=env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    reports = json.loads(done.stdout.strip().splitlines()[-1])
    assert sorted(reports) == sorted(runs)
    status, out, err = reports.pop(REFUSED)
    assert status == 2 and err.startswith("error: world size (4) must be divisible by "
                                          "parallel.etp x parallel.ep x parallel.pp"), err
    assert len(err.strip().splitlines()) == 1, err
    assert "parameters: 15,260,227,584" in out and "13.60 GFLOP" in out, out
    assert out.strip().splitlines()[-1] == (
        "layout: tp 1 x pp 1 (experts: etp 1 x ep 8 x pp 1); world 4 does not fit it (below); "
        "world sizes it takes: 8, 16, 32, 64, 128, 256, 512, 1024"), out
    for entry, (status, out, err) in reports.items():
        world = int(entry.split(" ")[0])
        recompute = "full" if RECOMPUTE_ADVICE in entry else "none"
        _check_verdict(status, err)
        assert f"layout: world {world} = tp 1 x pp 1 x dp {world}, recompute {recompute}; " \
            f"experts: ep 8 x etp 1 x pp 1 x expert dp {world // 8}" in out, out
        assert re.search(r"active per token: 1,9[78]\d,", out) and "13.60 GFLOP" in out, out
        assert _check_report(out) < 0.75 * GPU_MEMORY_GIB, (entry, out)


def test_dry_run_reflects_overrides_and_layout():
    done = cli("train", "--config", "configs/demo-cpu.toml", "--dry-run",
               "--model.residual_scheme=pre", "--parallel.tp=2", "--data.global_batch_size=64",
               extra_env={"WORLD_SIZE": "8"}, check=False)
    _check_verdict(done.returncode, done.stderr)
    out = done.stdout
    assert 'residual_scheme = "pre"' in out
    assert "world 8 = tp 2 x pp 1 x dp 4" in out
    assert "tokens per step: 8,192" in out  # 64 sequences x 128 tokens


MOE = ["--model.num_experts=8", "--model.moe_router_topk=2", "--model.moe_ffn_hidden_size=96",
       "--model.moe_shared_expert_intermediate_size=256", "--model.moe_layer_freq=[1,0,1,0,1,1]",
       "--parallel.ep=2", "--data.micro_batch_size=8"]


def test_dry_run_counts_what_the_built_moe_model_holds(single_rank):
    """The dry run's total is the parameters of the model a run builds (count_parameters), its
    active count the total less the routed experts a token skips: 4 MoE blocks x (8 - 2)
    experts x 3 x 128 x 96 (SwiGLU experts of width 96 at hidden 128) fewer."""
    from model.builder import build_model, count_parameters
    from model.config import ParallelConfig
    from pretrain.config import load_config

    done = cli("train", "--config", "configs/demo-cpu.toml", "--dry-run", *MOE,
               extra_env={"WORLD_SIZE": "4"}, check=False)
    _check_verdict(done.returncode, done.stderr)
    config = load_config("configs/demo-cpu.toml", MOE)
    total = count_parameters(build_model(config.model, ParallelConfig(), seed=1))
    active = total - 4 * (8 - 2) * 3 * 128 * 96
    assert f"parameters: {total:,} ({human(total)}); active per token: {active:,} " in \
        done.stdout, done.stdout
    assert "top-2 of 8 routed experts and the shared expert in 4 MoE blocks; routed experts " \
        f"{4 * 8 * 3 * 128 * 96:,}" in done.stdout
    assert "layout: world 4 = tp 1 x pp 1 x dp 4, recompute none; experts: ep 2 x etp 1 x pp 1 " \
        "x expert dp 2" in done.stdout



def test_the_dry_run_gives_muon_the_block_matrices():
    """With optim.name muon the optimizer-state line names the parameters Muon steps: every
    block's linear weights (6 blocks x 16 x 1024^2: QKV, projection, SwiGLU fc1 and fc2 at
    ffn 4 x 1024), and their state is smaller than AdamW's for the same model."""
    common = ["train", "--config", "configs/demo-cpu.toml", "--dry-run",
              "--parallel.distributed_optimizer=false", "--model.hidden_size=1024",
              "--model.ffn_hidden_size=4096"]
    runs = {name: cli(*common, f"--optim.name={name}", extra_env={"WORLD_SIZE": "2"},
                      check=False) for name in ("muon", "adamw")}
    for done in runs.values():
        _check_verdict(done.returncode, done.stderr)
    assert f"(Muon: one momentum for the block matrices' {6 * 16 * 1024 * 1024:,} parameters, " \
        "AdamW's two moments for the rest)" in runs["muon"].stdout, runs["muon"].stdout

    def state(out: str) -> float:
        line = next(x for x in out.splitlines() if "optimizer state:" in x)
        return float(line.split("optimizer state: ")[1].split(" GiB")[0])

    assert state(runs["muon"].stdout) < state(runs["adamw"].stdout)
