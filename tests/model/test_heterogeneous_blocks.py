"""Models whose blocks hold different parameters save and load their weights.

megatron's checkpoint stacks each layer parameter over the blocks, which needs every block to
hold it; Mix-LN's split and HybridNorm*'s block 0 break that, so their blocks are keyed by
global index (PP resharding of Mix-LN is covered by the parallel-parity test).
"""

import pytest
import torch

from model.builder import build_model
from model.config import ParallelConfig
from runtime import weights
from tests.helpers import tiny_model


@pytest.mark.parametrize("scheme,extra", [
    ("mixln", {"mixln_post_ratio": 0.5}),
    ("hybridnorm", {"hybrid_first_block": "prenorm"}),
    ("siamese_hybrid", {"hybrid_first_block": "prenorm"}),
], ids=["mixln", "hybridnorm*", "siamese_hybrid*"])
@pytest.mark.slow
def test_checkpoint_round_trip(single_rank, scheme, extra, tmp_path):
    cfg = tiny_model(scheme, **extra)
    torch.manual_seed(0)
    [saved] = build_model(cfg, ParallelConfig())
    torch.manual_seed(1)
    [loaded] = build_model(cfg, ParallelConfig())
    weights.save([saved], str(tmp_path))
    weights.load([loaded], str(tmp_path))
    expected = dict(saved.named_parameters())
    for name, param in loaded.named_parameters():
        torch.testing.assert_close(param, expected[name], rtol=0, atol=0)
