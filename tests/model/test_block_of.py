"""``model.init.block_of`` names the block of every tensor of a built model, expert tensors too.

The expected block is read from another source than the checkpoint key: the module that owns
the tensor's parameter (``decoder.layers.<i>.``, one process, so local is global). An expert
tensor carries its expert index as a leading axis, which is the block's place for stacked
blocks; with dense and MoE blocks mixed, blocks are keyed per block and that axis is the
expert's alone.
"""

import re

import pytest

from model.builder import build_model
from model.config import ParallelConfig
from model.init import block_of, local_tensors
from tests.helpers import tiny_model

EXPERTS = dict(num_experts=4, moe_router_topk=2)
CASES = {
    # every block MoE: stacked, the leading axes are (block, expert)
    "stacked": dict(EXPERTS, moe_shared_expert_intermediate_size=32),
    # MoE in blocks 0 and 2, experts with biases: keyed per block, one leading expert axis
    "alternate-biases": dict(EXPERTS, moe_layer_freq=2, add_bias_linear=True),
    # MoE in blocks 1 and 3 only, so no expert index can pass for its block by chance
    "list": dict(EXPERTS, moe_layer_freq=[0, 1, 0, 1]),
}


def owner_blocks(chunk) -> dict[int, int | None]:
    """id of each parameter and buffer -> the block of the module holding it (None outside)."""
    out = {}
    named = [*chunk.named_parameters(), *chunk.named_buffers()]
    for name, tensor in named:
        found = re.search(r"decoder\.layers\.(\d+)\.", name)
        out[id(tensor)] = int(found.group(1)) if found else None
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_every_tensor_gets_its_own_block(single_rank, case):
    [chunk] = build_model(tiny_model("pre", **CASES[case]), ParallelConfig(), seed=3)
    owners = owner_blocks(chunk)
    seen_experts = set()
    for tensor in local_tensors(chunk):
        data = tensor.data
        owner = id(data) if id(data) in owners else id(data._base)  # SwiGLU fc1's halves
        assert owner in owners, tensor.key
        assert block_of(tensor) == owners[owner], (tensor.key, tensor.global_offset)
        if ".experts." in tensor.key:
            seen_experts.add((block_of(tensor), tensor.global_offset[tensor.prepend_axis_num - 1]))
    moe = [i for i, is_moe in enumerate(tiny_model("pre", **CASES[case]).moe_blocks) if is_moe]
    assert seen_experts == {(block, expert) for block in moe for expert in range(4)}
