"""Total and active parameters of mixture-of-experts models (model/sizes.py), counted on built
models and against hand computations."""

import pytest

from model.builder import build_model, count_parameters
from model.config import ParallelConfig
from model.sizes import parameter_count, whole_model_count
from tests.helpers import tiny_model

H, KV, F, E, K, F_E, F_S = 32, 16, 64, 8, 2, 24, 40  # tiny_model: 4 heads of 8, 2 KV groups
MOE = dict(num_experts=E, moe_router_topk=K, moe_ffn_hidden_size=F_E,
           moe_shared_expert_intermediate_size=F_S, moe_layer_freq=[1, 0, 1, 1])


def _count(model):
    """This rank's counts, checked against the whole model's (one rank: the same numbers),
    which the start line reports."""
    chunks = build_model(model, ParallelConfig(), seed=1)
    counted = parameter_count(chunks)
    assert whole_model_count(chunks) == counted
    return count_parameters(chunks), counted


def test_pre_norm_moe_counted_by_hand(single_rank):
    """Pre-Norm, untied embeddings, SwiGLU, GQA; blocks 0, 2 and 3 MoE, block 1 dense. Every
    block: QKV h (h + 2 kv), projection h^2, two norms h. An MoE block: router E h, shared
    expert 3 h f_s, and E routed experts of 3 h f_e, of which a token uses k; a dense block:
    3 h f. Once: embedding and output layer V h each, final norm h."""
    model = tiny_model("pre", **MOE)
    total, counted = _count(model)
    V = model.padded_vocab_size
    block = H * (H + 2 * KV) + H * H + 2 * H
    moe_used = E * H + 3 * H * F_S
    expert = 3 * H * F_E
    once = 2 * V * H + H
    assert counted.routed == 3 * E * expert
    assert counted.total == total == once + 4 * block + 3 * (moe_used + E * expert) + 3 * H * F
    assert counted.active(model) == once + 4 * block + 3 * (moe_used + K * expert) + 3 * H * F
    assert counted.dense == counted.total - counted.routed


@pytest.mark.parametrize("scheme", ["siamese", "siamese_hybrid", "hc", "mixln"])
def test_a_schemes_own_parameters_are_active(single_rank, scheme):
    """Whatever a scheme adds (SiameseNorm's six norms and merge, hyper-connections' mixing
    weights, Mix-LN's Post-Norm blocks) every token uses: the active count is the total less
    the (E - k) routed experts each MoE block's token skips, counted by hand."""
    model = tiny_model(scheme, **MOE)
    total, counted = _count(model)
    skipped = 3 * (E - K) * 3 * H * F_E  # three MoE blocks
    assert counted.total == total and counted.routed == 3 * E * 3 * H * F_E
    assert counted.active(model) == total - skipped


def test_a_dense_model_is_all_active(single_rank):
    model = tiny_model("siamese")
    total, counted = _count(model)
    assert counted.routed == 0 and counted.active(model) == counted.total == total


def test_every_expert_is_active_with_top_k_of_all(single_rank):
    model = tiny_model("pre", **{**MOE, "moe_router_topk": E})
    total, counted = _count(model)
    assert counted.active(model) == total
