"""A small real-text corpus, tokenizer and dataset, and a CLI runner, for the pretrain tests."""

from __future__ import annotations

import contextlib
import json
import os
import pydoc_data.topics
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from runtime.launcher import standalone_env
from tests import tiers
from tests.helpers import CPU_ONLY_ENV
from tests.zygote import torchrun, zygote

REPO = Path(__file__).resolve().parent.parent

# A tiny model: the demo's scheme at a size that trains in seconds on 2 cores.
TINY = [
    "--model.num_layers=2", "--model.hidden_size=64", "--model.num_attention_heads=4",
    "--model.ffn_hidden_size=128", "--model.seq_length=32", "--model.vocab_size=512",
    "--data.micro_batch_size=4", "--data.global_batch_size=8",
    "--optim.lr=3e-3", "--optim.warmup_steps=2", "--data.valid_samples=16",
    "--run.log_interval=1", "--logging.wandb_mode=disabled",
    # eager, though the demo compiles: a tiny run never pays compilation back, and the
    # compiled path has its own CLI tests (tests/model/test_compiled_blocks.py)
    "--kernels.compile=false",
]


def make_corpus(folder: Path) -> dict[str, str]:
    """Python's own documentation topics (always installed) as a JSONL corpus, then a 512-token
    tokenizer and a Megatron dataset made through the real CLI."""
    folder.mkdir(parents=True, exist_ok=True)
    corpus = folder / "topics.jsonl"
    with corpus.open("w") as f:
        for text in pydoc_data.topics.topics.values():
            f.write(json.dumps({"text": text}) + "\n")
    cli("train-tokenizer", str(corpus), "--output", str(folder / "tok"), "--vocab-size", "512")
    cli("prepare-data", str(corpus), "--tokenizer", str(folder / "tok.model"),
        "--output", str(folder / "topics"))
    return {"corpus": str(corpus), "tokenizer": str(folder / "tok.model"),
            "prefix": str(folder / "topics")}


# No test reaches the network: a Hub lookup (an lm-eval task's dataset) fails at once, the
# same on every machine, instead of depending on what the machine can reach.
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}


def env(gpu: bool = False, **extra: str) -> dict[str, str]:
    """The environment of a CLI child process, offline (:data:`OFFLINE`). On the CPU whatever
    this machine has, unless ``gpu``: most tests check CPU behaviour exactly (bit-identical
    resumes, fp32 losses) and many start several ranks; tests/pretrain/test_gpu_e2e.py runs
    the same CLI on a GPU."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**standalone_env(), "PYTHONPATH": path, "OMP_NUM_THREADS": "1", **OFFLINE,
            **({} if gpu else CPU_ONLY_ENV), **extra}


def cli(*args: str, check: bool = True, nproc: int = 1, extra_env: dict | None = None,
        timeout: int = 300, gpu: bool = False) -> subprocess.CompletedProcess:
    """``python -m pretrain ARGS`` (through torchrun with ``nproc`` ranks when > 1), on the CPU
    unless ``gpu``. On the CPU in the usual environment the process, or each rank as torchrun
    would start it, is forked from tests/zygote.py, which has done the imports already;
    ``--verbose`` shows import-time notices, so it starts afresh."""
    environ = env(gpu, **(extra_env or {}))
    server = zygote(environ) if not gpu and not extra_env and "--verbose" not in args else None
    if server is not None and server.takes(environ, REPO):
        tiers.require("slow", f"starts a process (python -m pretrain {args[0]})")
        done = server.run(list(args), environ, timeout, nproc)
    else:
        done = subprocess.run([sys.executable, *torchrun(nproc), "-m", "pretrain", *args], cwd=REPO,
                              env=environ, capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise AssertionError(f"{' '.join(args)} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return done


def run_logged(module: str, args: list[str], log: Path, timeout: int = 300,
               nproc: int = 1) -> int:
    """``python -m MODULE ARGS`` (a test's wrapper of the CLI: ``tests.kill_in_save``,
    ``tests.inject_spikes``; through torchrun with ``nproc`` ranks when > 1) with its output
    in ``log``; its exit status. Whatever it leaves in its process group is killed once it
    ended: megatron's checkpoint writer leaves a helper process behind a SIGKILLed trainer
    (on a cluster the job's cgroup reaps it). Forked from tests/zygote.py when it can be,
    else in a session of its own."""
    environ = env()
    server = zygote(environ)
    if server.takes(environ, REPO):
        tiers.require("slow", f"starts a process (python -m {module})")
        return server.run(args, environ, timeout, nproc, module=module, log=log).returncode
    proc = in_session([sys.executable, *torchrun(nproc), "-m", module, *args], log)
    try:
        return proc.wait(timeout=timeout)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def popen(args: list[str], gpu: bool = False) -> subprocess.Popen:
    """``python -m pretrain ARGS`` started in the background, output captured."""
    return subprocess.Popen([sys.executable, "-m", "pretrain", *args], cwd=REPO, env=env(gpu),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def in_session(cmd: list[str], log: Path, extra_env: dict | None = None,
               **popen_kwargs) -> subprocess.Popen:
    """``cmd`` in a session (and process group) of its own, output to ``log``: a signal can
    then go to its whole group, as a terminal (Ctrl-C) or slurm sends it, and nothing else."""
    with log.open("w") as out:
        return subprocess.Popen(cmd, cwd=REPO, env=env(**(extra_env or {})), stdout=out,
                                stderr=out, start_new_session=True, **popen_kwargs)


def wait_for(condition, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def catches(pid: int, sig: signal.Signals) -> bool:
    """Whether process ``pid`` has installed a handler for ``sig`` (Linux /proc)."""
    status = Path(f"/proc/{pid}/status").read_text()
    mask = int(re.search(r"^SigCgt:\s*([0-9a-f]+)$", status, re.M).group(1), 16)
    return bool(mask >> (sig - 1) & 1)


def signal_during_start_up(args: list[str], sig: signal.Signals,
                           gpu: bool = False) -> subprocess.Popen:
    """Start ``args`` and send ``sig`` as soon as the CLI catches it, i.e. while torch and
    megatron are still loading; returns the finished process (output in .stdout/.stderr)."""
    proc = popen(args, gpu)
    wait_for(lambda: proc.poll() is not None or catches(proc.pid, sig), "the handler")
    proc.send_signal(sig)
    proc.stdout_text, proc.stderr_text = proc.communicate(timeout=300)
    return proc


def train_args(data: dict, run_dir: Path, *extra: str) -> list[str]:
    return ["train", "--config", str(REPO / "configs" / "demo-cpu.toml"), *TINY,
            f"--data.prefixes=[\"{data['prefix']}\"]", f"--data.tokenizer={data['tokenizer']}",
            f"--run.dir={run_dir}", *extra]


def metrics(run_dir: Path) -> list[dict]:
    """The records of metrics.jsonl, which must be strict JSON (no bare NaN or Infinity)."""
    def reject(constant: str):
        raise AssertionError(f"metrics.jsonl holds {constant}, which is not JSON")

    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line, parse_constant=reject) for line in lines]


def train_losses(run_dir: Path) -> dict[int, float]:
    """Training loss per step (the last record of each step wins, see pretrain.report.metrics)."""
    return {r["step"]: r["loss"] for r in metrics(run_dir) if "loss" in r}


def val_losses(run_dir: Path) -> list[float]:
    return [r["val_loss"] for r in metrics(run_dir) if "val_loss" in r]


def killed_in_save_then_resumed(args: list[str], step: int, run: Path, latest: str,
                                log: Path, nproc: int = 1) -> None:
    """``python -m pretrain ARGS`` (run folder ``run``; ``nproc`` ranks under torchrun)
    SIGKILLed after megatron wrote step ``step``'s tensors, before that checkpoint was
    complete (tests/kill_in_save.py), which leaves ``latest`` the newest checkpoint; then run
    again to the end: the caller compares what the resumed run did with an uninterrupted
    one. megatron's checkpoint writer may outlive the killed trainer: run_logged reaps it.
    Under torchrun every rank is killed in its save and torchrun exits with a failure."""
    code = run_logged("tests.kill_in_save", [str(step), *args], log, timeout=240, nproc=nproc)
    if nproc == 1:
        assert code == -signal.SIGKILL, log.read_text()[-2000:]
    else:
        text = log.read_text()  # the zygote's or torchrun's word for a rank's SIGKILL
        assert code != 0 and re.search(r"exited -9|SIGKILL", text), text[-2000:]
    assert (run / "checkpoints" / "latest").read_text() == latest
    cli(*args, nproc=nproc)
