"""The preloaded interpreter stands in for ``python -m pretrain`` only where nothing tells them
apart: same output, same exit status, a timeout that ends the child and what it started, and
a real process for any environment it was not started with."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.pretrain_fixtures import REPO, env, train_args
from tests.zygote import Zygote, zygote

pytestmark = pytest.mark.slow


def fresh(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pretrain", *args], cwd=REPO, env=env(),
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args", [
    ["explain", "optim.lr"],            # exit 0, stdout
    ["explain", "optim.lrr"],           # a user mistake: one line on stderr, exit 2
    ["train", "--model.hidden_size=-1"],
])
def test_a_forked_child_answers_as_a_fresh_interpreter(args):
    server = zygote(env())
    assert server.takes(env(), REPO)
    forked, real = server.run(args, env(), timeout=120), fresh(*args)
    assert (forked.returncode, forked.stdout, forked.stderr) == \
        (real.returncode, real.stdout, real.stderr)


def test_a_timeout_ends_the_child_and_the_server_serves_on(data, tmp_path):
    """A run far longer than its timeout is killed with its process group; the server reaps
    it and takes the next request."""
    server = zygote(env())
    with pytest.raises(subprocess.TimeoutExpired):
        server.run(train_args(data, tmp_path / "run", "--run.steps=1000000"), env(), timeout=4)
    children = Path(f"/proc/{server.server.pid}/task/{server.server.pid}/children")
    deadline = time.monotonic() + 10
    while children.read_text().strip():
        assert time.monotonic() < deadline, "the timed-out child is still there"
        time.sleep(0.05)
    assert server.takes(env(), REPO)
    assert server.run(["explain", "optim.lr"], env(), timeout=60).returncode == 0


def test_another_environment_gets_a_server_started_with_it():
    """A test process may change its own environment; the next request then gets a new
    server started with it, never one whose imports read another."""
    first = zygote(env())
    assert first.takes({**env(), "PYTEST_CURRENT_TEST": "elsewhere"}, REPO)
    assert not first.takes(env(WANDB_SILENT="true"), REPO)
    assert not first.takes(env(), REPO / "tests")
    other = zygote(env(WANDB_SILENT="true"))
    assert other is not first and first.server.poll() is not None
    assert other.takes(env(WANDB_SILENT="true"), REPO)
    answer = other.run(["explain", "optim.lr"], env(WANDB_SILENT="true"), timeout=60)
    assert answer.returncode == 0
    assert zygote(env()).takes(env(), REPO)


def test_the_server_ends_with_its_caller():
    """Started by a process that then dies, the server does not outlive it."""
    code = ("from tests.pretrain_fixtures import env\n"  # REPO is on env()'s PYTHONPATH
            "from tests.zygote import zygote\n"
            "z = zygote(env()); print(z.server.pid, z.ready, flush=True)\n"
            "import os; os._exit(0)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env(),
                          capture_output=True, text=True, timeout=120)
    pid, ready = done.stdout.split()
    assert ready == "True", done.stderr
    deadline = time.monotonic() + 10
    while _alive(int(pid)):
        assert time.monotonic() < deadline, "the server outlived its caller"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = open(f"/proc/{pid}/stat").read()
    return stat.split(")")[-1].split()[0] != "Z"


@pytest.mark.parametrize("noise", [{"PYTHONVERBOSE": "1"}, {"OMP_NUM_THREADS": "2"}],
                         ids=["imports-print", "threads"])
def test_a_server_whose_imports_print_or_start_threads_refuses_to_serve(noise):
    """Imports that print (here Python's own import trace) would be output a fresh process
    shows and a forked child would not; a thread started by an import (here OpenMP's pool)
    would be missing in every forked child. Either way the server refuses, and
    ``cli()`` starts fresh interpreters."""
    server = Zygote(env(**noise))
    try:
        assert not server.ready and not server.takes(env(**noise), REPO)
    finally:
        server.close()
