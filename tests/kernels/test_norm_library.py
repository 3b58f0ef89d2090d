"""The fused Triton norm as a registered op (kernels/norm_library.py): torch.library's own
check of its schema, fake and autograd registrations, and a compiled Pre-Norm block on the
triton backend with no graph break and the eager Triton model's loss and gradients."""

import pytest
import torch

import kernels.norm_library  # noqa: F401  (registers siamesenorm::norm)
from model import compiled
from tests import compile_probe


def _inputs(residual: bool, bias: bool, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2, 48, generator=gen, dtype=dtype, requires_grad=True)
    r = torch.randn(3, 2, 48, generator=gen, dtype=dtype, requires_grad=True) if residual \
        else None
    w = (1 + 0.1 * torch.randn(48, generator=gen, dtype=dtype)).requires_grad_()
    b = (0.1 * torch.randn(48, generator=gen, dtype=dtype)).requires_grad_() if bias else None
    return x, r, 0.5, w, b, 1e-5, not bias


@pytest.mark.parametrize("residual, bias", [(False, False), (True, True), (True, False)],
                         ids=["rms", "layer-residual", "rms-residual"])
def test_registered_norm_passes_opcheck(residual, bias):
    torch.library.opcheck(torch.ops.siamesenorm.norm.default, _inputs(residual, bias))


def test_registered_norm_matches_the_autograd_function():
    from kernels import triton_ops

    args = _inputs(True, True)
    out = torch.ops.siamesenorm.norm(*args)[0]
    grads = torch.autograd.grad(out.square().sum(), [a for a in args if torch.is_tensor(a)])
    ref = triton_ops.NormFunction.apply(*args)
    ref_grads = torch.autograd.grad(ref.square().sum(), [a for a in args if torch.is_tensor(a)])
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.slow  # three compiled models on Triton's interpreter: ~10 s
def test_compiled_pre_block_on_triton_norms(single_rank):
    counts = compile_probe.step_counts("pre", {}, steps=2, norm_backend="triton")
    assert sum(b for _, b in counts) == 0, compiled.break_reasons()
    assert counts[1][0] == 0, counts
    losses, grads = compile_probe.loss_and_grads("pre", {}, None, norm_backend="triton")
    c_losses, c_grads = compile_probe.loss_and_grads("pre", {}, "aot_eager",
                                                     norm_backend="triton")
    assert c_losses == pytest.approx(losses, rel=1e-5)
    assert compile_probe.worst_relative(c_grads, grads) <= 1e-5
