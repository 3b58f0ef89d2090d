"""How ``make test`` shares the suite between workers (tests/scheduling.py): xdist's own
scheduling machinery driven with two stand-in workers, and the conftest's refusal of a cluster
test outside the cluster modules."""

from types import SimpleNamespace

import pytest

from tests import scheduling


class _Worker:
    """What xdist's scheduler calls on a worker: the test indices it is sent, its shutdown."""

    def __init__(self, name: str):
        self.gateway = SimpleNamespace(id=name)
        self.sent: list[int] = []
        self.shutting_down = False

    def send_runtest_some(self, indices):
        self.sent += indices

    def shutdown(self):
        self.shutting_down = True


def _run(collection: list[str]) -> dict[str, list[str]]:
    """Schedule ``collection`` on two workers that complete every test sent to them, first
    worker first; which tests each ran."""
    config = SimpleNamespace(getvalue=lambda name: {"tx": ["2*popen"]}[name],
                             option=SimpleNamespace(loadscopereorder=True))
    sched = scheduling.ModuleScheduling(config)
    workers = [_Worker("gw0"), _Worker("gw1")]
    for worker in workers:
        sched.add_node(worker)
        sched.add_node_collection(worker, collection)
    sched.schedule()
    done = {w.gateway.id: [] for w in workers}
    while sched.has_pending:
        for worker in workers:
            ran = done[worker.gateway.id]
            for index in worker.sent[len(ran):]:
                ran.append(collection[index])
                sched.mark_test_complete(worker, index)
    return done


def test_a_module_runs_whole_on_one_worker_and_cluster_modules_together():
    collection = [f"tests/a/test_{m}.py::test_{i}[{p}]"
                  for m in ("one", "two", "three") for i in range(4) for p in ("x", "y")]
    collection += [f"{module}::test_job" for module in sorted(scheduling.CLUSTER_MODULES)]
    done = _run(collection)
    assert sorted(t for ran in done.values() for t in ran) == sorted(collection)
    for name in ("one", "two", "three"):
        holders = {w for w, ran in done.items() if any(f"test_{name}.py" in t for t in ran)}
        assert len(holders) == 1, (name, done)
    cluster = {w for w, ran in done.items() if any(scheduling.unit(t) == "cluster" for t in ran)}
    assert len(cluster) == 1, done


def test_heavy_modules_are_handed_out_first():
    light = [f"tests/test_light{i}.py::test_{j}" for i in range(3) for j in range(20)]
    heavy = [f"{scheduling.HEAVY[1]}::test_one", f"{scheduling.HEAVY[0]}::test_one"]
    done = _run(light + heavy)
    firsts = {ran[0] for ran in done.values()}
    assert firsts == set(heavy), done


def test_a_cluster_test_outside_the_cluster_modules_is_refused(request):
    from tests.conftest import pytest_collection_modifyitems

    item = SimpleNamespace(nodeid="tests/test_x.py::test_y", keywords={"cluster": True},
                           fixturenames=[], add_marker=lambda mark: None)
    with pytest.raises(pytest.UsageError, match="is marked cluster but its module is not in"):
        pytest_collection_modifyitems(request.config, [item])
