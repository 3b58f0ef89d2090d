"""End-to-end pretraining through the real CLI: training, resume, parallel layouts, W&B."""

import json
import math
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.pretrain_fixtures import (
    REPO,
    cli,
    env,
    metrics,
    run_logged,
    train_args,
    train_losses,
    val_losses,
)
from tests.wandb_reader import read_run

STEPS = 20


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory):
    """An uninterrupted single-process run of STEPS steps."""
    run = tmp_path_factory.mktemp("reference") / "run"
    cli(*train_args(data, run, f"--run.steps={STEPS}", "--run.eval_interval=100"))
    return run


def test_training_lowers_validation_loss_and_fills_run_folder(data, reference):
    first, last = val_losses(reference)[0], val_losses(reference)[-1]
    assert last < first - 0.1, (first, last)
    assert {r["val_samples"] for r in metrics(reference) if "val_loss" in r} == {16}
    steps = [r for r in metrics(reference) if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    for key in ("consumed_tokens", "lr", "grad_norm", "tokens_per_s"):
        assert all(math.isfinite(r[key]) for r in steps), key
    assert steps[-1]["consumed_tokens"] == STEPS * 8 * 32
    assert (reference / "config.toml").is_file() and (reference / "versions.json").is_file()
    assert (reference / "checkpoints" / "latest").read_text() == f"step_{STEPS:08d}"


def test_eval_command_reports_checkpoint_perplexity(data, reference, tmp_path):
    """`eval` reproduces the run's final validation, and gives exactly the same result under
    a config of another run length, evaluation interval and run folder (one fixed validation
    set); both results go to the checkpoint's run folder, never to the config's."""
    results = []
    elsewhere = tmp_path / "other-run"
    elsewhere.mkdir()
    for extra in ([], ["--run.steps=5000", "--run.eval_interval=1", f"--run.dir={elsewhere}"]):
        done = cli("eval", "--config", str(Path(reference) / "config.toml"),
                   "--checkpoint", str(reference / "checkpoints"), *extra)
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    result = results[0]
    assert result["checkpoint"].endswith(f"step_{STEPS:08d}")
    assert result["val_ppl"] == pytest.approx(math.exp(result["val_loss"]))
    assert result["val_loss"] == pytest.approx(val_losses(reference)[-1], rel=1e-6)
    assert result["val_samples"] == 16  # TINY's data.valid_samples, logged with the loss
    assert results[1] == result
    logged = [json.loads(line) for line in (reference / "eval.jsonl").read_text().splitlines()]
    assert logged[-2:] == results
    assert not (elsewhere / "eval.jsonl").exists()


def _wait_for_step(run: Path, step: int, proc: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if (run / "metrics.jsonl").is_file() and any(
                r.get("step", 0) >= step and "loss" in r for r in metrics(run)):
            return
        assert proc.poll() is None, "the run ended before it could be signalled"
        time.sleep(0.2)
    raise AssertionError(f"run never reached step {step}")


def test_sigterm_then_resume_reproduces_every_loss(data, reference, tmp_path):
    run = tmp_path / "run"
    args = train_args(data, run, f"--run.steps={STEPS}", "--run.eval_interval=100")
    log = tmp_path / "stopped.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "pretrain", *args], cwd=REPO, env=env(),
                                stdout=out, stderr=out)
        _wait_for_step(run, 2, proc)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0, log.read_text()[-2000:]
    stopped_at = int((run / "checkpoints" / "latest").read_text().split("_")[1])
    assert 2 <= stopped_at < STEPS
    cli(*args)
    assert train_losses(run) == train_losses(reference)  # exact, step by step


def test_sigkill_during_save_resumes_from_previous_checkpoint(data, reference, tmp_path):
    run = tmp_path / "run"
    args = train_args(data, run, f"--run.steps={STEPS}", "--run.eval_interval=100",
                      "--run.save_interval=3")
    # megatron's checkpoint writer leaves a helper process that outlives a SIGKILLed parent:
    # run_logged reaps it
    code = run_logged("tests.kill_in_save", ["6", *args], tmp_path / "killed.log", timeout=240)
    assert code == -signal.SIGKILL, (tmp_path / "killed.log").read_text()[-2000:]
    ckpts = run / "checkpoints"
    assert (ckpts / "latest").read_text() == "step_00000003"
    assert (ckpts / ".step_00000006.tmp").is_dir()  # the half-written save
    cli(*args)
    assert train_losses(run) == train_losses(reference)
    assert not (ckpts / ".step_00000006.tmp").exists()
    # run.keep_last = 2 (demo preset): only the two newest complete checkpoints remain.
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_00000018", "step_00000020"]


@pytest.mark.slow
def test_tp2_pp2_match_single_process_and_checkpoints_reshard(data, reference, tmp_path):
    """From the same weights, TP=2 and PP=2 (gloo) follow the single-process losses; a TP=2
    checkpoint resumes at TP=1 and at PP=2 with the same losses."""
    init = f"--run.init_from={reference / 'checkpoints'}"
    common = ["--run.steps=6", "--data.valid_samples=0", "--run.save_interval=3", init]
    runs = {}
    for name, layout, nproc in (("single", [], 1), ("tp2", ["--parallel.tp=2"], 2),
                                ("pp2", ["--parallel.pp=2"], 2)):
        runs[name] = tmp_path / name
        done = cli(*train_args(data, runs[name], *common, *layout), nproc=nproc)
        # Only the rank holding the loss prints progress and the result, once.
        assert done.stdout.count("{") == 1, done.stdout
        assert sum(line.startswith("[pretrain] step 6/6") for line in
                   done.stderr.splitlines()) == 1, done.stderr[-2000:]
    single = train_losses(runs["single"])
    for name in ("tp2", "pp2"):
        other = train_losses(runs[name])
        assert other.keys() == single.keys()
        for step, loss in single.items():
            assert other[step] == pytest.approx(loss, rel=1e-5), (name, step)
    # Resume the TP=2 run's step-3 checkpoint under TP=1 and under PP=2.
    tp2 = train_losses(runs["tp2"])
    for name, layout, nproc in (("tp1", [], 1), ("pp2", ["--parallel.pp=2"], 2)):
        run = tmp_path / f"resume-{name}"
        (run / "checkpoints").mkdir(parents=True)
        shutil.copytree(runs["tp2"] / "checkpoints" / "step_00000003",
                        run / "checkpoints" / "step_00000003")
        cli(*train_args(data, run, *common, *layout), nproc=nproc)
        resumed = train_losses(run)
        assert sorted(resumed) == [4, 5, 6]
        for step in (4, 5, 6):
            assert resumed[step] == pytest.approx(tp2[step], rel=1e-5), (name, step)


@pytest.mark.parametrize("layout", ["--parallel.tp=2", "--parallel.pp=2"])
def test_eval_reads_a_checkpoint_of_any_layout_in_one_process(data, tmp_path, layout):
    """A checkpoint trained on two ranks is evaluated in one process with no layout flag:
    the checkpoint's layout does not fit one process, so eval says it runs on TP = PP = 1,
    and gives the run's own last validation loss."""
    run = tmp_path / "run"
    cli(*train_args(data, run, "--run.steps=3", layout), nproc=2)
    done = cli("eval", "--checkpoint", str(run / "checkpoints"))
    tp, pp = (2, 1) if "tp" in layout else (1, 2)
    assert (f"the checkpoint's layout (parallel.tp {tp} x parallel.pp {pp}) does not fit 1 "
            "process: evaluating with parallel.tp 1 and parallel.pp 1 (checkpoints reshard "
            "on load)") in done.stderr, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["val_loss"] == pytest.approx(val_losses(run)[-1], rel=1e-5)


def test_wandb_offline_run_holds_metrics_and_resume_continues_it(data, tmp_path):
    run = tmp_path / "run"
    base = ["--logging.wandb_mode=offline", "--run.eval_interval=100"]
    cli(*train_args(data, run, "--run.steps=3", *base))
    cli(*train_args(data, run, "--run.steps=5", "--optim.override_schedule=true",
                    *base))  # resumes from step 3
    files = sorted((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2
    assert len({f.name for f in files}) == 1, "the resumed run must reuse the W&B run id"
    config, history = read_run(files[0])
    assert config["model"]["residual_scheme"] == "siamese"
    logged = {row["_step"]: row["loss"] for row in history if "loss" in row}
    expected = train_losses(run)
    assert logged == {s: expected[s] for s in (1, 2, 3)}
    _, resumed = read_run(files[1])
    assert {row["_step"] for row in resumed if "loss" in row} == {4, 5}


def test_diverging_run_skips_nonfinite_steps_then_aborts(data, tmp_path):
    """An absurd learning rate blows the weights up: the following steps have non-finite
    gradients, are skipped and counted, and the run aborts with exit code 3."""
    run = tmp_path / "run"
    done = cli(*train_args(data, run, "--run.steps=10", "--optim.lr=1e30",
                           "--optim.min_lr=0", "--optim.warmup_steps=1",
                           "--guard.max_skipped=2", "--data.valid_samples=0"), check=False)
    assert done.returncode == 3, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: 2 consecutive steps had a NaN/Inf loss or gradient"), last
    rows = [r for r in metrics(run) if "loss" in r]
    assert [r["skipped_steps"] for r in rows[-2:]] == [1, 2]
    # Norms keep the loss finite here; the gradients overflow, and no update was applied:
    # the non-finite values are written as null (metrics() rejects a bare NaN).
    assert all(r["loss"] is None or r["grad_norm"] is None for r in rows[-2:])


def test_blended_prefixes_train(data, tmp_path):
    """Two datasets blended 3:1 through megatron's BlendedMegatronDatasetBuilder; the second
    is small, so its split keeps a 10% validation share (2 of 20 documents)."""
    second = tmp_path / "second"
    lines = Path(data["corpus"]).read_text().splitlines()[:20]
    (tmp_path / "part.jsonl").write_text("\n".join(lines) + "\n")
    cli("prepare-data", str(tmp_path / "part.jsonl"), "--tokenizer", data["tokenizer"],
        "--output", str(second))
    run = tmp_path / "run"
    cli(*train_args(data, run, "--run.steps=3", "--data.split=90,10,0",
                    f"--data.prefixes=[\"{data['prefix']}\", \"{second}\"]",
                    "--data.weights=[3, 1]"), timeout=240)
    assert len(train_losses(run)) == 3
    assert all(math.isfinite(v) for v in val_losses(run))


@pytest.mark.parametrize("distributed", [True, False], ids=["distributed", "optimizer"])
def test_a_new_peak_lr_on_resume_follows_the_new_schedule(data, tmp_path, distributed):
    """The user's path: a lower optim.lr on resume is refused with the advice, and the advice
    taken resumes on the new schedule under either optimizer (it used to end in a KeyError or
    "Could not find parameter group"). Every schedule field, in process:
    tests/pretrain/run/test_schedule_on_resume.py."""
    run, steps = tmp_path / "lowered", 3
    chosen = [f"--parallel.distributed_optimizer={str(distributed).lower()}",
              "--data.valid_samples=0"]
    cli(*train_args(data, run, f"--run.steps={steps}", *chosen))
    lowered = train_args(data, run, f"--run.steps={steps + 2}", "--optim.lr=1e-3", *chosen)
    if distributed:  # the refusal's advice is the same for both
        refused = cli(*lowered, check=False)
        assert refused.returncode == 2
        assert (f"run.dir '{run}' holds a run at step {steps} that this start would resume, "
                "with another schedule (optim.lr 0.003 -> 0.001, run.steps 3 -> 5); for a "
                "new run choose another --run.dir, or set --optim.override_schedule=true to "
                "continue that run on the new schedule") in refused.stderr
    done = cli(*lowered, "--optim.override_schedule=true")
    assert f"resumed with optim.lr = 0.001 (was 0.003 until step {steps})" in done.stderr
    lrs = {r["step"]: r["lr"] for r in metrics(run) if "lr" in r}
    peak, low, warmup = 1e-3, 3e-4, 2  # the new lr, the demo's min_lr, TINY's warm-up
    progress = (steps - warmup) / (steps + 2 - warmup)
    expected = low + 0.5 * (1 + math.cos(math.pi * progress)) * (peak - low)
    assert lrs[steps + 1] == pytest.approx(expected, rel=1e-6)


def test_a_new_run_in_another_runs_folder_hears_that_first_and_the_advice_works(data,
                                                                                tmp_path):
    """A user's new run pointed at an old run's folder with other schedule settings: the
    refusal says the folder holds a run it would resume before it offers the override; the
    first advice (another --run.dir) starts a new run, with nothing of the old one touched."""
    old = tmp_path / "old"
    cli(*train_args(data, old, "--run.steps=3", "--data.valid_samples=0"))
    before = sorted(p.name for p in (old / "checkpoints").iterdir())
    mine = ["--run.steps=4", "--optim.lr=1e-3", "--data.valid_samples=0"]
    refused = cli(*train_args(data, old, *mine), check=False)
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines()[-1] == (
        f"error: run.dir '{old}' holds a run at step 3 that this start would resume, with "
        "another schedule (optim.lr 0.003 -> 0.001, run.steps 3 -> 4); for a new run choose "
        "another --run.dir, or set --optim.override_schedule=true to continue that run on "
        "the new schedule")
    assert sorted(p.name for p in (old / "checkpoints").iterdir()) == before
    new = tmp_path / "new"
    done = cli(*train_args(data, old, *mine), f"--run.dir={new}")
    assert f"run folder: {new}; starting at step 0" in done.stderr
    assert sorted(train_losses(new)) == [1, 2, 3, 4]


def test_extending_a_finished_run_needs_and_follows_the_new_schedule(data, reference, tmp_path):
    """Resuming with more run.steps is refused unless optim.override_schedule is set; then the
    cosine decay is stretched to the new end instead of staying at min_lr."""
    run = tmp_path / "extended"
    shutil.copytree(reference, run)
    longer = train_args(data, run, f"--run.steps={STEPS + 4}", "--data.valid_samples=0")
    refused = cli(*longer, check=False)
    assert refused.returncode == 2
    assert f"with another schedule (run.steps {STEPS} -> {STEPS + 4})" in refused.stderr
    cli(*longer, "--optim.override_schedule=true")
    lrs = {r["step"]: r["lr"] for r in metrics(run) if "lr" in r}
    assert sorted(lrs)[-4:] == list(range(STEPS + 1, STEPS + 5))
    peak, low, warmup = 3e-3, 3e-4, 2  # TINY's lr and warm-up, the demo's min_lr
    progress = (STEPS - warmup) / (STEPS + 4 - warmup)
    expected = low + 0.5 * (1 + math.cos(math.pi * progress)) * (peak - low)
    assert lrs[STEPS + 1] == pytest.approx(expected, rel=1e-6)
