"""How ``make test`` shares the suite between its workers (pytest-xdist).

A worker takes whole test modules, so a module's fixtures (a reference run, exported model
folders, a trained checkpoint) are built once; the cluster modules are one unit together,
since two slurm or network-namespace clusters at once would contend for the same daemons and
names. xdist's ``--dist loadgroup`` was meant to do this from ``xdist_group`` marks, but under
pytest 9.2 it cannot: it tags a test by rewriting ``item._nodeid``, which pytest 9.2 no
longer reads (a node's id is now ``item._id``), so every test was a unit of its own and a
module's fixture was built once per worker that ran one of its tests (on 2026-11-27 the HF
export fixture twice, 77 s and 70 s). ``tests/conftest.py`` installs :class:`ModuleScheduling`
for ``--dist loadgroup`` instead.

Units start heaviest first (longest processing time first), so the run does not end on one
worker finishing a long module while the other idles: the modules in :data:`HEAVY` (over
40 s each, measured), then the rest, most tests first as xdist orders them. The list only
orders; a stale entry costs balance, never a test.
"""

from __future__ import annotations

from xdist.scheduler import LoadScopeScheduling

# The modules whose tests start slurm or network-namespace clusters (tests marked
# ``cluster``): ``tests/conftest.py`` refuses a cluster test outside them.
CLUSTER_MODULES = frozenset({"tests/launch/test_slurm.py", "tests/launch/test_slurm_prepare.py",
                             "tests/launch/test_torchrun_multinode.py"})
CLUSTER = "cluster"

# Heaviest first: seconds of test time per unit in a whole run on the 2-core CPU
# (2026-11-27), from about 270 down to 40.
HEAVY = ("tests/model/test_compiled_blocks.py", "tests/pretrain/hf/test_hf_remote.py",
         "tests/bench/test_gpu_check.py", "tests/pretrain/train/test_downstream.py",
         CLUSTER, "tests/runtime/test_parallel_parity.py",
         "tests/pretrain/run/test_async_checkpoint.py", "tests/kernels/test_triton_kernels.py",
         "tests/pretrain/train/test_watchdog.py", "tests/pretrain/hf/test_hf_export.py",
         "tests/pretrain/test_pretrain.py", "tests/pretrain/train/test_spike_guard.py",
         "tests/pretrain/report/test_dry_run.py", "tests/pretrain/run/test_no_orphans.py",
         "tests/pretrain/run/test_run_safety.py", "tests/test_bf16_parity.py")


def unit(nodeid: str) -> str:
    """The unit a test belongs to: its module, or :data:`CLUSTER`."""
    module = nodeid.split("::", 1)[0]
    return CLUSTER if module in CLUSTER_MODULES else module


class ModuleScheduling(LoadScopeScheduling):
    """xdist's scope scheduling with a module (or all cluster modules) as the scope, units
    handed out heaviest first."""

    def _split_scope(self, nodeid: str) -> str:
        return unit(nodeid)

    def _assign_work_unit(self, node) -> None:
        heavy = next((scope for scope in HEAVY if scope in self.workqueue), None)
        if heavy is not None:
            self.workqueue.move_to_end(heavy, last=False)
        super()._assign_work_unit(node)
