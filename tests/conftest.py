import pytest
import torch

from model import parallel
from model.config import ParallelConfig


@pytest.fixture(scope="session")
def single_rank():
    """megatron's parallel state for one process (TP = PP = 1), shared by in-process tests."""
    parallel.initialize(ParallelConfig(), seed=1234)
    yield
    parallel.destroy()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (CUDA not available)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
