"""A checkpoint's RNG files hold tensors and plain values only and are read with
``weights_only=True``: resuming from a checkpoint someone shared runs none of its code.

The round trip restores every generator a step draws from (draws after loading equal the draws
after saving); RNG files of earlier versions (numpy's state as a pickled array) still load;
a file that names any other object is refused without running it.
"""

import pathlib
import random

import numpy as np
import pytest
import torch

from pretrain.run.checkpoint import read_rng_state, rng_state, set_rng_state
from runtime.errors import CheckpointError
from tests.fixtures.make_legacy_checkpoints import FIXTURES


def draws() -> tuple:
    return (random.random(), random.gauss(0, 1), float(np.random.rand()),
            float(np.random.randn()), torch.rand(3).tolist())


def test_round_trip_restores_every_generator(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    draws()  # leave each generator mid-stream, with numpy's cached gaussian set
    torch.save(rng_state(), tmp_path / "rank0.pt")
    expected = draws()
    random.seed(7), np.random.seed(8), torch.manual_seed(9)
    set_rng_state(read_rng_state(tmp_path / "rank0.pt"))
    assert draws() == expected
    names = torch.serialization.get_unsafe_globals_in_checkpoint(tmp_path / "rank0.pt")
    assert names == [], names  # nothing beyond tensors and plain values


def test_rng_files_of_earlier_versions_still_load():
    [path] = (FIXTURES / "siamese").glob("step_*/rng/rank0.pt")
    old = torch.load(path, weights_only=False)  # a file this repository wrote itself
    state = read_rng_state(path)
    assert state["python"] == old["python"]
    assert state["numpy"][0] == old["numpy"][0]
    assert np.array_equal(state["numpy"][1], old["numpy"][1])
    assert state["numpy"][2:] == old["numpy"][2:]
    assert torch.equal(state["torch"], old["torch"])


class _RunsCode:
    """Unpickling this touches a file: what a shared checkpoint could do with any code."""

    def __init__(self, marker: pathlib.Path):
        self.marker = marker

    def __reduce__(self):
        return pathlib.Path.touch, (self.marker,)


def test_a_file_naming_other_objects_is_refused_unrun(tmp_path):
    marker = tmp_path / "code-ran"
    state = rng_state()
    state["python"] = _RunsCode(marker)
    torch.save(state, tmp_path / "rank0.pt")
    with pytest.raises(CheckpointError, match="rank0.pt.*could run code"):
        read_rng_state(tmp_path / "rank0.pt")
    assert not marker.exists()
