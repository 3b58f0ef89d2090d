"""What each residual scheme's layer keeps for backward, counted tensor by tensor on the real
model (Triton norms, interpreted on a CPU machine), against the dry run's per-layer estimate.

The estimate (``pretrain.report.dry_run``) is derived from the code's design, tensor by tensor,
a scheme's own share declared with it (``Traits.kept``, :mod:`model.kept`) and a norm's with
its kind (``kernels.normalizations.Kept``); the count comes from autograd's saved-tensor
hooks (``bench.saved_activations``), so a module that starts keeping one more activation, or
a kernel that stops keeping one, shows here, for every scheme under every normalization.
"""

from __future__ import annotations

import pytest

from bench import saved_activations
from kernels import normalizations
from model.config import ModelConfig
from model.schemes import ResidualScheme
from tests.helpers import NORMS, norm_fields

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


DEFAULT_NORM = NORMS[0]


@pytest.fixture(scope="module")
def measured(single_rank):
    """Bytes per token and layer, measured and estimated, for each scheme and normalization,
    counted once a pair is first asked for."""
    found = {}

    def layer(scheme: str, norm: str = DEFAULT_NORM) -> dict:
        if (scheme, norm) not in found:
            found[scheme, norm] = saved_activations.layer_bytes(ARGS, scheme, norm_fields(norm))
        return found[scheme, norm]
    return layer


@pytest.fixture(scope="module")
def kept(measured):
    """Bytes per token and layer, measured and estimated, for each scheme (RMSNorm)."""
    return {s: measured(s) for s in SCHEMES}


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_estimate_accounts_for_every_kept_activation(measured, scheme, norm):
    """Every registered scheme under every normalization: what autograd keeps per token and
    layer equals the dry run's estimate, the norms' share (statistics, a DyT's fp32 copies)
    and a scheme's own per-token tensors (gates, mixing weights) included, so a tensor kept
    and not counted (or counted and not kept) fails here, naming the pair and the bytes."""
    result = measured(scheme, norm)
    gap = result["measured"] - result["estimated"]
    assert abs(gap) <= ROUNDING, (
        f"{scheme} with {norm}: a layer keeps {result['measured']:.0f} bytes per token for "
        f"backward, the dry run estimates {result['estimated']:.0f} ({gap:+.0f}): find the "
        "tensor (autograd's saved-tensor hooks, as bench.saved_activations counts). One the "
        "layer should not keep (a computation in the wrong dtype, a copy) is fixed in the "
        "layer, and tests/model/test_precision.py names a dtype; one a norm keeps is declared "
        "by its kind (Kept, kernels/normalizations.py); one the scheme keeps outside its "
        "branches, in its Traits.kept (model/kept.py)")


FP32_ARGS = saved_activations.parse_args([*[f"--{k}={v}" for k, v in vars(ARGS).items()
                                            if k in ("hidden", "heads", "ffn", "seq", "vocab")],
                                          "--dtype=fp32"])


def _by_dtype(norm: str) -> bool:
    """Whether a kind declares keeping another share in fp32 than in bf16 (a DyT keeps its
    input itself in fp32, a copy in bf16)."""
    kind = normalizations.kind(norm_fields(norm)["normalization"])
    return kind.kept(4) != kind.kept(2)


@pytest.mark.parametrize("norm", [n for n in NORMS if _by_dtype(n)])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_estimate_follows_the_dtype(single_rank, scheme, norm):
    """In an fp32 model, every scheme under each normalization whose kept share depends on the
    dtype: the estimate holds there too (the kernels' share does not change with it)."""
    result = saved_activations.layer_bytes(FP32_ARGS, scheme, norm_fields(norm))
    gap = result["measured"] - result["estimated"]
    assert abs(gap) <= ROUNDING, (
        f"{scheme} with {norm} in fp32: a layer keeps {result['measured']:.0f} bytes per "
        f"token, the dry run estimates {result['estimated']:.0f} ({gap:+.0f}): what the kind "
        "keeps in fp32 is declared by its Kept (kernels/normalizations.py)")


CP_ARGS = saved_activations.parse_args([*[f"--{k}={v}" for k, v in vars(ARGS).items()
                                          if k in ("hidden", "heads", "ffn", "seq", "vocab")],
                                        "--cp=2"])


@pytest.fixture(scope="module")
def kept_cp():
    """Bytes per token of a rank's share and layer under context parallelism 2 (two gloo
    processes), for each scheme."""
    return {r["scheme"]: r for r in saved_activations.count(CP_ARGS, SCHEMES)}


@pytest.mark.parametrize("scheme", SCHEMES)
def test_estimate_holds_per_context_parallel_rank(kept_cp, scheme):
    """Every registered scheme under CP=2: a rank keeps its share's activations and the
    whole sequence's gathered K and V (and each chunk's output besides their concatenation),
    and the QKV output only where a head norm keeps it: the estimate per token of its share
    is what autograd keeps there (less the CPU's materialised lower-right causal masks, which
    CUDA's flash attention does not form)."""
    result = kept_cp[scheme]
    gap = result["measured"] - result["estimated"]
    assert abs(gap) <= ROUNDING, (
        f"{scheme} under parallel.cp 2: a layer keeps {result['measured']:.0f} bytes per token "
        f"of a rank's share, the dry run estimates {result['estimated']:.0f} ({gap:+.0f}): "
        "the attention's terms under context parallelism are in "
        "pretrain/report/dry_run.py (_layer_bytes), the gather in model/context_parallel.py")


def test_second_stream_costs_one_value_per_token_and_layer(kept):
    """Each sublayer entry reads x and y where Pre-Norm reads one h, but the MLP entry keeps only
    the attention output r (the updated streams and u are recomputed from the layer input,
    which the attention entry keeps): SiameseNorm keeps h more per layer than Pre-Norm, the
    hybrid form 2h more than HybridNorm (whose attention has no norm in front to keep an
    input; the channel gate keeps x itself, no fp32 copy), each besides its norms'
    statistics (8 bytes per row of the fused kernels)."""
    h = HIDDEN * WIDTH

    def stats(scheme: str) -> int:
        outside = ResidualScheme(scheme).traits.kept(ModelConfig(residual_scheme=scheme),
                                                     WIDTH, True)
        return 8 * (outside.norms + outside.shared_norms)

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
