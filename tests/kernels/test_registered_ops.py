"""The fused Triton kernels as registered ops (kernels/norm_library.py, kernels/stream_library.py):
torch.library's own check of each op's schema, fake and autograd registrations; the op path a
compiled block takes against the eager autograd Functions, outputs and every gradient bit for
bit (the same launches; the streams an entry passes on included); and (slow) compiled blocks
on the triton backend: each scheme's ops in its graph, no break, no recompile, eager's loss
and gradients."""

import pytest
import torch

from kernels import norm_library, stream_library, triton_ops
from kernels.triton_ops import Entry
from model import compiled, streams
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
    args = _inputs(True, True)
    out = torch.ops.siamesenorm.norm(*args)[0]
    grads = torch.autograd.grad(out.square().sum(), [a for a in args if torch.is_tensor(a)])
    ref = triton_ops.NormFunction.apply(*args)
    ref_grads = torch.autograd.grad(ref.square().sum(), [a for a in args if torch.is_tensor(a)])
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


H = 48  # not a power of two: the kernels' column masks matter


def _t(*shape, scale=1.0, shift=0.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (shift + scale * torch.randn(*shape, generator=gen)).requires_grad_()


def _params(rms: bool, gate: bool = False, c: bool = True, u_from: bool = False):
    """(wa, ba, wb, bb, wc, bc, wu, bu) as the fused norms pass them."""
    def weight(seed):
        return _t(H, scale=0.1, shift=1.0, seed=seed)

    def bias(seed):
        return None if rms else _t(H, scale=0.1, seed=seed)

    wa, ba = weight(10), None if gate else bias(11)
    wc, bc = (weight(14), bias(15)) if c else (None, None)
    wu, bu = (weight(16), bias(17)) if u_from else (None, None)
    return (wa, ba, weight(12), bias(13), wc, bc, wu, bu)


# (name, kind, packed input, with an update r, Nc present)
KINDS = [
    ("block0-rms", Entry(1e-5, True), False, False, True),
    ("packed-layer-no-u", Entry(1e-5, False, store_a=False), True, False, True),
    ("packed-no-c", Entry(1e-5, True), True, False, False),
    ("update-layer", Entry(1e-5, False), False, True, True),
    ("update-u-from-x", Entry(1e-5, True, u_from_x=True), False, True, True),
    ("gate", Entry(1e-5, True, store_a=False, gate=True), True, False, False),
]


def _entry_args(kind: Entry, packed: bool, update: bool, c: bool):
    x = _t(3, 2, 2 * H if packed else H, seed=1)
    y = None if packed else _t(3, 2, H, seed=2)
    r = _t(3, 2, H, seed=3) if update else None
    scale = torch.tensor(3.0) if update else None  # c: read from memory, not a power of two
    params = _params(kind.is_rms, kind.gate, c, kind.u_from_x)
    return (x, y, r, scale, *params, kind.eps, kind.is_rms, kind.store_a, kind.gate,
            kind.u_from_x)


@pytest.mark.parametrize("name, kind, packed, update, c", KINDS, ids=[k[0] for k in KINDS])
def test_registered_entry_passes_opcheck(name, kind, packed, update, c):
    torch.library.opcheck(torch.ops.siamesenorm.entry.default,
                          _entry_args(kind, packed, update, c))


def _grads(outputs, inputs):
    """Gradients of a loss reading every output, for every tensor input needing one."""
    loss = sum((o * torch.linspace(-1, 1, o.numel()).view(o.shape)).sum()
               for o in outputs if o is not None)
    leaves = [t for t in inputs if torch.is_tensor(t) and t.requires_grad]
    return torch.autograd.grad(loss, leaves)


@pytest.mark.parametrize("name, kind, packed, update, c", KINDS, ids=[k[0] for k in KINDS])
def test_compiled_path_matches_the_autograd_function(monkeypatch, name, kind, packed, update,
                                                     c):
    """What a compiled block runs (``stream_library.entry`` while compiling) against
    ``EntryFunction``, with the streams passed on (pass_x / pass_y) read by the loss, so
    their gradients must reach the packed input both ways."""
    if packed:
        kind = kind._replace(pass_y=True, pass_x=not kind.store_a)
    x, y, r, scale, *params = _entry_args(kind, packed, update, c)[:12]
    inputs = (None, None, x, y) if not packed else (streams.unpack, x, None, None)
    want = triton_ops.EntryFunction.apply(kind, *inputs, r, scale, *params)
    want_grads = _grads(want, (x, y, r, *params))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    got = stream_library.entry(kind, *inputs, r, scale, *params)
    got_grads = _grads(got, (x, y, r, *params))
    for g, w in zip(got, want, strict=True):
        assert (g is None) == (w is None)
        if w is not None:
            torch.testing.assert_close(g, w, rtol=0, atol=0)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def _dual_args():
    return _t(3, 2, H, seed=1), _t(3, 2, H, seed=2), _t(3, 2, H, seed=3), torch.tensor(2.5)


def test_registered_dual_update_passes_opcheck():
    torch.library.opcheck(torch.ops.siamesenorm.dual_update.default, _dual_args())


def test_compiled_dual_update_matches_the_autograd_function(monkeypatch):
    args = _dual_args()
    want = stream_library.dual_update(*args, streams.empty, streams.unpack)
    want_grads = _grads([want], args)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    got = stream_library.dual_update(*args, streams.empty, streams.unpack)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for g, w in zip(_grads([got], args), want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


HEADS, DIM, GROUPS = 2, 24, 2


def _norms(rms: bool):
    from types import SimpleNamespace

    return [SimpleNamespace(weight=_t(DIM, scale=0.1, shift=1.0, seed=20 + i),
                            bias=None if rms else _t(DIM, scale=0.1, seed=30 + i))
            for i in range(3)]


@pytest.mark.parametrize("rms", [True, False], ids=["rms", "layer"])
def test_registered_qkv_norm_passes_opcheck(rms):
    q, k, v = _norms(rms)
    mixed = _t(3, 2, GROUPS, (HEADS + 2) * DIM, seed=4)
    torch.library.opcheck(torch.ops.siamesenorm.qkv_norm.default,
                          (mixed, HEADS, DIM, 1e-5, rms, q.weight, q.bias, k.weight, k.bias,
                           v.weight, v.bias))


@pytest.mark.parametrize("rms", [True, False], ids=["rms", "layer"])
def test_compiled_qkv_norm_matches_the_autograd_function(monkeypatch, rms):
    norms = _norms(rms)
    mixed = _t(3, 2, GROUPS, (HEADS + 2) * DIM, seed=4)
    leaves = [mixed] + [t for n in norms for t in (n.weight, n.bias) if t is not None]
    want = norm_library.qkv_norm(mixed, HEADS, DIM, 1e-5, rms, *norms)
    want_grads = _grads(want, leaves)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    got = norm_library.qkv_norm(mixed, HEADS, DIM, 1e-5, rms, *norms)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    for g, w in zip(_grads(got, leaves), want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


# The registered ops each scheme's blocks call on the triton backend: the plain norm
# (Pre-Norm), the two-stream entries and the packed update (SiameseNorm; siamese_hybrid's
# attention entry with its gate), the Q/K/V head norms (QKV-norm attention).
SCHEME_OPS = {"pre": {"norm"}, "siamese": {"entry", "dual_update"},
              "siamese_hybrid": {"entry", "dual_update", "qkv_norm"},
              "hybridnorm": {"norm", "qkv_norm"}}


@pytest.mark.slow  # compiled models on Triton's interpreter: ~10 s each
@pytest.mark.parametrize("scheme", SCHEME_OPS)
def test_compiled_blocks_on_triton_kernels(single_rank, scheme):
    seen = set()

    def recording(gm, example_inputs):
        seen.update(str(n.target).split(".")[1] for n in gm.graph.nodes
                    if n.op == "call_function" and str(n.target).startswith("siamesenorm."))
        return gm.forward

    counts = compile_probe.step_counts(scheme, {}, recording, steps=2, norm_backend="triton")
    assert sum(b for _, b in counts) == 0, compiled.break_reasons()
    assert counts[1][0] == 0, counts
    assert counts[0][0] <= 2, counts  # block 0 and the rest: c_l is an input, not a constant
    assert seen == SCHEME_OPS[scheme]
    losses, grads = compile_probe.loss_and_grads(scheme, {}, None, norm_backend="triton")
    c_losses, c_grads = compile_probe.loss_and_grads(scheme, {}, "aot_eager",
                                                     norm_backend="triton")
    assert c_losses == pytest.approx(losses, rel=1e-5)
    assert compile_probe.worst_relative(c_grads, grads) <= 1e-5
