"""What the documented commands write into a clone (prepared data, tokenizers, exports, runs)
is ignored by git, and the source folders of the same names are not."""

import subprocess

import pytest

from tests.pretrain_fixtures import REPO

pytestmark = pytest.mark.slow  # asks git itself

# outputs of the README's and docs' example commands
OUTPUTS = ["data/tok.model", "data/corpus.bin", "hf/x/model.safetensors", "runs/demo/x",
           "wandb/run-1/files"]
SOURCES = ["pretrain/data/prepare.py", "pretrain/hf/export.py", "tests/pretrain/data/x.py"]


def _ignored(path: str) -> bool:
    done = subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=REPO)
    assert done.returncode in (0, 1), done
    return done.returncode == 0


@pytest.mark.parametrize("path", OUTPUTS)
def test_outputs_are_ignored(path):
    assert _ignored(path)


@pytest.mark.parametrize("path", SOURCES)
def test_sources_are_not(path):
    assert not _ignored(path)
