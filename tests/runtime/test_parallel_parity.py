"""TP, SP, PP (1F1B and interleaved), TPxPP and DP runs on gloo match the unsharded model, and
so do the expert-parallel layouts of models with experts (EP, EP x TP with SP, EP x PP, DP).

The unsharded model runs in this process, takes a few Adam steps (so its loss is well below
ln V and a wrong layout shows in the loss too, not only in the gradients) and writes its
weights as a distributed checkpoint; each layout loads them (resharding through megatron's
checkpoint format), runs the same four microbatches, and writes its loss and its gradients (as
a checkpoint, so they come back unsharded). Gradients are compared parameter by parameter; with
experts, each router's gradient holds its balancing and z losses' too (megatron adds them in
backward), and their values are compared as megatron reports them.
"""

import json
import math
import os

import pytest
import torch
from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

from model.builder import build_model, wrap_ddp
from model.config import ParallelConfig
from model.schemes import ResidualScheme
from runtime import weights
from runtime.schedule import forward_backward
from tests.helpers import (
    MBS,
    NORMS,
    SEQ,
    VOCAB,
    batches,
    norm_fields,
    one_thread,
    perturb_every_parameter,
    spawn,
    tiny_model,
)
from tests.parity_worker import MICROBATCHES, router_losses, run_layout

SCHEMES = ["siamese", "siamese_hybrid"]
# Every other registered scheme, under every layout too (the test below)
BASELINES = [s.value for s in ResidualScheme if s.value not in SCHEMES]
LAYOUTS = {
    "tp2": dict(tp=2),
    "tp2-sp": dict(tp=2, sequence_parallel=True),
    "pp2": dict(pp=2),
    "pp2-vp2": dict(pp=2, vp=2),
    "tp2-pp2": dict(tp=2, pp=2),
    "dp2": dict(),
    "cp2": dict(cp=2),
    "cp2-tp2-sp": dict(cp=2, tp=2, sequence_parallel=True),
    "cp2-pp2": dict(cp=2, pp=2),
}
TRAIN_STEPS = 5
# fp32 on gloo, the same weights and tokens; only the order of sums differs between layouts
# (TP splits the hidden and vocabulary reductions, DP the batch mean). Measured (2-core CPU,
# torch 2.13, 2026-11-25): loss <= 3.4e-8 relative, gradients <= 1.1e-6 of each tensor's
# largest entry (0 under PP alone). The bounds leave ~30x and ~40x of room; a layout that
# drops or duplicates one micro-batch, or routes one norm weight wrongly, misses by orders of
# magnitude more. hc is the exception: the gradient of its stream weights
# (decoder.layers.3.mlp_hc.output at TP=2) is a sum over tokens and streams that cancels to
# a small value, and its rounding under TP depends on the instruction set torch's CPU kernels
# take: 1.1e-4 of its largest entry with AVX-512, 3.4e-5 with AVX2, 4.0e-5 with none
# (2026-11-26; 8.6e-6 on the machine of 2026-11-25), so hc gets 5e-4. mhc's mapping weights
# (phi, its static part and gates) are sums of the same kind (9.5e-6 at TP=2 with AVX-512,
# 2026-11-27) and get the same bound; a parameter whose gradient is not summed over the TP
# ranks under SP misses by 0.3. A learned scalar (DyT's alpha) and the per-head Q/K/V norms
# are such sums too: with DyT, hybridnorm's block-1 Q norm weight came 4.1e-4 of its largest
# entry off at TP=2 (alpha 1.3e-4), where they had cancelled to little; their errors are held
# to a thousandth of the model's largest gradient entry where that is larger than their own.
LOSS_BOUND = 1e-6
GRAD_BOUND = 5e-5
GRAD_BOUNDS = {"hc": 5e-4, "mhc": 5e-4}
WORLD = {"tp2": 2, "tp2-sp": 2, "pp2": 2, "pp2-vp2": 2, "tp2-pp2": 4, "dp2": 2,
         "ep2": 2, "ep2-tp2-sp": 4, "ep2-pp2": 4, "tp2-sp-etp1": 2, "ep1-dp2": 2,
         "ep1-tp2-sp": 2, "cp2": 2, "cp2-tp2-sp": 4, "cp2-pp2": 4, "cp2-ep2": 2}

# Mixture of experts: every registered scheme with megatron's MoE layer as F (4 experts, top-2),
# its balancing loss and z-loss on at coefficients large enough that their share of each
# router's gradient shows. Three variants alternate over the registry, so every scheme runs one
# and each variant several schemes: experts in every block beside a shared expert; experts in
# every other block (dense and MoE blocks mix: checkpoints key them per block, and each
# pipeline stage holds one of each); and the per-sequence balancing loss with sigmoid scores.
EXPERTS = dict(num_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01)
EXPERT_VARIANTS = (dict(moe_shared_expert_intermediate_size=32), dict(moe_layer_freq=2),
                   dict(moe_router_load_balancing_type="seq_aux_loss",
                        moe_router_score_function="sigmoid"))
EXPERT_CASES = {scheme.value: {**EXPERTS, **EXPERT_VARIANTS[index % len(EXPERT_VARIANTS)]}
                for index, scheme in enumerate(ResidualScheme)}
EXPERT_LAYOUTS = {
    # experts split over the two ranks, the rest data-parallel: tokens cross by all-to-all
    "ep2": dict(ep=2),
    # the experts tensor-parallel too (parallel.etp = tp): each expert's tokens are gathered
    # over its two TP ranks in pieces of different lengths
    "ep2-tp2-sp": dict(ep=2, tp=2, sequence_parallel=True),
    "ep2-pp2": dict(ep=2, pp=2),
    # interleaved pipeline: each rank runs two chunks of blocks, an MoE block in a chunk of
    # its own in the every-other-block variant
    "pp2-vp2": dict(pp=2, vp=2),
    # whole experts (parallel.etp 1) beside TP=2: each expert on both ranks, its gradient
    # reduced over megatron's expert data-parallel group
    "tp2-sp-etp1": dict(tp=2, sequence_parallel=True, etp=1),
    # EP=1: the experts are expert parameters all the same (model.moe.mark_experts, so that
    # checkpoints reshard across ep), reduced over the expert data-parallel group, which here
    # holds the data-parallel ranks, and split over the expert TP group, the TP ranks
    "ep1-dp2": dict(),
    "ep1-tp2-sp": dict(tp=2, sequence_parallel=True),
    # context parallelism over the expert ranks: each routes its share of every sequence
    "cp2-ep2": dict(cp=2, ep=2),
}
# Every registered normalization besides the default rmsnorm (kernels.normalizations, with a
# bias where it is optional), alternating over the registry as the expert variants do, so each
# scheme runs one and each normalization several schemes under every layout: a norm parameter
# that is not summed over the TP ranks under SP (DyT's alpha, say) misses by orders of
# magnitude.
NORM_VARIANTS = [variant for variant in NORMS if variant != "rmsnorm"]
NORM_CASES = {scheme.value: norm_fields(NORM_VARIANTS[index % len(NORM_VARIANTS)])
              for index, scheme in enumerate(ResidualScheme)}
# What a norm's parameters meet under the layouts: TP with SP (each rank's partial gradients
# summed), the interleaved pipeline (stages and chunks that start their blocks elsewhere) and
# DP; TP without SP, PP alone and TP x PP add nothing for them (every scheme runs those with
# RMSNorm above).
NORM_LAYOUTS = ["tp2-sp", "pp2-vp2", "dp2"]
# The layouts after the first two run one scheme of each variant (the first two, whose
# dispatch differs most from one process's, run every scheme).
EXPERT_SUBSET = list(EXPERT_CASES)[1:1 + len(EXPERT_VARIANTS)]
TRAIN_STEPS_EXPERTS = 2


@pytest.fixture(scope="module")
def reference(single_rank, tmp_path_factory):
    """Unsharded weights, loss and gradients for each scheme."""
    root = tmp_path_factory.mktemp("reference")
    par = ParallelConfig(distributed_optimizer=False)
    out = {}
    for scheme in SCHEMES + BASELINES:
        out[scheme] = _reference(root, scheme, par)
    return root, out


@pytest.fixture(scope="module")
def expert_reference(single_rank, tmp_path_factory):
    """The same for every scheme with experts (:data:`EXPERT_CASES`), with its routers'
    losses."""
    root = tmp_path_factory.mktemp("expert-reference")
    par = ParallelConfig(distributed_optimizer=False)
    with one_thread():
        return root, {scheme: _reference(root, scheme, par, overrides)
                      for scheme, overrides in EXPERT_CASES.items()}


@pytest.fixture(scope="module")
def norm_reference(single_rank, tmp_path_factory):
    """The same for every scheme with its normalization (:data:`NORM_CASES`)."""
    root = tmp_path_factory.mktemp("norm-reference")
    par = ParallelConfig(distributed_optimizer=False)
    return root, {scheme: _reference(root, scheme, par, fields)
                  for scheme, fields in NORM_CASES.items()}


def _reference(root, scheme: str, par: ParallelConfig,
               overrides: dict | None = None) -> tuple[float, dict, dict]:
    """One scheme's unsharded weights (saved for the sharded ranks), loss, gradients and
    routers' losses (none without experts); ``overrides``: fields of its tiny model."""
    torch.manual_seed(7)
    # the torch reference path on every machine
    model = tiny_model(scheme, **(overrides or {}))
    chunks = wrap_ddp(build_model(model, par, norm_backend="torch"), par)
    # every parameter off its start (norms away from 1, scales away from 0), so a misrouted
    # one shows
    perturb_every_parameter(chunks[0].module, 0.2)
    _train_a_little(chunks, TRAIN_STEPS_EXPERTS if model.num_experts else TRAIN_STEPS)
    weights.save(chunks, str(root / scheme / "weights"))
    chunks[0].zero_grad_buffer()
    get_moe_metrics_tracker().clear()  # the training steps' losses are not this pass's
    losses = forward_backward(chunks, batches(MICROBATCHES), MICROBATCHES, SEQ, MBS)
    grads = {n: p.main_grad.clone() for n, p in chunks[0].module.named_parameters()}
    return float(sum(losses)) / len(losses), grads, router_losses(model, MICROBATCHES)




def _train_a_little(chunks, steps: int = TRAIN_STEPS) -> None:
    """Adam steps on the parity batches, from the weights' own gradients (megatron's DDP
    keeps them in ``main_grad``)."""
    params = list(chunks[0].module.parameters())
    optimizer = torch.optim.Adam(params, lr=1e-2)
    for _ in range(steps):
        chunks[0].zero_grad_buffer()
        forward_backward(chunks, batches(MICROBATCHES), MICROBATCHES, SEQ, MBS)
        for p in params:
            p.grad = p.main_grad
        optimizer.step()
        for p in params:
            p.grad = None


@pytest.mark.slow  # the reference saves its weights through megatron's writer (a process)
def test_the_reference_is_trained_past_chance(reference):
    """Untrained, every model scores ~ln V on these random tokens, whatever its layout; after
    TRAIN_STEPS steps on them the loss must be clearly lower, so comparing it means something."""
    for scheme, (loss, *_) in reference[1].items():
        assert loss < math.log(VOCAB) - 0.3, (scheme, loss, math.log(VOCAB))


def read_grads(scheme_dir, overrides: dict | None = None) -> dict:
    par = ParallelConfig(distributed_optimizer=False)
    [model] = build_model(tiny_model(os.path.basename(scheme_dir), **(overrides or {})), par,
                          norm_backend="torch")
    weights.load([model], os.path.join(scheme_dir, "grads"))
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_unsharded(reference, layout, tmp_path):
    check_layout(reference, layout, SCHEMES, tmp_path)


# Context parallelism with pipeline stages meets the schemes only where any layout does (the
# packed [s/cp, b, n h] tensor between stages): the two SiameseNorm schemes run it; every
# scheme runs CP=2 and CP=2 x TP=2 + SP, where the attention and its head norms meet the split.
BASELINE_LAYOUTS = [name for name in LAYOUTS if name != "cp2-pp2"]


@pytest.mark.slow
@pytest.mark.parametrize("layout", BASELINE_LAYOUTS)
def test_baseline_layout_matches_unsharded(reference, layout, tmp_path):
    """Every other registered scheme under every layout: TP, TP with sequence parallelism (a
    parameter outside the tensor-parallel matmuls whose gradient is not summed over the TP
    ranks shows here), PP, PP x VP, TP x PP and DP (each layout's ranks run every scheme in
    one spawn: a few seconds a layout past the reference). Also checks that Mix-LN splits at
    its global block under PP: a stage that counted its own blocks from 0 would build
    different layers and fail to load the reference weights."""
    check_layout(reference, layout, BASELINES, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("layout", NORM_LAYOUTS)
def test_every_normalization_layout_matches_unsharded(norm_reference, layout, tmp_path):
    """Every registered scheme with another registered normalization (:data:`NORM_CASES`:
    layernorm, layernorm with its bias, DyT, in turn) under TP with SP, the interleaved
    pipeline and DP: loss and every gradient match one process, DyT's alpha under TP with SP
    among them."""
    check_layout(norm_reference, layout, list(NORM_CASES), tmp_path, overrides=NORM_CASES)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(EXPERT_LAYOUTS))
def test_expert_layout_matches_unsharded(expert_reference, layout, tmp_path):
    """Every registered scheme with experts under expert parallelism (EP=2; EP=2 x TP=2 with
    SP; EP=2 x PP=2), the interleaved pipeline (PP=2 x VP=2), TP=2 with whole experts
    reduced over the expert data-parallel group, and EP=1 under DP=2 and under TP=2 with SP
    (experts split like the rest by TP): the loss, every gradient (the routers' with their
    balancing and z losses' share) and the routers' losses as megatron reports them match
    one process. Each layout's ranks run its
    schemes in one spawn."""
    schemes = list(EXPERT_CASES) if layout in ("ep2", "ep2-tp2-sp") else EXPERT_SUBSET
    check_layout(expert_reference, layout, schemes, tmp_path, overrides=EXPERT_CASES)


@pytest.mark.slow
def test_global_balancing_loss_is_that_of_the_data_parallel_group(single_rank, tmp_path):
    """megatron's global_aux_loss is layout-dependent by design, by an exact relation. Its token
    counts per expert are summed over the micro-batches the data-parallel ranks run together,
    and each rank's loss takes its own tokens' router scores against them: the ranks' losses
    add up to that of their tokens together, and data parallelism then averages the ranks'
    gradients. So under EP=2 (data-parallel over both ranks) the model's gradients, loss and
    router losses are those of one process whose micro-batches hold both ranks' concurrent
    micro-batches, at half the balancing coefficient; at the same coefficient the router's
    gradient is not (the control)."""
    scheme, coeff = "siamese", EXPERTS["moe_aux_loss_coeff"]
    fields = {**EXPERTS, "moe_router_load_balancing_type": "global_aux_loss"}
    # rank r runs micro-batches r, r + 2 (parity_worker.mean_loss): 0 with 1, then 2 with 3
    parity = batches(MICROBATCHES)
    together = [{key: torch.cat([first[key], second[key]]) for key in first}
                for first, second in zip(parity[::2], parity[1::2], strict=True)]
    with one_thread():  # as the ranks compute (tests.helpers.one_thread)
        expected = {share: _global_balancing(scheme, {**fields, "moe_aux_loss_coeff":
                                                      share * coeff}, together, tmp_path)
                    for share in (0.5, 1.0)}  # the first perturbs and saves the weights
    check_layout((tmp_path / "reference", {scheme: expected[0.5]}), "ep2", [scheme], tmp_path,
                 overrides={scheme: fields})
    grads = read_grads(str(tmp_path / "work" / scheme), fields)
    router = "decoder.layers.0.mlp.router.weight"
    other = expected[1.0][1][router]
    err = ((grads[router] - other).abs().max() / other.abs().max()).item()
    print(f"ep2 global_aux_loss at the same coefficient: router grad rel err {err:.1e}")
    assert err > 100 * GRAD_BOUND, ("the same coefficient's router gradient", err)


def _global_balancing(scheme: str, fields: dict, microbatches: list[dict],
                      tmp_path) -> tuple[float, dict, dict]:
    """One process's loss, gradients and router losses over ``microbatches`` (each of twice
    the parity micro-batch size) with model ``fields``; the first call perturbs and saves the
    weights, later ones load them."""
    model = tiny_model(scheme, **fields)
    par = ParallelConfig(distributed_optimizer=False)
    chunks = wrap_ddp(build_model(model, par, norm_backend="torch"), par)
    saved = tmp_path / "reference" / scheme / "weights"
    if saved.exists():
        weights.load(chunks, str(saved))
    else:
        torch.manual_seed(7)
        perturb_every_parameter(chunks[0].module, 0.2)
        weights.save(chunks, str(saved))
    get_moe_metrics_tracker().clear()
    losses = forward_backward(chunks, microbatches, len(microbatches), SEQ, 2 * MBS)
    grads = {n: p.main_grad.clone() for n, p in chunks[0].module.named_parameters()}
    return float(sum(losses)) / len(losses), grads, router_losses(model, len(microbatches))


def _interpreter_problem() -> str | None:
    """Why Triton's CPU interpreter cannot run the kernels' row loops here, or None. It passes
    scalars as one-element arrays and, before Triton 3.9, turned them into loop bounds with
    int(), which NumPy 2.5 refuses (seen on a GPU image with Triton 3.6 and NumPy 2.5)."""
    import numpy
    import triton
    from packaging.version import Version

    if Version(numpy.__version__) >= Version("2.5") and Version(triton.__version__) < Version(
            "3.9"):
        return (f"Triton {triton.__version__}'s interpreter cannot run loops with runtime "
                f"bounds under NumPy {numpy.__version__}; the compiled kernels are checked on "
                "this GPU by tests/kernels/test_triton_kernels.py")
    return None


@pytest.mark.slow
def test_fused_kernels_under_sequence_parallelism(reference, tmp_path):
    """The Triton kernels (CPU interpreter) at TP=2 with sequence parallelism match the torch
    path unsharded: the norm weights they take get their gradients all-reduced over TP."""
    problem = _interpreter_problem()
    if problem:
        pytest.skip(problem)
    check_layout(reference, "tp2-sp", SCHEMES, tmp_path, backend="triton")


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (one per NCCL rank)")
@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_nccl_layouts_match_one_gpu(reference, layout, tmp_path):
    """TP=2 and PP=2 on NCCL, one GPU per rank with the fused kernels, match the unsharded
    model on one GPU (fp32, TF32 off)."""
    check_layout(reference, layout, SCHEMES, tmp_path, backend="triton", gpu=True)


def check_layout(reference, layout: str, schemes: list[str], tmp_path,
                 backend: str = "torch", gpu: bool = False,
                 overrides: dict[str, dict] | None = None) -> None:
    """Run ``schemes`` under ``layout`` from the reference weights and hold losses, gradients
    (and with experts the routers' losses) to the reference's; ``overrides``: fields of each
    scheme's tiny model."""
    root, expected = reference
    overrides = overrides or {}
    # Each layout writes its losses and gradients into its own folder.
    work = tmp_path / "work"
    for scheme in schemes:
        (work / scheme).mkdir(parents=True)
        os.symlink(root / scheme / "weights", work / scheme / "weights")
    spawn(WORLD[layout], run_layout, {**LAYOUTS, **EXPERT_LAYOUTS}[layout], schemes, str(work),
          None, backend, overrides, gpu=gpu)
    for scheme in schemes:
        where = f"{scheme} under {layout}"
        ref_loss, ref_grads, ref_routers = expected[scheme]
        loss = json.loads((work / scheme / "loss.json").read_text())
        loss_err = abs(loss - ref_loss) / abs(ref_loss)
        assert loss_err <= LOSS_BOUND, (where, "loss", loss, ref_loss)
        routers_file = work / scheme / "router_losses.json"
        routers = json.loads(routers_file.read_text()) if routers_file.exists() else {}
        assert routers.keys() == ref_routers.keys(), (where, "router losses", routers)
        router_err = 0.0
        for name, value in routers.items():
            assert ref_routers[name] > 0, (where, name, "recorded nothing")
            err = abs(value - ref_routers[name]) / abs(ref_routers[name])
            assert err <= LOSS_BOUND, (where, name, value, ref_routers[name])
            router_err = max(router_err, err)
        backends = {b for path in (work / scheme).glob("norm_backend.rank*")
                    for b in path.read_text().split(",") if b}
        assert backends == {backend}, (where, "norm backends of the ranks' norms", backends)
        scales = {}
        for path in (work / scheme).glob("depth_scales.rank*.json"):
            scales.update({int(k): v for k, v in json.loads(path.read_text()).items()})
        num_layers = tiny_model(scheme).num_layers
        two_stream = ResidualScheme(scheme).traits.two_stream
        assert scales == ({i: math.sqrt(2 * (i + 1)) for i in range(num_layers)}
                          if two_stream else {}), (where, "depth constants", scales)
        grads = read_grads(str(work / scheme), overrides.get(scheme))
        assert grads.keys() == ref_grads.keys(), (where, "gradient names")
        worst = 0.0
        bound = GRAD_BOUNDS.get(scheme, GRAD_BOUND)
        largest = max(g.abs().max() for g in ref_grads.values())
        for name, grad in grads.items():
            scale = ref_grads[name].abs().max().clamp_min(1e-12)
            if grad.dim() == 0 or ("_layernorm." in name and "self_attention" in name):
                # sums over every token (and head) that can cancel: the model's scale
                scale = max(scale, 1e-3 * largest)
            err = ((grad - ref_grads[name]).abs().max() / scale).item()
            assert err <= bound, (where, name, f"gradient error {err:.1e} of its largest entry "
                                  f"> {bound:.0e}")
            worst = max(worst, err)
        routers_text = f", router losses rel err {router_err:.1e}" if routers else ""
        print(f"\n{layout} {scheme}: loss rel err {loss_err:.1e}{routers_text}, "
              f"max grad rel err {worst:.1e}")
