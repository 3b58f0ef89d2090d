"""Structural properties of the two-stream schemes: gradients reach every norm, overhead."""

import pytest
import torch

from model.builder import build_model, count_parameters, wrap_ddp
from model.config import ModelConfig, ParallelConfig
from runtime.schedule import forward_backward
from tests.helpers import MBS, SEQ, batches, tiny_model


@pytest.mark.parametrize("scheme,extra", [
    ("siamese", {}), ("siamese_hybrid", {}),
    ("siamese_hybrid", {"hybrid_first_block": "prenorm"}),
])
def test_every_norm_and_gate_gets_gradient(single_rank, scheme, extra):
    torch.manual_seed(0)
    par = ParallelConfig(distributed_optimizer=False)
    [ddp] = wrap_ddp(build_model(tiny_model(scheme, **extra), par), par)
    forward_backward([ddp], batches(1), 1, SEQ, MBS)
    model = ddp.module
    names = [n for n, _ in model.named_parameters() if "norm" in n or "gate" in n]
    # Three norms per sublayer (siamese), plus the merge's three; hybrid adds Q/K/V norms + g.
    assert len(names) >= 6 * tiny_model(scheme).num_layers
    for name, param in model.named_parameters():
        if name in names:
            assert param.main_grad.abs().sum() > 0, name


PAPER_SHAPE = dict(num_layers=16, hidden_size=2048, num_attention_heads=32, num_query_groups=8,
                   ffn_hidden_size=8192, vocab_size=50304, seq_length=4096)


def parameters(scheme: str) -> int:
    with torch.device("meta"):  # shapes only: no memory, no initialisation cost
        return count_parameters(build_model(ModelConfig(residual_scheme=scheme, **PAPER_SHAPE),
                                            ParallelConfig()))


@pytest.mark.parametrize("scheme", ["siamese", "siamese_hybrid"])
def test_two_stream_parameter_overhead_below_0_1_percent(single_rank, scheme):
    pre, two = parameters("pre"), parameters(scheme)
    overhead = (two - pre) / pre
    print(f"{scheme}: {two:,} vs pre {pre:,} parameters: +{100 * overhead:.4f}%")
    assert 0 < overhead < 1e-3
