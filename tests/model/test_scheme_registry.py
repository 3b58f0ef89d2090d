"""The scheme registry is the one list of schemes: every registered scheme has its layer file,
and what its traits say about a block holds for the block the model builds."""

import pytest
import torch

from model.builder import build_model
from model.config import ParallelConfig
from model.layers import SCHEME_FILES
from model.schemes import ResidualScheme
from tests.helpers import tiny_model


def test_every_scheme_has_its_layer_file():
    assert set(SCHEME_FILES) == set(ResidualScheme)
    for scheme, module in SCHEME_FILES.items():
        assert module.__name__ == f"model.layers.{scheme.value}", scheme


def block_norms(block: torch.nn.Module, hidden: int) -> list[str]:
    """The block's own hidden-size norms: its direct children named ``*norm*`` whose weight
    is one value per channel (the attention's per-head norms live inside it)."""
    return [name for name, child in block.named_children()
            if "norm" in name and getattr(child, "weight", None) is not None
            and tuple(child.weight.shape) == (hidden,)]


@pytest.mark.parametrize("scheme", [s for s in ResidualScheme if not s.traits.two_stream
                                    and s is not ResidualScheme.HC])
def test_stream_norms_counts_the_norms_a_block_holds(single_rank, scheme):
    """``Traits.stream_norms`` is the dry run's count of the h-sized tensors a single-stream
    block keeps for its norms: each norm keeps its input, so it must be the norms built."""
    cfg = tiny_model(scheme)
    [model] = build_model(cfg, ParallelConfig())
    last = model.decoder.layers[-1]  # past HybridNorm*'s block 0 and Mix-LN's Post-Norm blocks
    assert len(block_norms(last, cfg.hidden_size)) == scheme.traits.stream_norms, \
        block_norms(last, cfg.hidden_size)
