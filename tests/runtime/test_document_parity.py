"""Document attention under TP + SP, PP, expert parallelism, context parallelism and
recomputation matches one process.

The unsharded model (positions per token, torch norms) computes the loss and gradients of packed
micro-batches with their document ids (tests.helpers.document_batches); each layout on gloo ranks
loads its weights, runs the same micro-batches (every pipeline stage reads the ids from its own
copy of each micro-batch) and writes its loss and gradients, compared as in
test_parallel_parity. Full recomputation saves the ids as a tensor and reapplies them.
"""

import json
import os

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from model.builder import build_model, wrap_ddp
from model.config import ParallelConfig
from runtime import parallel, weights
from runtime.schedule import forward_backward
from tests.helpers import MBS, SEQ, document_batches, spawn, tiny_model
from tests.parity_worker import grads_into_params

SCHEMES = ["siamese", "siamese_hybrid"]
# siamese with megatron's MoE layer as F (the ids reach attention; the router and the
# all-to-all see the packed tokens as any others)
EXPERTS = "siamese-experts"
MODELS = {"siamese": {}, "siamese_hybrid": {},
          EXPERTS: dict(num_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.1,
                        moe_z_loss_coeff=0.01)}
MICROBATCHES = 4
# layout: (world size, parallel fields, the models it runs)
LAYOUTS = {"tp2-sp": (2, dict(tp=2, sequence_parallel=True), SCHEMES),
           "pp2": (2, dict(pp=2), SCHEMES), "tp2-pp2": (4, dict(tp=2, pp=2), SCHEMES),
           "ep2": (2, dict(ep=2), [EXPERTS]),
           # context parallelism: documents cross the split (3-7 tokens each, chunks of 4);
           # each rank's queries meet the gathered keys' ids
           "cp2": (2, dict(cp=2), SCHEMES), "cp2-ep2": (2, dict(cp=2, ep=2), [EXPERTS]),
           "cp2-tp2-sp-recompute": (4, dict(cp=2, tp=2, sequence_parallel=True,
                                            recompute="full"), ["siamese"]),
           "cp2-pp2-vp2": (4, dict(cp=2, pp=2, vp=2), ["siamese_hybrid"])}
# As test_parallel_parity: only the order of sums differs between layouts.
LOSS_BOUND = 1e-6
GRAD_BOUND = 5e-5


def model_of(name: str):
    """The tiny model of a MODELS entry."""
    return tiny_model(name.removesuffix("-experts"), **MODELS[name])


def build(name: str, par: ParallelConfig):
    torch.manual_seed(7)
    return wrap_ddp(build_model(model_of(name), par, norm_backend="torch",
                                positions_per_token=True), par)


def loss_and_grads(chunks) -> tuple[float, dict]:
    losses = forward_backward(chunks, document_batches(MICROBATCHES), MICROBATCHES, SEQ, MBS)
    return (float(sum(losses)) / len(losses),
            {n: p.main_grad.clone() for n, p in chunks[0].module.named_parameters()})


@pytest.fixture(scope="module")
def reference(single_rank, tmp_path_factory):
    root = tmp_path_factory.mktemp("documents")
    par = ParallelConfig(distributed_optimizer=False)
    out = {}
    for scheme in MODELS:
        chunks = build(scheme, par)
        with torch.no_grad():
            for name, p in chunks[0].module.named_parameters():
                if "norm" in name or "gate" in name:
                    p.add_(0.2 * torch.randn_like(p))
        weights.save(chunks, str(root / scheme / "weights"))
        out[scheme] = loss_and_grads(chunks)
    return root, out


def run_documents(layout: dict, schemes: list[str], workdir: str) -> None:
    """One rank of a layout: the reference weights, the document micro-batches, the loss on
    rank 0 and the gradients as a checkpoint."""
    par = ParallelConfig(distributed_optimizer=False, **layout)
    parallel.initialize(par)
    for scheme in schemes:
        chunks = build(scheme, par)
        weights.load(chunks, os.path.join(workdir, scheme, "weights"))
        dp = parallel_state.get_data_parallel_world_size()
        mine = document_batches(MICROBATCHES)[parallel_state.get_data_parallel_rank()::dp]
        losses = [float(x) for x in forward_backward(chunks, mine, len(mine), SEQ, MBS)]
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, losses)
        if dist.get_rank() == 0:
            held = [x for rank in gathered for x in rank]
            with open(os.path.join(workdir, scheme, "loss.json"), "w") as f:
                json.dump(sum(held) / len(held), f)
        grads_into_params(chunks)
        weights.save(chunks, os.path.join(workdir, scheme, "grads"))
    parallel.destroy()


def assert_close(loss, grads, ref_loss, ref_grads, what: str) -> None:
    assert abs(loss - ref_loss) / abs(ref_loss) <= LOSS_BOUND, (what, loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        scale = ref_grads[name].abs().max().clamp_min(1e-12)
        err = ((grad - ref_grads[name]).abs().max() / scale).item()
        assert err <= GRAD_BOUND, (what, name, err)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_document_attention_layout_matches_one_process(reference, layout, tmp_path):
    root, expected = reference
    world, fields, names = LAYOUTS[layout]
    for scheme in names:
        (tmp_path / scheme).mkdir()
        os.symlink(root / scheme / "weights", tmp_path / scheme / "weights")
    spawn(world, run_documents, fields, names, str(tmp_path))
    for scheme in names:
        [model] = build_model(model_of(scheme), ParallelConfig(distributed_optimizer=False),
                              norm_backend="torch")
        weights.load([model], str(tmp_path / scheme / "grads"))
        grads = {n: p.detach() for n, p in model.named_parameters()}
        loss = json.loads((tmp_path / scheme / "loss.json").read_text())
        assert_close(loss, grads, *expected[scheme], f"{layout} {scheme}")


@pytest.mark.slow  # the reference saves its weights through megatron's writer (a process)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_full_recompute_keeps_the_documents(reference, scheme):
    par = ParallelConfig(distributed_optimizer=False, recompute="full")
    chunks = build(scheme, par)
    weights.load(chunks, str(reference[0] / scheme / "weights"))
    assert_close(*loss_and_grads(chunks), *reference[1][scheme], f"recompute {scheme}")


@pytest.mark.slow  # the reference saves its weights through megatron's writer (a process)
def test_a_layout_that_lost_the_documents_would_fail(reference):
    """The bounds above can fail: the same micro-batches without their document ids (as a
    stage that dropped them would run) give gradients far outside GRAD_BOUND (1.1 of a
    tensor's largest entry, measured). The untrained model's loss moves by only 1e-6: the
    gradients are what catch it."""
    chunks = build("siamese", ParallelConfig(distributed_optimizer=False))
    weights.load(chunks, str(reference[0] / "siamese" / "weights"))
    plain = [{k: v for k, v in b.items() if k != "attention_mask"}
             for b in document_batches(MICROBATCHES)]
    losses = forward_backward(chunks, plain, MICROBATCHES, SEQ, MBS)
    loss, ref_loss = float(sum(losses)) / len(losses), reference[1]["siamese"][0]
    grads, ref_grads = chunks[0].module.named_parameters(), reference[1]["siamese"][1]
    worst = max(((p.main_grad - ref_grads[n]).abs().max()
                 / ref_grads[n].abs().max().clamp_min(1e-12)).item() for n, p in grads)
    assert loss != ref_loss
    assert worst > 100 * GRAD_BOUND, worst
