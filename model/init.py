"""Initial weights that depend on the seed and the config only, never on the parallel layout.

megatron draws each weight from the generator of the rank that builds it, in the order that
rank builds its layers, so a pipeline stage that starts at block 8 draws block 8 from where a
single process would draw block 0: a fresh PP run starts from another model than a
single-process run. Here every random weight is drawn again once the model is built, from a
generator seeded with the run seed and the weight's *global name*. The checkpoint view of the
model (megatron's sharded state dict) already names each local tensor that way: its key, its
global block index, the global tensor's shape and where the local slice sits in it, the same
facts that let a checkpoint reshard. Each rank draws the global tensor of every weight it
holds (on the CPU, in fp32, so CPU and GPU runs agree too) and keeps its own slice. TP, SP, PP,
VP and DP layouts therefore start from the same model.

The rules (``model.init``, :class:`~model.schemes.InitMethod`; std = ``model.init_method_std``):

- embeddings, QKV and fc1: normal(0, std)
- attention output projection and fc2: std / sqrt(2 num_layers) (megatron's depth scaling),
  or std where the scheme scales them itself (``Traits.depth_scaled_output_init``)
- an untied output layer: std (``normal``) or 1 / sqrt(hidden_size) (``full_megatron``)
- ``full_megatron`` truncates every draw at +-3 std, as OLMo's ``init_normal`` does
- everything else (norm weights and gates 1, biases 0, ...) keeps its constant value; a
  tensor here that is not constant has no rule and is refused, so a new random parameter cannot
  silently become layout-dependent.

A scheme's file may define ``init_std(model, key)``, the std of its own random parameters
(None for the rest), drawn like every other weight; and ``scale_init(model, key, weight)`` to
rescale a drawn global tensor
in place (DeepNorm's beta); it sees the whole tensor, so the scaling is layout-independent too.
It may list in ``FIXED_INIT`` the key suffixes of parameters it sets from the config and the
global block index alone (hyper-connections' one-hot and identity starts), which are not
constant yet are layout-independent by construction.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable

import torch
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

from model.config import ModelConfig
from model.layers import SCHEME_FILES
from model.schemes import InitMethod

TRUNCATION = 3.0
"""``full_megatron`` draws lie in [-3 std, 3 std]."""
_INPUT_PROJECTIONS = ("word_embeddings.weight", "position_embeddings.weight",
                      "linear_qkv.weight", "linear_fc1.weight")
_OUTPUT_PROJECTIONS = ("linear_proj.weight", "linear_fc2.weight")


def std_of(model: ModelConfig, key: str) -> float | None:
    """The std the weight named ``key`` is drawn with, or None for a constant tensor."""
    std = model.init_method_std
    if key.endswith(_INPUT_PROJECTIONS):
        return std
    if key.endswith(_OUTPUT_PROJECTIONS):
        scaled = model.residual_scheme.traits.depth_scaled_output_init
        return std / math.sqrt(2.0 * model.num_layers) if scaled else std
    if key == "output_layer.weight":
        return model.hidden_size ** -0.5 if model.init is InitMethod.FULL_MEGATRON else std
    own = getattr(SCHEME_FILES[model.residual_scheme], "init_std", None)
    return None if own is None else own(model, key)


def seed_of(seed: int, name: str) -> int:
    """A 63-bit generator seed for the tensor ``name`` of run ``seed``."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def draw(model: ModelConfig, seed: int, name: str, key: str, shape: tuple[int, ...],
         std: float) -> torch.Tensor:
    """The global fp32 tensor ``name`` (``key`` with its block index) of run ``seed``."""
    generator = torch.Generator().manual_seed(seed_of(seed, name))
    weight = torch.empty(shape, dtype=torch.float32)
    if model.init is InitMethod.FULL_MEGATRON:
        bound = TRUNCATION * std
        torch.nn.init.trunc_normal_(weight, 0.0, std, -bound, bound, generator=generator)
    else:
        weight.normal_(0.0, std, generator=generator)
    scale_init = getattr(SCHEME_FILES[model.residual_scheme], "scale_init", None)
    if scale_init is not None:
        scale_init(model, key, weight)
    return weight


def local_tensors(chunk: torch.nn.Module) -> list[ShardedTensor]:
    """This rank's tensors of ``chunk`` as its checkpoint names them; their ``data`` are the
    parameters themselves or views of them (SwiGLU's fc1 comes as its two halves)."""
    found = []
    for item in nested_values(chunk.sharded_state_dict()):
        if isinstance(item, ShardedTensorFactory):
            found += [t for t in nested_values(item.build()) if isinstance(t, ShardedTensor)]
        elif isinstance(item, ShardedTensor):
            found.append(item)
    return found


Source = Callable[[ShardedTensor, str], "torch.Tensor | None"]
"""What :func:`fill` copies from: given a local tensor and its global name (key and block
index), the whole global tensor, or None to keep the tensor as built."""


@torch.no_grad()
def fill(chunks: list[torch.nn.Module], source: Source) -> None:
    """Copy into every local tensor of ``chunks`` its slice of the global tensor ``source``
    gives (one call per global tensor: SwiGLU's two fc1 halves come one after the other)."""
    name, full = None, None
    for chunk in chunks:
        for tensor in local_tensors(chunk):
            blocks = tensor.prepend_axis_num  # stacked blocks: the leading global block index
            previous, name = name, f"{tensor.key}{list(tensor.global_offset[:blocks])}"
            if name != previous:
                full = source(tensor, name)
            if full is None:
                continue
            where = tuple(slice(offset, offset + size) for offset, size in
                          zip(tensor.global_offset[blocks:], tensor.data.shape, strict=True))
            tensor.data.copy_(full[where])


def initialize(chunks: list[torch.nn.Module], model: ModelConfig, seed: int) -> None:
    """Overwrite every random weight of ``chunks`` with its layout-independent draw."""
    fixed = getattr(SCHEME_FILES[model.residual_scheme], "FIXED_INIT", ())

    def drawn(tensor: ShardedTensor, name: str) -> torch.Tensor | None:
        std = std_of(model, tensor.key)
        if std is None:
            if not tensor.key.endswith(fixed):
                _require_constant(tensor)
            return None
        shape = tuple(tensor.global_shape[tensor.prepend_axis_num:])
        return draw(model, seed, name, tensor.key, shape, std)

    fill(chunks, drawn)


def _require_constant(tensor: ShardedTensor) -> None:
    data = tensor.data
    constant = data.numel() <= 1 or bool((data == data.flatten()[0]).all())
    if data.is_floating_point() and not constant:
        raise RuntimeError(
            f"model.init has no rule for {tensor.key}, which is built with random values: "
            "add it to model/init.py so every parallel layout draws it alike")
