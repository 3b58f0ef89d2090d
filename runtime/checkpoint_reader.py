"""Reading a torch_dist checkpoint without running code that its files name.

A checkpoint is data, but two of its reads are pickles that may name any callable: torch's
``FileSystemReader.read_metadata`` unpickles the tensor index (``.metadata``) with plain
``pickle``, and DCP's load planner reads every non-tensor item (megatron's common state: the
schedule, the step, optimizer hyper-parameters; each layer's ``_extra_state``) with
``torch.load(weights_only=False)``. A checkpoint shared by someone else could thus run code on
``train`` (resume or ``run.init_from``) and ``eval``. Here the index is unpickled by
:class:`IndexUnpickler`, which admits only the classes torch's checkpoint metadata is made of
(:data:`INDEX_CLASSES`), and the items by ``torch.load(weights_only=True)`` (tensors, plain
containers and numbers, no other class). Anything else is refused in one line naming the file.
Tensors are raw bytes and are read as such (torch itself loads them with ``weights_only``).

megatron's ``dist_checkpointing.load`` creates its own readers and planners, so :func:`load`
runs the same steps (its preprocessing, validation and merges, called, not copied) with
:class:`IndexReader` and :class:`ItemPlanner` in their place. Checkpoints of earlier versions
hold nothing else and still load.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.dist_checkpointing.dict_utils import merge, nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, apply_factory_merges
from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess
from megatron.core.dist_checkpointing.strategies import torch as mcore_torch
from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME
from megatron.core.dist_checkpointing.utils import extract_sharded_base
from megatron.core.dist_checkpointing.validation import (
    StrictHandling,
    determine_global_metadata,
    validate_integrity_and_strict_load,
    verify_checkpoint,
)
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import (
    Metadata,
    StorageMeta,
    TensorStorageMetadata,
)

from runtime.errors import CheckpointError

INDEX = ".metadata"
_DCP = "torch.distributed.checkpoint"
# What torch 2.13's Metadata pickles into (read from torch.distributed.checkpoint.metadata,
# .planner and .filesystem): the index, its per-tensor and per-item entries, their chunks and
# properties, the save plans it keeps, and where each item lies in which file.
INDEX_CLASSES = frozenset({
    (f"{_DCP}.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {
    (f"{_DCP}.planner", name) for name in (
        "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "BytesIOWriteData",
        "LoadPlan", "ReadItem", "LoadItemType")
} | {
    (f"{_DCP}.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
})
# dtypes and memory formats are pickled as attributes of torch (torch.float32)
TORCH_VALUES = (torch.dtype, torch.memory_format, torch.layout)


def refusal(where: str, what: str) -> CheckpointError:
    """The one line that refuses a file (``where``: "checkpoint file 'PATH'", and the item)."""
    return CheckpointError(f"{where} holds {what}; refused, since loading it could run code")


class IndexUnpickler(pickle.Unpickler):
    """pickle, admitting only :data:`INDEX_CLASSES` and torch's dtypes and formats."""

    def find_class(self, module: str, name: str):
        if (module, name) in INDEX_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), TORCH_VALUES):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name}")


def read_index(path: Path) -> Metadata:
    """A checkpoint's tensor index (``.metadata``), or a CheckpointError naming the file."""
    try:
        with open(path, "rb") as f:
            index = IndexUnpickler(f).load()
    except pickle.UnpicklingError as err:
        raise refusal(f"checkpoint file '{path}'", f"{err}, which is not part of a tensor "
                      "index") from None
    except (OSError, EOFError, ValueError, TypeError, AttributeError) as err:
        raise CheckpointError(f"checkpoint file '{path}' is not a tensor index "
                              f"({type(err).__name__}: {err})") from None
    if not isinstance(index, Metadata):
        raise CheckpointError(f"checkpoint file '{path}' is not a tensor index (it holds a "
                              f"{type(index).__name__})")
    return index


def read_item(data: io.BytesIO | bytes, where: str):
    """A non-tensor item (``where`` names it in a refusal, as :func:`refusal`): tensors and
    plain values only (torch's ``weights_only`` set, nothing added)."""
    try:
        return torch.load(io.BytesIO(data) if isinstance(data, bytes) else data,
                          weights_only=True, map_location="cpu")
    except pickle.UnpicklingError:
        raise refusal(where, "objects other than tensors and plain values") from None


class IndexReader(FileSystemReader):
    """torch's file-system reader with :func:`read_index` for the index."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        index = read_index(Path(self._get_metadata_path(kwargs.get("rank"))))
        if getattr(index, "storage_meta", None) is None:
            index.storage_meta = StorageMeta()
        index.storage_meta.load_id = self.load_id
        return index


class ItemPlanner(mcore_torch.MCoreLoadPlanner):
    """megatron's load planner with :func:`read_item` for non-tensor items."""

    def __init__(self, directory: Path, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.directory = directory

    def load_bytes(self, item, value: io.BytesIO) -> None:
        storage = self.metadata.storage_data.get(item.storage_index)
        path = self.directory / storage.relative_path if storage else self.directory
        where = f"checkpoint file '{path}' (item '{item.dest_index.fqn}')"
        self.state_dict[item.dest_index.fqn] = read_item(value, where)


def _dcp_load(state: dict, directory: Path, planner: ItemPlanner) -> None:
    """DCP's load through :class:`IndexReader` and ``planner``; a CheckpointError raised in it
    comes out as it is (DCP wraps every error of a read in a CheckpointException)."""
    try:
        dcp.load(state, storage_reader=IndexReader(str(directory)), planner=planner,
                 no_dist=True)
    except CheckpointException as err:
        ours = [exc for exc, _ in err.failures.values() if isinstance(exc, CheckpointError)]
        if ours:
            raise ours[0] from None
        raise


class LoadStrategy(mcore_torch.TorchDistLoadShardedStrategy):
    """megatron's torch_dist load strategy reading through :class:`IndexReader` and
    :class:`ItemPlanner`."""

    def load(self, sharded_state_dict: dict, checkpoint_dir, async_strategy: str = "mcore"):
        template = sharded_state_dict
        tensors = [t for t in nested_values(template) if isinstance(t, ShardedTensor)]
        flat, flat_mapping, rename_mapping = \
            mcore_torch._replace_state_dict_keys_with_sharded_keys(template)
        state = mcore_torch.mcore_to_pyt_state_dict(flat, True)
        planner = ItemPlanner(
            Path(checkpoint_dir),
            shapes_validation_sharded_tensors=[t for t in tensors if not t.allow_shape_mismatch],
            allow_shape_mismatch_sharded_tensors={t.key: t for t in tensors
                                                  if t.allow_shape_mismatch},
            stream_ckpt_dequant=self.stream_ckpt_dequant,
            flatten_state_dict=False, flatten_sharded_tensors=False)
        _dcp_load(state, Path(checkpoint_dir), planner)
        loaded = {k: mcore_torch._unwrap_pyt_sharded_tensor(v) for k, v in state.items()}
        loaded = mcore_torch._replace_sharded_keys_with_state_dict_keys(
            loaded, flat_mapping, rename_mapping)
        mcore_torch._restore_dict_types(loaded, template)
        return loaded

    def load_tensors_metadata(self, checkpoint_dir, metadata: Metadata | None = None):
        """megatron's own (each tensor's global shape and dtype, data-free), made here: it
        passes every field of torch's TensorProperties to ``torch.empty``, and torch 2.15
        added one (``strides``) that ``torch.empty`` does not take."""
        if metadata is None:
            metadata = read_index(Path(checkpoint_dir) / INDEX)
        return {key: ShardedTensor.from_rank_offsets(key, torch.empty(
                    stored.size, device="meta", **_empty_arguments(stored.properties))
                ).without_data()
                for key, stored in metadata.state_dict_metadata.items()
                if isinstance(stored, TensorStorageMetadata)}


# What torch.empty takes of a checkpoint's TensorProperties (it has more fields in newer torch).
_EMPTY_ARGUMENTS = ("dtype", "layout", "requires_grad", "memory_format", "pin_memory")


def _empty_arguments(properties) -> dict:
    return {name: getattr(properties, name) for name in _EMPTY_ARGUMENTS
            if getattr(properties, name, None) is not None}


def common_state(directory: Path) -> dict:
    """megatron's non-tensor items (a ``common.pt`` of older megatron versions, else the
    ``common_state`` item), read through :func:`read_item`."""
    legacy = directory / COMMON_STATE_FNAME
    if legacy.exists():
        return read_item(legacy.read_bytes(), f"checkpoint file '{legacy}'")
    key = ShardedObject("common_state", None, (1,), (0,)).unique_key
    state = {key: io.BytesIO()}
    _dcp_load(state, directory, ItemPlanner(directory, flatten_state_dict=False,
                                            flatten_sharded_tensors=False))
    return state[key][0]


def load(sharded_state_dict: dict, directory: Path) -> dict:
    """megatron's ``dist_checkpointing.load`` (strict: assume unexpected keys are fine, as its
    default; access integrity validated), every file read as this module reads them."""
    verify_checkpoint(str(directory))  # metadata.json: JSON
    strategy = LoadStrategy()
    sharded, nonpersistent, factories = load_preprocess(sharded_state_dict)
    common = common_state(directory)
    merge(common, nonpersistent)
    sharded, _ = extract_sharded_base(sharded)
    local, global_ = determine_global_metadata(sharded)
    sharded, _, _ = validate_integrity_and_strict_load(
        sharded, StrictHandling.ASSUME_OK_UNEXPECTED, True, local, global_)
    merge(common, strategy.load(sharded, directory))
    return apply_factory_merges(common, factories)


def tensors_metadata(directory: Path) -> dict:
    """The global shape and dtype of every tensor in the checkpoint, from its index."""
    return LoadStrategy().load_tensors_metadata(directory)
