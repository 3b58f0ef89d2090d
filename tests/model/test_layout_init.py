"""A fresh model is a function of the seed and the config only, whatever the layout.

Its parameter count too: every layout reports the single-process count (a norm weight
replicated on both TP ranks, or the last stage's copy of tied embeddings, counts once).

Each layout builds the model from the seed alone (no weights loaded) in spawned gloo ranks; its
initial weights, read back unsharded through the checkpoint format, must equal the
single-process model's exactly, and its step-1 loss must match. The in-process tests check
the distributions ``model.init`` promises (model/init.py).
"""

import json
import math

import pytest
import torch

from model.builder import build_model, count_parameters, wrap_ddp
from model.config import ParallelConfig
from runtime import weights
from runtime.schedule import forward_backward
from tests.helpers import MBS, SEQ, batches, one_thread, spawn, tiny_model
from tests.parity_worker import MICROBATCHES, run_fresh

SEED = 1234
CASES = {  # name: (scheme, model fields)
    "siamese": ("siamese", {}),
    # tied embeddings: under PP the last stage's output layer is a copy of stage 0's embedding
    "hybrid-tied-olmo": ("siamese_hybrid", {"init": "full_megatron",
                                            "untie_embeddings_and_output_weights": False}),
    "deepnorm": ("deepnorm", {}),
    "mhc": ("mhc", {}),  # its mappings' phi is drawn by the scheme's own init_std
}
LAYOUTS = {"tp2": (2, dict(tp=2)), "pp2": (2, dict(pp=2)), "pp2-vp2": (2, dict(pp=2, vp=2)),
           "tp2-pp2": (4, dict(tp=2, pp=2))}
# Models with experts: megatron's checkpoint view numbers experts globally (an extra leading
# axis of each expert tensor), so a rank holding experts 2 and 3 draws what one process draws
# for them. Experts in every block beside a shared expert; and in every other block, so dense
# and MoE blocks are keyed per block.
EXPERTS = dict(num_experts=4, moe_router_topk=2)
EXPERT_CASES = {
    "siamese-experts": ("siamese", {**EXPERTS, "moe_shared_expert_intermediate_size": 32}),
    "pre-experts-alternate": ("pre", {**EXPERTS, "moe_layer_freq": 2}),
}
EXPERT_LAYOUTS = {"ep2": (2, dict(ep=2)),
                  # the experts split by tensor parallelism too (parallel.etp = tp)
                  "ep2-tp2-sp": (4, dict(ep=2, tp=2, sequence_parallel=True))}
PAR = ParallelConfig(distributed_optimizer=False)


def single_process(scheme: str, overrides: dict) -> tuple[float, dict]:
    chunks = wrap_ddp(build_model(tiny_model(scheme, **overrides), PAR, norm_backend="torch",
                                  seed=SEED), PAR)
    losses = forward_backward(chunks, batches(MICROBATCHES), MICROBATCHES, SEQ, MBS)
    params = {n: p.detach().clone() for n, p in chunks[0].module.named_parameters()}
    return float(sum(losses)) / len(losses), params


def test_single_process_count_is_the_sum_of_tensor_sizes(single_rank):
    """The reference the layouts are held to, counted independently: every tensor of the
    one-process model (tied embeddings are one tensor there)."""
    for scheme, overrides in (*CASES.values(), *EXPERT_CASES.values()):
        [model] = build_model(tiny_model(scheme, **overrides), PAR, norm_backend="torch")
        unique = {id(p): p.numel() for p in model.parameters()}
        assert count_parameters([model]) == sum(unique.values()) > 0


@pytest.fixture(scope="module")
def expected(single_rank):
    return {name: single_process(*case) for name, case in CASES.items()}


@pytest.fixture(scope="module")
def expected_experts(single_rank):
    with one_thread():  # as the ranks compute (tests.helpers.one_thread)
        return {name: single_process(*case) for name, case in EXPERT_CASES.items()}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fresh_layout_starts_from_the_single_process_model(expected, layout, tmp_path):
    check_fresh(expected, CASES, *LAYOUTS[layout], tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(EXPERT_LAYOUTS))
def test_fresh_expert_layout_starts_from_the_single_process_model(expected_experts, layout,
                                                                  tmp_path):
    """Models with experts under expert parallelism start from the one-process weights (every
    routed expert, router and shared expert), count its parameters and give its step-1 loss."""
    check_fresh(expected_experts, EXPERT_CASES, *EXPERT_LAYOUTS[layout], tmp_path)


def check_fresh(expected: dict, cases: dict, world: int, fields: dict, tmp_path) -> None:
    """Build ``cases`` fresh in ``world`` ranks of layout ``fields``; hold their weights,
    parameter counts and losses to the single-process ``expected``."""
    spawn(world, run_fresh, fields, cases, str(tmp_path), SEED)
    for name, (scheme, overrides) in cases.items():
        ref_loss, ref_params = expected[name]
        [model] = build_model(tiny_model(scheme, **overrides), PAR, norm_backend="torch",
                              seed=SEED + 99)  # other weights, overwritten by the load
        weights.load([model], str(tmp_path / name / "weights"))
        for param_name, param in model.named_parameters():
            assert torch.equal(param.detach(), ref_params[param_name]), (name, param_name)
        count = json.loads((tmp_path / name / "parameters.json").read_text())
        assert count == sum(p.numel() for p in ref_params.values()), (name, count)
        loss = json.loads((tmp_path / name / "loss.json").read_text())
        assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (name, loss, ref_loss)


def test_same_seed_same_model_other_seed_other_model(single_rank):
    cfg = tiny_model("siamese")
    a, b, c = (dict(build_model(cfg, PAR, seed=s)[0].named_parameters()) for s in (5, 5, 6))
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert not torch.equal(a["decoder.layers.0.self_attention.linear_qkv.weight"],
                           c["decoder.layers.0.self_attention.linear_qkv.weight"])


@pytest.mark.parametrize("scheme", ["pre", "olmo2"])
@pytest.mark.parametrize("method", ["normal", "full_megatron"])
def test_init_distributions(single_rank, method, scheme):
    """std per weight kind, megatron's depth scaling of output projections (none for OLMo 2,
    which draws every weight at one std), the output layer rule, and full_megatron's
    truncation at 3 std (a normal draw this size passes 3 std)."""
    cfg = tiny_model(scheme, hidden_size=64, num_attention_heads=4, num_query_groups=4,
                     ffn_hidden_size=256, vocab_size=4096, num_layers=8, init=method,
                     init_method_std=0.05)
    params = dict(build_model(cfg, PAR, seed=3)[0].named_parameters())
    std = cfg.init_method_std
    output_std = 64 ** -0.5 if method == "full_megatron" else std
    branch_out_std = std if scheme == "olmo2" else std / math.sqrt(2 * cfg.num_layers)
    wanted = {"embedding.word_embeddings.weight": std,
              "output_layer.weight": output_std,
              "decoder.layers.0.self_attention.linear_qkv.weight": std,
              "decoder.layers.0.mlp.linear_fc1.weight": std,
              "decoder.layers.0.self_attention.linear_proj.weight": branch_out_std,
              "decoder.layers.0.mlp.linear_fc2.weight": branch_out_std}
    for key, sigma in wanted.items():
        values = params[key].detach().double()
        truncated = method == "full_megatron"
        # a normal truncated at 3 sigma has std 0.9866 sigma
        assert values.std().item() == pytest.approx(sigma * (0.9866 if truncated else 1), rel=0.05)
        peak = values.abs().max().item()
        assert (peak <= 3 * sigma + 1e-7) if truncated else (peak > 3 * sigma), (key, peak)
    for name, param in params.items():
        if "norm" in name:
            assert bool((param == 1).all()), name


def test_mhc_phi_is_drawn_at_its_std(single_rank):
    """mhc's phi, the one random parameter a scheme draws itself (``init_std``): normal with
    std 1/sqrt(n C), the same in every block and sublayer, each drawn apart."""
    cfg = tiny_model("mhc", hidden_size=64, num_attention_heads=4, num_query_groups=4,
                     ffn_hidden_size=128)
    params = dict(build_model(cfg, PAR, seed=3)[0].named_parameters())
    phis = [p.detach().double() for n, p in params.items() if n.endswith("_mhc.phi")]
    assert len(phis) == 2 * cfg.num_layers
    for phi in phis:
        assert phi.std().item() == pytest.approx((cfg.hc_rate * 64) ** -0.5, rel=0.05)
    assert not torch.equal(phis[0], phis[1])
