"""The preloaded interpreter stands in for ``python -m pretrain`` (and for ``torchrun
--standalone`` of it) only where nothing tells them apart: same output, same exit status, the
variables torchrun gives its ranks, a timeout that ends the child and what it started, a
failed rank that ends the others, and a real process for any environment it was not started
with."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.pretrain_fixtures import REPO, env, run_logged, train_args, train_losses
from tests.zygote import Zygote, _wait, rank_environ, torchrun, zygote

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


TORCHRUN = [sys.executable, *torchrun(2)]


def test_ranks_get_the_variables_torchrun_gives_its_workers(tmp_path):
    """The names torchrun's agent adds to a rank's environment, and their values where they
    do not name a port, a run or a file: those of :func:`rank_environ` (a torch that adds one
    fails here)."""
    script = tmp_path / "dump.py"
    script.write_text("import json, os, sys\n"
                      "json.dump(dict(os.environ), open(sys.argv[1] + os.environ['RANK'], 'w'))\n")
    done = subprocess.run([*TORCHRUN, str(script), str(tmp_path / "rank")], cwd=REPO,
                          env=env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    varying = {"MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE",
               "TORCHELASTIC_USE_AGENT_STORE", "MASTER_ADDR"}
    for rank in (0, 1):
        real = json.loads((tmp_path / f"rank{rank}").read_text())
        ours = rank_environ(env(), rank, 2, 29500, str(tmp_path / "errors"))
        added = set(real) - set(env())
        assert added == set(ours) - set(env()), added ^ (set(ours) - set(env()))
        assert {k: real[k] for k in added - varying} == {k: ours[k] for k in added - varying}


def test_two_ranks_train_and_fail_as_under_torchrun(data, tmp_path):
    """A TP=2 run forked from the server takes the losses of the same run under torchrun and
    prints its result once; a mistake every rank meets is one ``error:`` line on both, and
    both launches exit 1 (torchrun's status for a failed rank)."""
    server = zygote(env())
    args = train_args(data, tmp_path / "forked", "--run.steps=3", "--parallel.tp=2")
    forked = server.run(args, env(), timeout=120, nproc=2)
    real = subprocess.run([*TORCHRUN, "-m", "pretrain", *train_args(
        data, tmp_path / "real", "--run.steps=3", "--parallel.tp=2")], cwd=REPO, env=env(),
        capture_output=True, text=True, timeout=120)
    assert forked.returncode == real.returncode == 0, (forked.stderr[-2000:], real.stderr[-2000:])
    assert train_losses(tmp_path / "forked") == train_losses(tmp_path / "real")
    assert forked.stdout.count("{") == real.stdout.count("{") == 1
    wrong = ["train", "--model.hidden_size=-1"]
    forked = server.run(wrong, env(), timeout=120, nproc=2)
    real = subprocess.run([*TORCHRUN, "-m", "pretrain", *wrong], cwd=REPO, env=env(),
                          capture_output=True, text=True, timeout=120)
    errors = [[line for line in done.stderr.splitlines() if line.startswith("error:")]
              for done in (forked, real)]
    assert forked.returncode == real.returncode == 1
    assert len(errors[0]) == 1 and errors[0] == errors[1], errors


def test_a_failed_rank_ends_the_others():
    """One rank exits 3 while the other would sleep for a minute: the other is ended at once
    (SIGTERM), the launch exits 1 and says which rank failed."""
    pids = []
    for code in (None, 3):
        pid = os.fork()
        if pid == 0:
            os.setpgid(0, 0)
            if code is None:
                time.sleep(60)
            os._exit(code or 0)
        pids.append(pid)
    read, write = os.pipe()
    began = time.monotonic()
    assert _wait(pids, write) == 1
    assert time.monotonic() - began < 10
    os.close(write)
    assert os.read(read, 1000) == b"zygote: rank 1 exited 3; ending the others\n"
    os.close(read)
    for pid in pids:  # both reaped
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, 0)


def test_a_timeout_ends_every_rank(data, tmp_path):
    """Two ranks far longer than their timeout are killed, each with its process group."""
    server = zygote(env())
    with pytest.raises(subprocess.TimeoutExpired):
        server.run(train_args(data, tmp_path / "run", "--run.steps=1000000"), env(),
                   timeout=8, nproc=2)
    children = Path(f"/proc/{server.server.pid}/task/{server.server.pid}/children")
    deadline = time.monotonic() + 10
    while children.read_text().strip():
        assert time.monotonic() < deadline, "a timed-out rank is still there"
        time.sleep(0.05)
    assert server.run(["explain", "optim.lr"], env(), timeout=60).returncode == 0


def test_a_logged_module_writes_its_log_and_leaves_nothing_in_its_group(tmp_path):
    """``run_logged``: a test's wrapper module (not ``pretrain``) forked from the server, its
    output in the log, and the child it left behind in its process group killed once it
    ended."""
    log, pidfile = tmp_path / "log", tmp_path / "pid"
    assert run_logged("tests.leave_a_child", [str(pidfile)], log, timeout=60) == 0
    assert zygote(env()).takes(env(), REPO)  # it was the server's child
    left = int(pidfile.read_text())
    deadline = time.monotonic() + 10
    while _alive(left):
        assert time.monotonic() < deadline, "the child left behind still runs"
        time.sleep(0.05)
    assert log.read_text() == f"left {left}\nexiting\n"
