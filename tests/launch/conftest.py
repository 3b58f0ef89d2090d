"""The test slurm cluster, started once for every launch test that asks for it (job scripts
and the sharded data preparation), stopped when the session ends."""

from __future__ import annotations

import pytest

from tests.slurm_cluster import start_cluster


@pytest.fixture(scope="session")
def cluster():
    started = start_cluster()
    yield started
    started.stop()
