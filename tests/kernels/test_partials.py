"""The backward kernels' weight-gradient partials are not zero-filled, so every program must
store every slot of its own, also a program that got no rows.

Five rows over the interpreter's four backward programs leave the last program without a row
(two rows each). Each backward runs twice, its partials buffer filled first with NaN and then
with zeros: a slot no program stores would make the first run's gradients NaN and the two
runs differ.
"""

import pytest
import torch

from kernels import triton_ops
from model import streams

pytestmark = pytest.mark.usefixtures("inside_bounds")  # tests/kernels/conftest.py

ROWS, HIDDEN = 5, 16


def _filled(value: float):
    def partials(programs, slots, width, device):
        assert (programs - 1) * -(-ROWS // programs) >= ROWS  # the last program: no row
        return torch.full((programs, slots, width), value, dtype=torch.float32, device=device)
    return partials


def _grads(monkeypatch, value: float, is_rms: bool, has_bias: bool) -> list[torch.Tensor]:
    monkeypatch.setattr(triton_ops, "weight_grad_partials", _filled(value))
    gen = torch.Generator().manual_seed(0)

    def t(*shape):
        return torch.randn(*shape, generator=gen).requires_grad_()

    x, y, r = t(ROWS, HIDDEN), t(ROWS, HIDDEN), t(ROWS, HIDDEN)
    packed = t(ROWS, 2 * HIDDEN)
    update = triton_ops.Entry(1e-5, is_rms)
    from_x = triton_ops.Entry(1e-5, is_rms, u_from_x=True)
    gate = triton_ops.Entry(1e-5, is_rms, store_a=False, gate=True, pass_x=True, pass_y=True)
    w = [t(HIDDEN) for _ in range(3)]
    b = [t(HIDDEN) for _ in range(3)] if has_bias else [None] * 3
    outputs = [
        triton_ops.norm(x, w[0], b[0], 1e-5, is_rms),
        triton_ops.add_norm(x, r, 2.5, w[0], b[0], 1e-5, is_rms),
        *triton_ops.EntryFunction.apply(update, None, None, x, y, r, 3.0, w[0], b[0], w[1],
                                        b[1], w[2], b[2]),
        *triton_ops.EntryFunction.apply(from_x, None, None, x, y, r, 3.0, w[0], b[0], w[1],
                                        b[1], w[2], b[2], w[2], b[2]),
        *triton_ops.EntryFunction.apply(gate, streams.unpack, packed, None, None, None, None,
                                        w[0], None, w[1], b[1], None, None),
    ]
    mixed = t(ROWS, 1, 2, (2 + 2) * 8)  # 2 K/V groups of 2 query heads, head size 8
    heads = [torch.nn.Module() for _ in range(3)]
    for module in heads:
        module.weight, module.bias = t(8), t(8) if has_bias else None
    outputs += triton_ops.qkv_norm(mixed, 2, 8, 1e-5, is_rms, *heads)
    if is_rms:
        outputs.append(triton_ops.dual_update(x, y, r, 3.0, streams.empty(x), streams.unpack))
    outputs = [o for o in outputs if o is not None]
    torch.autograd.backward(outputs, [torch.ones_like(o) for o in outputs])
    params = [*w, *b, *(m.weight for m in heads), *(m.bias for m in heads)]
    return [p.grad for p in params if p is not None]


@pytest.mark.parametrize("is_rms,has_bias", [(True, False), (False, True), (False, False)],
                         ids=["rmsnorm", "layernorm+bias", "layernorm"])
def test_every_partial_slot_is_written(monkeypatch, is_rms, has_bias):
    from_nan = _grads(monkeypatch, float("nan"), is_rms, has_bias)
    from_zero = _grads(monkeypatch, 0.0, is_rms, has_bias)
    for got, want in zip(from_nan, from_zero, strict=True):
        assert torch.isfinite(got).all() and torch.equal(got, want)
