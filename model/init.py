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

- embeddings, QKV and fc1 (the experts' too), the MoE router (its bias too) and shared-expert gate:
  normal(0, std)
- attention output projection and fc2 (the experts' too): std / sqrt(2 num_layers)
  (megatron's depth scaling), or std where the scheme scales them itself
  (``Traits.depth_scaled_output_init``)
- an untied output layer: std (``normal``) or 1 / sqrt(hidden_size) (``full_megatron``)
- ``full_megatron`` truncates every draw at +-3 std, as OLMo's ``init_normal`` does
- everything else starts at a declared value, never at whatever its constructor happened to
  write: a scheme's own parameters at their entry in its file's ``START`` (by key suffix),
  norm weights at 1, norm and linear biases at 0 (:func:`start_of`). The build checks every
  such tensor against its declaration and refuses one without a declaration or away from it
  (naming the scheme, the tensor and the file), and a random tensor without a rule to draw it:
  a start value is part of a scheme's equations (a gate's bias at 0 instead of 2 is another
  model), and a random one would be layout-dependent.

A scheme's file may define ``init_std(model, key)``, the std of its own random parameters
(None for the rest), drawn like every other weight; and ``scale_init(model, key, weight)`` to
rescale a drawn global tensor in place (DeepNorm's beta); it sees the whole tensor, so the
scaling is layout-independent too. Its ``START`` maps key suffixes to a :data:`Start`: one
value for every element, or a function of the config, the key, the global block index and the
global shape (hyper-connections' one-hot and identity starts), layout-independent by
construction. ``tests/model/test_equations.py`` holds every registered scheme's starts to its
own transcription of the equations' start values.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Callable

import torch
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

from model.config import ModelConfig
from model.decay import ROLE, Decay
from model.layers import SCHEME_FILES
from model.schemes import InitMethod

TRUNCATION = 3.0
"""``full_megatron`` draws lie in [-3 std, 3 std]."""
_INPUT_PROJECTIONS = ("word_embeddings.weight", "position_embeddings.weight",
                      "linear_qkv.weight", "linear_fc1.weight",
                      # mixture of experts: the router and the shared expert's gate; the
                      # router's bias (model.add_bias_linear) is drawn too, as megatron does
                      "router.weight", "shared_experts.gate_weight", "router.bias")
_OUTPUT_PROJECTIONS = ("linear_proj.weight", "linear_fc2.weight")
_ZERO_BUFFERS = ("router.expert_bias",)
"""State that is not a parameter but is checkpointed, starting at 0: the MoE router's
loss-free balancing bias (moved by the load, not by gradients)."""


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


def _where(tensor: ShardedTensor) -> tuple[slice, ...]:
    """Where the local ``tensor`` sits in its global tensor (past the stacked block axis)."""
    blocks = tensor.prepend_axis_num
    return tuple(slice(offset, offset + size) for offset, size in
                 zip(tensor.global_offset[blocks:], tensor.data.shape, strict=True))


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
            if full is not None:
                tensor.data.copy_(full[_where(tensor)])


Start = float | Callable[[ModelConfig, str, "int | None", tuple[int, ...]], torch.Tensor]
"""What a tensor that is not drawn starts at: one value for every element, or the global
tensor as a function of the config, the tensor's key, its global block index (None outside
the blocks) and its global shape."""


def start_of(model: ModelConfig, key: str, role: Decay | None) -> Start | None:
    """The declared start of the undrawn tensor ``key`` of weight-decay role ``role``: the
    scheme's own (its file's ``START``, the first suffix ``key`` ends with), else the
    normalization's (``kernels.normalizations``: DyT's alpha ``model.dyt_alpha``), else its
    role's (norm weights 1, norm and linear biases 0); None where nothing declares one."""
    own = getattr(SCHEME_FILES[model.residual_scheme], "START", {})
    for suffix, start in own.items():
        if key.endswith(suffix):
            return start
    for spec in model.normalization.kind.parameters:  # the norm's own declaration
        if (role is Decay(spec.role) and not isinstance(spec.start, str)
                and key.endswith(("." + spec.name, "_" + spec.name))):
            return spec.start
    if role is Decay.NORM:
        return 0.0 if key.endswith("bias") else 1.0
    if role is Decay.BIAS:
        return 0.0
    if key.endswith(_ZERO_BUFFERS):
        return 0.0
    return None


def block_of(tensor: ShardedTensor) -> int | None:
    """The global block index of a block's tensor (keyed per block: the index in its key;
    stacked: its leading offset), None for the embedding, the output layer and the end. The
    key decides first: an expert tensor carries its expert index as a leading axis too, the
    only one where blocks are keyed per block (mixed dense and MoE blocks)."""
    keyed = re.search(r"decoder\.layers\.(\d+)\.", tensor.key)
    if keyed:
        return int(keyed.group(1))
    return int(tensor.global_offset[0]) if tensor.prepend_axis_num else None


def start_tensor(model: ModelConfig, start: Start, key: str, block: int | None,
                 shape: tuple[int, ...]) -> torch.Tensor:
    """The global fp32 tensor a :data:`Start` gives."""
    if callable(start):
        return start(model, key, block, shape).float()
    return torch.full(shape, float(start))


def initialize(chunks: list[torch.nn.Module], model: ModelConfig, seed: int) -> None:
    """Overwrite every random weight of ``chunks`` with its layout-independent draw, and hold
    every other tensor to its declared start (:func:`start_of`)."""
    def drawn(tensor: ShardedTensor, name: str) -> torch.Tensor | None:
        std = std_of(model, tensor.key)
        if std is None:
            _require_start(model, tensor)
            return None
        shape = tuple(tensor.global_shape[tensor.prepend_axis_num:])
        return draw(model, seed, name, tensor.key, shape, std)

    fill(chunks, drawn)


def _role(data: torch.Tensor) -> Decay | None:
    """The weight-decay role of a parameter, or of the parameter a view (SwiGLU's fc1
    halves) is of."""
    role = getattr(data, ROLE, None)
    return role if role is not None else getattr(data._base, ROLE, None)


def _recorded_start(data: torch.Tensor) -> float | None:
    start = getattr(data, "norm_start", None)
    if start is None and data._base is not None:
        start = getattr(data._base, "norm_start", None)
    return start


def _require_start(model: ModelConfig, tensor: ShardedTensor) -> None:
    data = tensor.data
    if not data.is_floating_point():
        return
    scheme = model.residual_scheme
    where = f"residual scheme {scheme}: {tensor.key}"
    block = block_of(tensor)
    if block is not None:
        where += f" (block {block})"
    # a start the config gives a norm's parameter by its site (DyT's alpha), as the norm
    # recorded it when built (kernels.norms.Norm; test_equations.py holds it to the rule)
    start = _recorded_start(data)
    if start is None:
        start = start_of(model, tensor.key, _role(data))
    if start is None:
        constant = data.numel() <= 1 or bool((data == data.flatten()[0]).all())
        what = "is built constant" if constant else "is built with random values"
        raise RuntimeError(
            f"{where} {what} but has no rule: declare its start in START of "
            f"model/layers/{scheme}.py (or, if it is drawn, its std in init_std there) so "
            "every parallel layout starts it alike")
    shape = tuple(tensor.global_shape[tensor.prepend_axis_num:])
    want = start_tensor(model, start, tensor.key, block, shape)[_where(tensor)]
    if not torch.equal(data.detach().cpu(), want.to(data.dtype)):
        raise RuntimeError(
            f"{where} starts at {_show(data)} but is declared to start at {_show(want)} "
            f"(START of model/layers/{scheme}.py, or the role's rule in model/init.py "
            "start_of): build it at its declared start, or correct the declaration with the "
            "scheme's equations")


def _show(values: torch.Tensor) -> str:
    flat = values.detach().float().flatten()
    if flat.numel() and bool((flat == flat[0]).all()):
        return f"{flat[0].item():g} everywhere"
    return f"{[round(v, 6) for v in flat[:6].tolist()]}{' ...' if flat.numel() > 6 else ''}"
