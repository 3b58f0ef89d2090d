"""The test slurm cluster for the launch tests that ask for it (job scripts and the sharded
data preparation): one per test module, stopped after the module's last test. Not one per
session: a session fixture is torn down inside whichever test ends the session, and stopping
the cluster starts processes, which only a test marked ``cluster`` may (tests/tiers.py)."""

from __future__ import annotations

import pytest

from tests.slurm_cluster import start_cluster


@pytest.fixture(scope="module")
def cluster():
    started = start_cluster()
    yield started
    started.stop()
