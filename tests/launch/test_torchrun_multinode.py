"""launch/torchrun.sh across two nodes, without slurm.

The nodes are two network namespaces joined by a veth pair (tests/netns.py), each with its own
host name; torchrun.sh runs on both as a user would on two machines (same arguments, its own
--node-rank), and the nodes meet by c10d rendezvous at node0. One rank per node, data
parallel, so every step's gradients are all-reduced across the link; the losses must be the
single-process run's (same global batch, same initial weights on every rank).
"""

import subprocess
import sys

import pytest

from tests.netns import start_nodes
from tests.pretrain_fixtures import REPO, cli, env, make_corpus, train_args, train_losses

pytestmark = pytest.mark.cluster

STEPS = 8


@pytest.fixture(scope="module")
def nodes():
    started = start_nodes()
    yield started
    started.stop()


def test_two_node_data_parallel_matches_single_process(nodes, tmp_path):
    data = make_corpus(tmp_path / "corpus")
    extra = (f"--run.steps={STEPS}", "--run.eval_interval=1000")
    cli(*train_args(data, tmp_path / "single", *extra))
    launch = ["bash", str(REPO / "launch" / "torchrun.sh"), "--nnodes", "2",
              "--nproc-per-node", "1", "--master-addr", "node0", "--master-port", "29400"]
    pretrain = train_args(data, tmp_path / "two-nodes", *extra)
    logs = [tmp_path / f"node{i}.log" for i in range(2)]
    procs = [nodes.popen(i, [*launch, "--node-rank", str(i), "--", *pretrain], cwd=REPO,
                         env={**env(), "PYTHON": sys.executable, "SHUTDOWN_TIMEOUT": "10"},
                         stdout=logs[i].open("w"), stderr=subprocess.STDOUT)
             for i in range(2)]
    for proc, log in zip(procs, logs, strict=True):
        try:
            proc.wait(timeout=240)
        except subprocess.TimeoutExpired:
            pass  # nodes.stop() ends what is left
        assert proc.returncode == 0, f"{log.name} exited {proc.returncode}:\n" + "\n".join(
            f"--- {other.name}\n{other.read_text()[-2500:]}" for other in logs)
    versions = (tmp_path / "two-nodes" / "versions.json").read_text()
    assert '"world_size": 2' in versions
    single, both = train_losses(tmp_path / "single"), train_losses(tmp_path / "two-nodes")
    assert sorted(both) == list(range(1, STEPS + 1))
    for step, loss in single.items():
        assert both[step] == pytest.approx(loss, rel=1e-5), step
