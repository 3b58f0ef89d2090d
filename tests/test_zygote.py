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
from tests.zygote import zygote

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


def test_another_environment_goes_to_a_real_process():
    server = zygote(env())
    assert not server.takes(env(OMP_NUM_THREADS="2"), REPO)
    assert not server.takes(env(), REPO / "tests")
    assert server.takes({**env(), "PYTEST_CURRENT_TEST": "elsewhere"}, REPO)


def test_the_server_ends_with_its_caller():
    """Started by a process that then dies, the server does not outlive it."""
    code = ("import sys; sys.path.insert(0, %r)\n"
            "from tests.pretrain_fixtures import env\n"
            "from tests.zygote import zygote\n"
            "z = zygote(env()); print(z.server.pid, z.ready, flush=True)\n"
            "import os; os._exit(0)\n") % str(REPO)
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
