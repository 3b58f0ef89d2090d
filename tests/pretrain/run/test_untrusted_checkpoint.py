"""Loading a checkpoint runs no code its files name (runtime.checkpoint_reader).

Each file a resume or an eval reads is replaced, in a copy of a real checkpoint (the legacy
fixture, written by an earlier version), by a pickle that would touch a marker file when
unpickled: the tensor index ``.metadata`` (whole, or one object nested in a real index),
megatron's non-tensor items (the ``common_state`` item, a layer's ``_extra_state``, the
``common.pt`` of older megatron versions), the RNG file, ``complete.json`` and the tokenizer
files. Every load is refused in one line naming the file, and the marker never appears."""

import dataclasses
import io
import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from model.builder import build_model, wrap_ddp
from pretrain.data.tokenizer import open_tokenizer
from pretrain.optim import build_optimizer
from pretrain.run import checkpoint, identity
from runtime import weights
from runtime.checkpoint_reader import read_index
from runtime.errors import CheckpointError, DataError
from tests.fixtures.make_legacy_checkpoints import FIXTURES, config_for

LEGACY = FIXTURES / "siamese"
REFUSED = "; refused, since loading it could run code"


class Touch:
    """Unpickled, creates ``path``: the stand-in for any code a file could name."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return Path.touch, (self.path,)


def _saved(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


@pytest.fixture
def marker(tmp_path) -> Path:
    path = tmp_path / "code-ran"
    pickle.loads(pickle.dumps(Touch(path)))  # the payload is live: plain pickle runs it
    assert path.exists()
    path.unlink()
    return path


@pytest.fixture
def copy(tmp_path) -> Path:
    """A copy of the legacy checkpoint folder; returns its step folder."""
    shutil.copytree(LEGACY, tmp_path / "run")
    return tmp_path / "run" / "step_00000001"


def _index(step: Path):
    with (step / ".metadata").open("rb") as f:
        return pickle.load(f)  # the test's own, trusted file


def _replace_item(step: Path, prefix: str, payload: bytes) -> tuple[Path, str]:
    """The non-tensor item whose key starts with ``prefix`` now holds ``payload`` (appended
    to its data file, the index pointing there): what an edited checkpoint can do."""
    index = _index(step)
    key = next(k for k in index.storage_data if k.fqn.startswith(prefix))
    info = index.storage_data[key]
    data = step / info.relative_path
    offset = data.stat().st_size
    with data.open("ab") as f:
        f.write(payload)
    index.storage_data[key] = dataclasses.replace(info, offset=offset, length=len(payload))
    (step / ".metadata").write_bytes(pickle.dumps(index))
    return data, key.fqn


def _config():
    return config_for(identity.upgraded(json.loads((LEGACY / "model.json").read_text())))


def _resume(step: Path) -> None:
    config = _config()
    chunks = wrap_ddp(build_model(config.model, config.parallel), config.parallel)
    optimizer, scheduler = build_optimizer(config, chunks, torch.float32)
    checkpoint.load(step, checkpoint.read_record(step), chunks, optimizer, scheduler)


def _eval(step: Path) -> None:
    config = _config()
    weights.load(build_model(config.model, config.parallel),
                 checkpoint.weights_source(str(step), config))


def _refused(load, step: Path, marker: Path) -> str:
    with pytest.raises(CheckpointError) as caught:
        load(step)
    assert not marker.exists()
    text = str(caught.value)
    assert "\n" not in text
    return text


@pytest.mark.parametrize("load", [_resume, _eval], ids=["resume", "eval"])
def test_a_foreign_index_is_refused_naming_the_class(single_rank, copy, marker, load):
    (copy / ".metadata").write_bytes(pickle.dumps(Touch(marker)))
    assert _refused(load, copy, marker) == (
        f"checkpoint file '{copy / '.metadata'}' holds pathlib.Path.touch, which is not part "
        f"of a tensor index{REFUSED}")


def test_an_object_nested_in_a_real_index_is_refused(single_rank, copy, marker):
    index = _index(copy)
    index.planner_data = Touch(marker)
    (copy / ".metadata").write_bytes(pickle.dumps(index))
    assert _refused(_resume, copy, marker).startswith(
        f"checkpoint file '{copy / '.metadata'}' holds pathlib.Path.touch")


@pytest.mark.parametrize("load", [_resume, _eval], ids=["resume", "eval"])
@pytest.mark.parametrize("prefix", ["common_state", "decoder.layers.mlp.linear_fc1._extra_state"])
def test_a_non_tensor_item_naming_code_is_refused(single_rank, copy, marker, load, prefix):
    data, key = _replace_item(copy, prefix, _saved({"scheduler": Touch(marker)}))
    assert _refused(load, copy, marker) == (
        f"checkpoint file '{data}' (item '{key}') holds objects other than tensors and plain "
        f"values{REFUSED}")


def test_the_common_file_of_older_megatron_versions_is_refused(single_rank, copy, marker):
    (copy / "common.pt").write_bytes(_saved({"step": Touch(marker)}))
    assert _refused(_resume, copy, marker) == (
        f"checkpoint file '{copy / 'common.pt'}' holds objects other than tensors and plain "
        f"values{REFUSED}")


def test_an_rng_file_naming_code_is_refused(single_rank, copy, marker):
    (copy / "rng" / "rank0.pt").write_bytes(_saved({"python": Touch(marker)}))
    assert _refused(_resume, copy, marker) == (
        f"'{copy / 'rng' / 'rank0.pt'}' holds objects other than tensors and plain values; "
        "refused, since loading them could run code")


def test_a_complete_json_that_is_a_pickle_is_damaged(copy, marker):
    (copy / "complete.json").write_bytes(pickle.dumps(Touch(marker)))
    assert _refused(checkpoint.read_record, copy, marker).startswith(
        f"checkpoint '{copy}' is damaged: complete.json is not readable JSON")


@pytest.mark.parametrize("name", ["tokenizer.model", "tokenizer.json"])
def test_tokenizer_files_are_parsed_never_unpickled(tmp_path, marker, name):
    path = tmp_path / name
    path.write_bytes(pickle.dumps(Touch(marker)))
    with pytest.raises(DataError, match=f"^tokenizer '{path}' is not a "):
        open_tokenizer(str(path))
    assert not marker.exists()


def test_the_legacy_index_holds_only_admitted_classes():
    index = read_index(LEGACY / "step_00000001" / ".metadata")
    assert "common_state/shard_0_1" in {k.fqn for k in index.storage_data}
