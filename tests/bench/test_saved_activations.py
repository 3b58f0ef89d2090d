"""What each residual scheme's layer keeps for backward, counted tensor by tensor on the real
model (Triton norms, interpreted on a CPU machine), against the dry run's per-layer estimate.

The estimate (``pretrain.report.dry_run``) is derived from the code's design, tensor by tensor,
a scheme's own share declared with it (``Traits.stream_values``, ``Traits.token_bytes``); the
count comes from autograd's saved-tensor hooks (``bench.saved_activations``), so a module that
starts keeping one more activation, or a kernel that stops keeping one, shows here.
"""

from __future__ import annotations

import pytest

from bench import saved_activations
from model.config import ModelConfig
from model.schemes import ResidualScheme

pytestmark = pytest.mark.slow

HIDDEN, HEADS = 256, 16
WIDTH = 2  # bf16
ARGS = saved_activations.parse_args([f"--hidden={HIDDEN}", f"--heads={HEADS}", "--ffn=512",
                                     "--seq=64", "--vocab=256"])
SCHEMES = [s.value for s in ResidualScheme]
# Bytes per token and layer the count and the estimate may differ by: none. The count adds
# up whole storages, and its share per token is the growth between two token counts
# (bench.saved_activations), so nothing is rounded and what a layer keeps once (mHC's fp32
# gate vectors, 192 B per layer at n = 4) drops out; every per-token term of the estimate is
# an integer number of bytes. So one value per token kept and not counted, even a single bf16
# scalar per token (2 B), fails.
ROUNDING = 0


@pytest.fixture(scope="module")
def kept(single_rank):
    """Bytes per token and layer, measured and estimated, for each scheme."""
    return {s: saved_activations.layer_bytes(ARGS, s) for s in SCHEMES}


@pytest.mark.parametrize("scheme", SCHEMES)
def test_estimate_accounts_for_every_kept_activation(kept, scheme):
    """Every registered scheme: what autograd keeps per token and layer equals the dry run's
    estimate, a scheme's own per-token tensors (norm statistics, gates, mixing weights)
    included, so a tensor kept and not counted (or counted and not kept) fails here, naming
    the scheme and the bytes."""
    gap = kept[scheme]["measured"] - kept[scheme]["estimated"]
    assert abs(gap) <= ROUNDING, (
        f"{scheme}: a layer keeps {kept[scheme]['measured']:.0f} bytes per token for backward, "
        f"the dry run estimates {kept[scheme]['estimated']:.0f} ({gap:+.0f}): find the "
        "tensor (autograd's saved-tensor hooks, as bench.saved_activations counts). One the "
        "layer should not keep "
        "(a computation in the wrong dtype, a copy) is fixed in the layer, and "
        "tests/model/test_precision.py names a dtype; one the scheme needs is declared in its "
        "Traits.token_bytes (h-sized ones in stream_values)")


def test_second_stream_costs_one_value_per_token_and_layer(kept):
    """Each sublayer entry reads x and y where Pre-Norm reads one h, but the MLP entry keeps only
    the attention output r (the updated streams and u are recomputed from the layer input,
    which the attention entry keeps): SiameseNorm keeps h more per layer than Pre-Norm, the
    hybrid form 2h more than HybridNorm (whose attention has no norm in front to keep an
    input; the channel gate keeps x itself, no fp32 copy), each besides its norms'
    statistics (``Traits.token_bytes``)."""
    h = HIDDEN * WIDTH

    def stats(scheme: str) -> int:
        return ResidualScheme(scheme).traits.token_bytes(ModelConfig(residual_scheme=scheme),
                                                          WIDTH)

    extra = kept["siamese"]["measured"] - kept["pre"]["measured"]
    extra_hybrid = kept["siamese_hybrid"]["measured"] - kept["hybridnorm"]["measured"]
    assert extra == h + stats("siamese") - stats("pre"), extra
    assert extra_hybrid == 2 * h + stats("siamese_hybrid") - stats("hybridnorm"), extra_hybrid


# Mixture of experts: the MLP sublayer is megatron's MoE layer (router, permutation, experts,
# shared expert), estimated by pretrain.report.expert_activations. Four experts of 128, top-2,
# a shared expert of 128 and the z-loss: every term of the sublayer is present in every scheme.
MOE_ARGS = saved_activations.parse_args([*[f"--{k}={v}" for k, v in vars(ARGS).items()
                                           if k in ("hidden", "heads", "ffn", "seq", "vocab")],
                                         "--experts=4", "--topk=2", "--expert-ffn=128",
                                         "--shared-ffn=128"])
MOE_EVERY_TERM = {"moe_z_loss_coeff": 1e-3}
# The router's variants, one scheme: each changes which tensors the router and the
# permutation keep (pretrain.report.expert_activations._router_bytes).
ROUTERS = {  # each variant's terms add up, so one variant can hold several
    "pre-softmax top-1, GELU experts": {"moe_router_topk": 1, "moe_router_pre_softmax": True,
                                        "activation": "gelu"},
    "sigmoid, expert bias, top-3 of 8, sequence aux loss": {
        "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
        "num_experts": 8, "moe_router_topk": 3,
        "moe_router_load_balancing_type": "seq_aux_loss"},
    "sigmoid top-1, no balancing, capacity 1.5 padded": {
        "moe_router_score_function": "sigmoid", "moe_router_topk": 1,
        "moe_router_load_balancing_type": "none", "moe_expert_capacity_factor": 1.5,
        "moe_pad_expert_input_to_capacity": True},
    "capacity 4, no drops": {"moe_expert_capacity_factor": 4.0},
}


@pytest.fixture(scope="module")
def kept_moe(single_rank):
    """Bytes per token and layer of an MoE block, measured and estimated, for each scheme."""
    return {s: saved_activations.layer_bytes(MOE_ARGS, s, MOE_EVERY_TERM) for s in SCHEMES}


def _assert_estimated(result: dict, what: str) -> None:
    gap = result["measured"] - result["estimated"]
    assert abs(gap) <= ROUNDING, (
        f"{what}: a layer keeps {result['measured']:.0f} bytes per token for backward, the "
        f"dry run estimates {result['estimated']:.0f} ({gap:+.0f}): count the MoE layer's "
        f"tensors in pretrain/report/expert_activations.py")


@pytest.mark.parametrize("scheme", SCHEMES)
def test_estimate_accounts_for_every_kept_activation_with_experts(kept_moe, scheme):
    """Every registered scheme with experts: the same exact check as the dense one, the MoE
    layer's router, permutation, experts and shared expert in place of one MLP."""
    _assert_estimated(kept_moe[scheme], f"{scheme} with experts")


@pytest.mark.parametrize("router", list(ROUTERS))
def test_estimate_follows_the_router(single_rank, router):
    """Each router variant (score function, pre-softmax, balancing loss, capacity with and
    without padding, k and E, the experts' activation) keeps what the estimate counts."""
    result = saved_activations.layer_bytes(MOE_ARGS, "siamese",
                                           {**MOE_EVERY_TERM, **ROUTERS[router]})
    _assert_estimated(result, f"siamese with experts, {router}")


def test_experts_replace_the_mlp_around_the_same_block(kept, kept_moe):
    """The block around the MLP sublayer keeps the same with experts: the difference between
    a scheme's MoE and dense layer is the same for every scheme (what pre's is)."""
    change = {s: kept_moe[s]["measured"] - kept[s]["measured"] for s in SCHEMES}
    assert len(set(change.values())) == 1, change
