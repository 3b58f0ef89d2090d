"""``optim.fused``: torch's fused AdamW and multi-tensor norm/clip/copy behind megatron's
optimizer (no TE or apex) take the steps megatron's own fallback takes, within fp32 tolerance."""

import pytest
import torch
from megatron.core import utils
from megatron.core.optimizer import clip_grads

from model.builder import build_model, wrap_ddp
from pretrain.config import Config, OptimConfig, RunConfig
from pretrain.optim import build_optimizer
from pretrain.run import checkpoint
from runtime import multi_tensor
from runtime.schedule import forward_backward
from tests.helpers import MBS, SEQ, batches, tiny_model

STEPS = 4


def tensors(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) for shape in ((7, 5), (130,), (3, 4, 9))]


def test_the_norm_equals_megatrons_fallback(single_rank):
    grads = tensors(0)
    theirs, _ = utils.local_multi_tensor_l2_norm(0, None, [grads], False)
    ours, _ = multi_tensor.l2_norm(0, None, [grads], False)
    assert ours.shape == (1,) and ours.item() == pytest.approx(theirs.item(), rel=1e-6)


def test_scale_equals_megatrons_fallback_in_place_and_across_dtypes():
    for src_dtype, dst_dtype, factor in ((torch.float32, torch.float32, 0.3),
                                         (torch.float32, torch.bfloat16, 1.0)):
        src = [t.to(src_dtype) for t in tensors(1)]
        theirs = [torch.zeros_like(t, dtype=dst_dtype) for t in src]
        ours = [torch.zeros_like(t, dtype=dst_dtype) for t in src]
        utils.local_multi_tensor_scale(0, None, [src, theirs], factor)
        multi_tensor.scale(0, None, [src, ours], factor)
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    grads, expected = tensors(2), [0.5 * t for t in tensors(2)]
    multi_tensor.scale(0, None, [grads, grads], 0.5)
    assert all(torch.equal(a, b) for a, b in zip(grads, expected, strict=True))


def test_the_kernels_are_swapped_for_the_block_only():
    fallback = clip_grads.l2_norm_impl
    with multi_tensor.foreach_kernels():
        assert clip_grads.l2_norm_impl is multi_tensor.l2_norm
    assert clip_grads.l2_norm_impl is fallback


def train(fused: bool, scheme: str, steps: range = range(STEPS), resume=None,
          save_to=None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """``steps`` steps of a tiny model, after loading the checkpoint ``resume`` and before
    saving one to ``save_to`` when given; (grad norms, final weights)."""
    # A large eps keeps Adam's update smooth in the gradient, so summation-order noise in
    # near-zero gradients cannot become +-lr steps; a low clip makes clipping act every step.
    config = Config(model=tiny_model(scheme), run=RunConfig(steps=STEPS),
                    optim=OptimConfig(lr=1e-2, warmup_steps=0, eps=1e-3, clip_grad=0.05,
                                      fused=fused))
    parallel = config.parallel  # megatron's DistributedOptimizer, as training uses it
    chunks = wrap_ddp(build_model(config.model, parallel, seed=7), parallel)
    optimizer, scheduler = build_optimizer(config, chunks, torch.float32)
    if resume is not None:
        checkpoint.load(resume, checkpoint.read_record(resume), chunks, optimizer, scheduler)
        _check_step_devices(optimizer, fused)
    norms = []
    for step in steps:
        optimizer.zero_grad()
        forward_backward(chunks, batches(2, seed=step), 2, SEQ, MBS)
        ok, grad_norm, _ = optimizer.step()
        assert ok
        scheduler.step(1)
        norms.append(grad_norm)
    if fused:  # the fused path was the one taken
        groups = [g for _, opt in optimizer_parts(optimizer) for g in opt.param_groups]
        assert groups and all(g["fused"] and not g["foreach"] for g in groups)
    if save_to is not None:
        checkpoint.save(save_to, steps[-1] + 1, chunks, optimizer, scheduler, keep_last=1,
                        record={})
    return norms, {n: p.detach().clone() for n, p in chunks[0].named_parameters()}


def _check_step_devices(optimizer, fused: bool) -> None:
    """Every Adam ``step`` where torch's kernel of this run's choice wants it (on a GPU the
    fused kernel refuses a CPU one), as a float32 scalar."""
    for _, opt in optimizer_parts(optimizer):
        for param, state in opt.state.items():
            want = param.device if fused else torch.device("cpu")
            assert state["step"].device == want and state["step"].dtype == torch.float32


@pytest.mark.slow  # the checkpoint goes through megatron's writer (a process)
@pytest.mark.parametrize("saved,resumed", [(False, True), (True, False)],
                         ids=["unfused-then-fused", "fused-then-unfused"])
def test_resume_across_the_fused_choice(single_rank, tmp_path, saved, resumed):
    """Half a run with one choice, saved, resumed with the other: the steps after the resume
    match an uninterrupted run of the resumed choice as closely as fused and unfused match
    each other (the first half differs only in summation order). A resume that lost the Adam
    moments or the step count would not."""
    half = STEPS // 2
    train(saved, "pre", range(half), save_to=tmp_path)
    found = checkpoint.resolve(tmp_path)
    norms, resumed_weights = train(resumed, "pre", range(half, STEPS), resume=found)
    reference_norms, reference = train(resumed, "pre")
    assert norms == pytest.approx(reference_norms[half:], rel=1e-5)
    for name, value in resumed_weights.items():
        err = (value - reference[name]).abs().max().item()
        assert err <= 1e-6, (name, err)


def optimizer_parts(optimizer):
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        yield inner, inner.optimizer


@pytest.mark.parametrize("scheme", ["pre", "siamese_hybrid"])
def test_fused_steps_equal_the_fallback(single_rank, scheme):
    norms, fused = train(True, scheme)
    reference_norms, reference = train(False, scheme)
    assert min(norms) > 0.05  # clipping acted on every step
    assert norms == pytest.approx(reference_norms, rel=1e-5)
    for name, value in fused.items():
        err = (value - reference[name]).abs().max().item()
        assert err <= 1e-6, (name, err)
