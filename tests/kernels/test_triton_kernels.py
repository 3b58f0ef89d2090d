"""The Triton norm kernels against the torch reference, forward and backward.

On a CPU machine the kernels run in Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1 before any kernel module is imported), on small shapes whose hidden sizes
include non-powers of two (masked lanes) and single rows. The ``gpu`` tests repeat the parity
at the 1.3B shape with compiled kernels. Every op is checked as the model calls it: the same
module (a Norm, a sublayer's norms, the merge) built with the triton backend against one built
with the torch backend, holding the same weights.
"""

from __future__ import annotations

import collections
import sys

import pytest
import torch
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from kernels import normalizations, triton_kernels, triton_ops
from kernels.backend import NormBackend, resolve
from kernels.fused import fuse_gate
from kernels.norms import Norm
from model import streams
from model.builder import build_model
from model.config import ParallelConfig
from model.layers.merge import StreamMergeNorm
from model.layers.siamese_hybrid import ChannelGate
from model.layers.two_stream import SublayerNorms, packed_update
from model.schemes import ResidualScheme
from runtime.errors import ConfigError
from tests import bf16_parity
from tests.helpers import tiny_model
from tests.kernels.bounds import kernel_names

# Every launch of these tests checked for loads and stores outside its tensors (the
# interpreter's addresses; tests/kernels/conftest.py), and the last test holds the check
# to have seen every kernel.
pytestmark = pytest.mark.usefixtures("inside_bounds")

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
SHAPES = [(1, 3), (5, 48), (3, 100), (4, 130), (41, 130)]  # (rows, hidden)
KINDS = ["RMSNorm", "LayerNorm", "LayerNorm-nobias"]  # megatron's names; model.norm_bias
DTYPES = [torch.float32, torch.bfloat16]
TRITON, TORCH = NormBackend.TRITON, NormBackend.TORCH


def test_kernels_are_interpreted_without_cuda():
    """Guards the conftest set-up: compiled kernels cannot run on CPU tensors."""
    if not CUDA:
        assert type(triton_kernels.entry_fwd).__name__ == "InterpretedFunction"


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def norm_spec(kind: str, hidden: int, dtype: torch.dtype, backend: NormBackend):
    """(megatron config, Norm spec) of a ``KINDS`` entry."""
    normalization, _, bias = kind.partition("-")
    config = TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=1,
                               normalization=normalization, params_dtype=dtype)
    return config, ModuleSpec(module=Norm, params={"backend": backend, "bias": bias != "nobias"})


def norm_builder(kind: str, hidden: int, dtype: torch.dtype, backend: NormBackend):
    """A builder of Norm modules with ``backend``, as a layer's ``build_norm``."""
    config, spec = norm_spec(kind, hidden, dtype, backend)
    return lambda: spec.module(config, hidden_size=hidden, eps=1e-5, **spec.params).to(DEVICE)


def perturbed(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """``module`` with every parameter moved away from its init by seeded noise, so the same
    module built under another backend holds the same values."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.add_((0.5 * torch.randn(param.shape, generator=gen)).to(param))
    return module


def inputs(shape, dtype, count: int, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(shape, generator=gen) * 2 + 0.5).to(DEVICE, dtype).requires_grad_()
            for _ in range(count)]


def run(op, tensors, module):
    """Outputs of ``op(tensors, module)`` and the gradients of the tensors and the module's
    parameters."""
    outs = [o for o in op(tensors, module) if o is not None]
    gen = torch.Generator().manual_seed(2)
    # bf16-representable probes: the fp32 copies must see the same output gradients.
    probes = [torch.randn(o.shape, generator=gen).bfloat16().to(o) for o in outs]
    torch.autograd.backward(outs, probes)
    params = list(module.parameters()) if module is not None else []
    return [o.detach() for o in outs] + [t.grad for t in tensors] + [p.grad for p in params]


def assert_parity(build, op, tensors, dtype) -> float:
    """``op`` on the module ``build(TRITON)`` against ``op`` on ``build(TORCH)`` in fp32, on fp32
    copies of the same values: for fp32 inputs that is the reference itself; for bf16 it is the
    reference's fp32 math without its bf16 roundings between norms, i.e. what the fused kernels
    compute before their single rounding of each output."""
    fp32 = [t.detach().float().requires_grad_() for t in tensors]
    reference = build(TORCH)
    got = run(op, tensors, build(TRITON))
    want = run(op, fp32, reference.float() if reference is not None else None)
    assert len(got) == len(want)
    errors = [rel_err(g, w) for g, w in zip(got, want, strict=True)]
    assert max(errors) <= TOLERANCE[dtype], errors
    return max(errors)


def sublayer(kind, hidden, dtype, input_norm=True):
    """Builds a sublayer's three norms with a given backend (the same weights under each)."""
    return lambda backend: perturbed(SublayerNorms(
        norm_builder(kind, hidden, dtype, backend), backend, inp=input_norm))


def merge(kind, hidden, dtype):
    """Builds the final merge with a given backend (the same weights under each)."""
    def build(backend):
        config, norm = norm_spec(kind, hidden, dtype, backend)
        return perturbed(StreamMergeNorm(config, hidden, 1e-5, norm=norm,
                                         backend=backend).to(DEVICE))
    return build


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows,hidden", SHAPES)
def test_plain_norm(rows, hidden, kind, dtype):
    [x] = inputs((rows, hidden), dtype, 1)
    assert_parity(lambda backend: perturbed(norm_builder(kind, hidden, dtype, backend)()),
                  lambda t, m: [m(t[0])], [x], dtype)


def qkv_heads(tensors, norms, heads: int, dim: int):
    """Q, K, V of a packed projection [s, b, groups, (heads + 2) dim], normalised per head:
    one fused op with triton, megatron's split then three norms with torch."""
    [mixed] = tensors
    q_norm, k_norm, v_norm = norms
    if q_norm.backend is TRITON:
        return list(triton_ops.qkv_norm(mixed, heads, dim, 1e-5, q_norm.is_rms, *norms))
    q, k, v = mixed.split([heads * dim, dim, dim], dim=-1)
    return [q_norm(q.reshape(*q.shape[:2], -1, dim)), k_norm(k), v_norm(v)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
# (20, 2, 6, 64): 4-row tiles, several per backward program
@pytest.mark.parametrize("tokens,groups,heads,dim", [(1, 1, 1, 8), (5, 2, 2, 12),
                                                     (3, 3, 4, 16), (4, 1, 6, 10),
                                                     (20, 2, 6, 64)])
def test_qkv_head_norms_from_the_packed_projection(tokens, groups, heads, dim, kind, dtype):
    [mixed] = inputs((tokens, 1, groups, (heads + 2) * dim), dtype, 1)

    def build(backend):
        make = norm_builder(kind, dim, dtype, backend)
        return perturbed(torch.nn.ModuleList([make(), make(), make()]))
    assert_parity(build, lambda t, m: qkv_heads(t, m, heads, dim), [mixed], dtype)


@pytest.mark.parametrize("alpha", [1.0, 2.5])  # Post-Norm, DeepNorm
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows,hidden", SHAPES[1:])
def test_post_norm_residual_fused_into_the_norm(rows, hidden, kind, dtype, alpha):
    """N(alpha h + r): the output and the gradients of h, r and the norm's parameters."""
    h, r = inputs((rows, hidden), dtype, 2)
    assert_parity(lambda backend: perturbed(norm_builder(kind, hidden, dtype, backend)()),
                  lambda t, m: [m.add_norm(t[0], t[1], alpha)], [h, r], dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows,hidden", SHAPES)
@pytest.mark.parametrize("input_norm", [True, False], ids=["Nin", "no-Nin"])
def test_siamese_entry_from_packed(rows, hidden, kind, dtype, input_norm):
    """Entry of a sublayer reading the two halves (strided views) of a packed tensor."""
    [packed] = inputs((rows, 1, 2 * hidden), dtype, 1)
    assert_parity(sublayer(kind, hidden, dtype, input_norm),
                  lambda t, m: m.entry(*streams.unpack(t[0])), [packed], dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows,hidden", SHAPES)
@pytest.mark.parametrize("store_u", [True, False], ids=["u", "no-u"])
def test_siamese_entry_takes_the_packed_input(rows, hidden, kind, dtype, store_u):
    """The entry as a layer past block 0 makes it: the packed tensor whole, y handed back and
    read again (its gradient joins the packed gradient inside the kernel); without u stored,
    x handed back too (the MLP entry computes u from it)."""
    [packed] = inputs((rows, 1, 2 * hidden), dtype, 1)

    def op(t, m):
        x, y, u, s = m.entry_packed(t[0], store_u)
        if store_u:
            assert m.fused is None or x is None
            return [y * 1.5, u, s]
        return [x * 0.5, y * 1.5, s]

    assert_parity(sublayer(kind, hidden, dtype), op, [packed], dtype)


def gated_entry(kind, hidden, dtype):
    """Builds siamese_hybrid's attention entry, x * g + Npre(y), with a given backend."""
    def build(backend):
        config, _ = norm_spec(kind, hidden, dtype, backend)
        entry = torch.nn.Module()
        entry.gate = ChannelGate(config, hidden).to(DEVICE)
        entry.pre = norm_builder(kind, hidden, dtype, backend)()
        entry.fused = fuse_gate(backend, entry.gate, entry.pre)
        return perturbed(entry)
    return build


def gated(t, m):
    """The gated entry of the packed t[0], and x and y read again (as the MLP entry does)."""
    if m.fused is not None:
        _, x, y, a = m.fused.entry_packed(t[0], streams.unpack)
    else:
        x, y = streams.unpack(t[0])
        a = m.gate(x) + m.pre(y)
    return [a, x * 0.5, y * 1.5]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows,hidden", SHAPES)
def test_gated_entry_from_packed(rows, hidden, kind, dtype):
    [packed] = inputs((rows, 1, 2 * hidden), dtype, 1)
    assert_parity(gated_entry(kind, hidden, dtype), gated, [packed], dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,hidden", SHAPES[1:3])
def test_gated_entry_block_zero(rows, hidden, dtype):
    """Block 0: x and y are the one embedding tensor."""
    [emb] = inputs((rows, hidden), dtype, 1)

    def op(t, m):
        if m.fused is not None:
            return [m.fused.entry(t[0], t[0])[1]]
        return [m.gate(t[0]) + m.pre(t[0])]

    assert_parity(gated_entry("RMSNorm", hidden, dtype), op, [emb], dtype)


def test_gate_of_a_bf16_weight_computes_as_an_fp32_one():
    """Under megatron's Float16Module the gate's weight is bf16: the fused entry still does
    its arithmetic in fp32, so the same values held in bf16 or fp32 give the same output and
    the same gradients (the weight's rounded to its dtype)."""
    [packed] = inputs((5, 1, 2 * 48), torch.bfloat16, 1)
    results = []
    for weight_dtype in (torch.float32, torch.bfloat16):
        entry = gated_entry("RMSNorm", 48, torch.bfloat16)(TRITON)
        entry.gate.weight.data = entry.gate.weight.data.bfloat16().to(weight_dtype)
        results.append(run(gated, [packed.detach().clone().requires_grad_()], entry))
    (fp32, bf16), gate_grad = results, 4  # outputs a, x, y; the input's gradient; g, w
    assert bf16[gate_grad].dtype == torch.bfloat16
    for index, (a, b) in enumerate(zip(fp32, bf16, strict=True)):
        want = a.to(b.dtype) if index == gate_grad else a
        assert torch.equal(want, b), index


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows,hidden", SHAPES)
def test_siamese_entry_block_zero(rows, hidden, kind, dtype):
    """Block 0: both streams are the same embedding tensor."""
    [emb] = inputs((rows, hidden), dtype, 1)
    assert_parity(sublayer(kind, hidden, dtype),
                  lambda t, m: m.entry(*streams.start(t[0])), [emb], dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows,hidden", SHAPES)
@pytest.mark.parametrize("scale", [2.0 ** 0.5, 1.0])
def test_update_fused_with_entry(rows, hidden, kind, dtype, scale):
    """The attention's dual update applied inside the MLP's entry (u', y', s all checked)."""
    u, y, r = inputs((rows, hidden), dtype, 3)
    assert_parity(sublayer(kind, hidden, dtype),
                  lambda t, m: m.update_entry(*t, scale), [u, y, r], dtype)


def attention_and_mlp(kind, hidden, dtype):
    """Builds a layer's two sublayers' norms with a given backend (same weights under each)."""
    def build(backend):
        layer = torch.nn.Module()
        layer.attn = SublayerNorms(norm_builder(kind, hidden, dtype, backend), backend)
        layer.mlp = SublayerNorms(norm_builder(kind, hidden, dtype, backend), backend)
        return perturbed(layer)
    return build


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows,hidden", SHAPES[1:])
def test_mlp_entry_recomputing_u_from_the_layer_input(rows, hidden, kind, dtype):
    """A SiameseNorm layer's entries as the layer chains them: fused, the attention entry
    stores no u and the MLP entry computes u = Npost(x) from the layer input's x, forward and
    backward, sending u's gradient on to x and Npost's weights."""
    [packed] = inputs((rows, 1, 2 * hidden), dtype, 1)
    [r] = inputs((rows, 1, hidden), dtype, 1, seed=3)

    def op(t, m):
        computed = m.mlp.computes_u_from(m.attn.post)
        assert computed == (m.mlp.fused is not None)
        x, y, u, s = m.attn.entry_packed(t[0], store_u=not computed)
        assert (u is None) == computed
        return [s, *m.mlp.update_entry(u, y, t[1], 2.0 ** 0.5, (x, m.attn.post))]

    assert_parity(attention_and_mlp(kind, hidden, dtype), op, [packed, r], dtype)


class _Spy:
    """Stands in for a kernel, recording the constexprs of each launch and running it."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append(kwargs)
            return self.kernel[grid](*args, **kwargs)
        return launch


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_entry_backward_rereading_rows_as_wide_rows_do(kind, dtype, monkeypatch):
    """The entry backward's variant for wide rows (``RELOAD``: each stream's row, and its
    update, read again after Nc's reductions instead of held) at a small width: the packed
    entry with and without u, the update fused into the entry, and the MLP entry computing
    u, all as above."""
    monkeypatch.setattr(triton_ops, "RELOAD_FROM", 1)
    spy = _Spy(triton_kernels.entry_bwd)
    monkeypatch.setattr(triton_kernels, "entry_bwd", spy)
    rows, hidden = 41, 130
    test_siamese_entry_takes_the_packed_input(rows, hidden, kind, dtype, True)
    test_siamese_entry_takes_the_packed_input(rows, hidden, kind, dtype, False)
    test_update_fused_with_entry(rows, hidden, kind, dtype, 2.0 ** 0.5)
    test_mlp_entry_recomputing_u_from_the_layer_input(rows, hidden, kind, dtype)
    assert len(spy.launches) == 5 and all(k["RELOAD"] for k in spy.launches)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,hidden", SHAPES)
def test_dual_update_into_packed(rows, hidden, dtype):
    u, y, r = inputs((rows, 1, hidden), dtype, 3)
    got = run(lambda t, _: [packed_update(TRITON)(*t, 6.0 ** 0.5)], [u, y, r], None)
    fp32 = [t.detach().float().requires_grad_() for t in (u, y, r)]
    want = run(lambda t, _: [packed_update(TORCH)(*t, 6.0 ** 0.5)], fp32, None)
    errors = [rel_err(g, w) for g, w in zip(got, want, strict=True)]
    assert max(errors) <= TOLERANCE[dtype], errors


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,hidden,kind", [
    # Not 3 wide without a bias: Nfinal then normalises the sum of two zero-mean 3-vectors,
    # whose variance can be tiny, and fp32 rounding is amplified past the tolerance.
    (r, h, k) for (r, h) in SHAPES for k in KINDS if not (h < 8 and k.endswith("nobias"))])
def test_stream_merge(rows, hidden, kind, dtype):
    [packed] = inputs((rows, 1, 2 * hidden), dtype, 1)
    assert_parity(merge(kind, hidden, dtype), lambda t, m: [m(t[0])], [packed], dtype)


def test_unknown_norm_module_keeps_the_composition():
    """A norm the kernels do not know (here torch's own) makes the sublayer compose its
    modules, even when built with the triton backend."""
    known = norm_builder("RMSNorm", 48, torch.float32, TRITON)
    built = iter([known(), known(), torch.nn.RMSNorm(48, eps=1e-5).to(DEVICE)])
    norms = SublayerNorms(lambda: next(built), TRITON)
    assert norms.fused is None
    x, y = inputs((3, 48), torch.float32, 2)
    u, s = norms.entry(x, y)
    assert s.grad_fn.name() != "EntryFunctionBackward"
    torch.testing.assert_close(s, norms.inp(norms.post(x) + norms.pre(y)), rtol=0, atol=0)


@pytest.mark.parametrize("scheme,extra", [
    ("siamese", {}), ("siamese", {"siamese_input_norm": False}),
    ("siamese_hybrid", {}), ("siamese_hybrid", {"hybrid_first_block": "prenorm"}),
    ("siamese", {"normalization": "layernorm", "norm_bias": True}),
])
@pytest.mark.parametrize("normalization", ["rmsnorm", "layernorm"])
def test_tiny_model_same_loss_and_grads(single_rank, device, monkeypatch, scheme, extra,
                                        normalization):
    """A model built with triton (interpreted kernels on a CPU machine, compiled on a GPU)
    against the same model built with torch, same weights, fp32: same loss and gradients, and
    each model runs its own backend throughout."""
    calls = collections.Counter()
    for fn in (triton_ops.EntryFunction, triton_ops.DualUpdateFunction, triton_ops.NormFunction,
               triton_ops.QKVNormFunction):
        def counted(*args, fn=fn, apply=fn.apply):
            calls[fn.__name__] += 1
            return apply(*args)
        monkeypatch.setattr(fn, "apply", counted)
    cfg = tiny_model(scheme, num_layers=2, **{"normalization": normalization, **extra})
    tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    results = _torch_and_triton(cfg, tokens.to(device), calls)
    (loss_t, grads_t, calls_t), (loss_f, grads_f, calls_f) = results
    errors = [rel_err(loss_f, loss_t)] + [rel_err(grads_f[n], grads_t[n]) for n in grads_t]
    assert errors[0] <= 1e-6 and max(errors) <= 1e-5, errors
    assert not calls_t  # the torch model never reaches a kernel
    # The fused path really ran: per block the attention entry (siamese_hybrid's gated one)
    # and the MLP entry (HybridNorm*'s block 0 neither) and the packed update, plus the merge;
    # the remaining norms (QKV head norms, HybridNorm*'s block-0 norms) are triton's.
    per_block = [2, 2]
    if extra.get("hybrid_first_block"):
        per_block[0] = 0
    assert calls_f["EntryFunction"] == sum(per_block) + 1, calls_f
    assert calls_f["DualUpdateFunction"] == 2, calls_f
    assert (calls_f["NormFunction"] > 0) == bool(extra.get("hybrid_first_block")), calls_f
    # siamese_hybrid's Q/K/V head norms: one fused op per block
    assert calls_f["QKVNormFunction"] == (2 if scheme == "siamese_hybrid" else 0), calls_f


@pytest.mark.parametrize("scheme", ["post", "deepnorm", "hybridnorm", "mixln"])
def test_post_norm_schemes_same_loss_and_grads(single_rank, device, monkeypatch, scheme):
    """Post-Norm's residual adds run fused into their norms: same loss and gradients as the
    torch model, one fused residual norm per Post-Norm sublayer."""
    calls = collections.Counter()
    residual = collections.Counter()

    def counted(*args, apply=triton_ops.NormFunction.apply):
        residual["with"] += args[1] is not None
        return apply(*args)
    monkeypatch.setattr(triton_ops.NormFunction, "apply", counted)
    cfg = tiny_model(scheme, num_layers=2,
                     **({"mixln_post_ratio": 0.5} if scheme == "mixln" else {}))
    tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    (loss_t, grads_t, _), (loss_f, grads_f, _) = _torch_and_triton(cfg, tokens.to(device), calls)
    errors = [rel_err(loss_f, loss_t)] + [rel_err(grads_f[n], grads_t[n]) for n in grads_t]
    assert errors[0] <= 1e-6 and max(errors) <= 1e-5, errors
    fused = {"post": 4, "deepnorm": 4, "hybridnorm": 2, "mixln": 2}[scheme]  # 2 blocks
    assert residual["with"] == fused, residual


def _perturb_norms(model) -> None:
    """Every norm weight and gate away from its init, so a misplaced one cannot hide."""
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "gate" in name:
                param.add_((0.3 * torch.randn(param.shape, generator=gen)).to(param))


UNFUSED_KINDS = [k.name for k in normalizations.KINDS.values() if not k.fused_kernels]


@pytest.mark.parametrize("normalization", UNFUSED_KINDS)
@pytest.mark.parametrize("scheme", list(ResidualScheme))
def test_a_norm_the_kernels_do_not_compute_runs_its_reference_under_triton(
        single_rank, monkeypatch, scheme, normalization):
    """Every registered normalization the fused kernels do not compute (DyT), in every scheme
    built with the triton backend: each norm falls back to its own reference, decided per
    norm, so no fused norm kernel runs and the loss and gradients are the torch model's (a
    layer that fused by its backend would run the LayerNorm kernel over the norm's weight and
    bias and ignore the rest of it)."""
    calls = collections.Counter()
    for fn in (triton_ops.EntryFunction, triton_ops.NormFunction, triton_ops.QKVNormFunction):
        def counted(*args, fn=fn, apply=fn.apply):
            calls[fn.__name__] += 1
            return apply(*args)
        monkeypatch.setattr(fn, "apply", counted)
    cfg = tiny_model(scheme, num_layers=2, normalization=normalization)
    tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    (loss_t, grads_t, _), (loss_f, grads_f, calls_f) = _torch_and_triton(cfg, tokens, calls)
    assert not calls_f, (f"{scheme} with {normalization} under triton ran fused norm kernels "
                         f"{dict(calls_f)}: decide fusion per norm (Norm.fused_kernels, "
                         "kernels/fused.py), from the norm's kind")
    errors = [rel_err(loss_f, loss_t)] + [rel_err(grads_f[n], grads_t[n]) for n in grads_t]
    assert max(errors) <= 1e-6, (scheme, normalization, errors)


def _torch_and_triton(cfg, tokens: torch.Tensor, calls: collections.Counter,
                      dtype: torch.dtype = torch.float32):
    """(loss, gradients by name, kernel calls) of one batch through the model built with the
    torch backend, then through the same model (same weights) built with triton."""
    positions = torch.arange(tokens.shape[1], device=tokens.device).expand(tokens.shape[0], -1)
    results, weights = [], None
    for backend in (TORCH, TRITON):
        [model] = build_model(cfg, ParallelConfig(), dtype, norm_backend=backend)
        if weights is None:
            _perturb_norms(model)
            weights = model.state_dict()
        else:
            model.load_state_dict(weights)
        calls.clear()
        loss = model(tokens, positions, None, labels=tokens).float().mean()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        results.append((loss.detach(), grads, collections.Counter(calls)))
    return results


def test_backends_resolve_per_build_without_global_state(single_rank):
    """Building with one backend leaves the next build's choice alone: a model's norms are
    those of its own build, whatever was built before."""
    cfg = tiny_model("siamese", num_layers=2)
    backends = [TRITON, TORCH, TRITON]
    models = [build_model(cfg, ParallelConfig(), norm_backend=b)[0] for b in backends]
    for model, backend in zip(models, backends, strict=True):
        norms = [m for m in model.modules() if isinstance(m, Norm)]
        assert norms and {n.backend for n in norms} == {backend}
        fused = [m.fused for m in model.modules() if isinstance(m, SublayerNorms)]
        assert fused and all((f is not None) == (backend is TRITON) for f in fused)


def test_auto_follows_the_machine_and_te_needs_cuda():
    """auto: the compiled Triton kernels with CUDA, the torch reference without (a CPU never
    runs the interpreter in training); te without CUDA is refused and never imported."""
    assert resolve("auto") is (TRITON if CUDA else TORCH)
    if not CUDA:
        with pytest.raises(ConfigError, match=r"kernels.norm_backend \(te\) is not available "
                                              r"here: no CUDA device"):
            resolve("te")
        assert "transformer_engine" not in sys.modules


def test_triton_without_cuda_or_interpreter_is_one_clear_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match=r"kernels.norm_backend \(triton\) is not available "
                                          r"here: no CUDA device"):
        resolve("triton")


def test_unknown_backend_is_one_clear_line():
    with pytest.raises(ConfigError, match=r"kernels.norm_backend \(cuda-magic\) must be one of"):
        resolve("cuda-magic")


# ---- GPU: compiled kernels at the 1.3B shape (4096 tokens x 2 sequences, hidden 2048) ----------

GPU_ROWS, GPU_HIDDEN = 8192, 2048


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_full_size_parity(kind, dtype):
    """Every fused op as the model calls it, at the 1.3B width; fresh inputs for each op, so no
    op sees another's accumulated gradients."""
    def streams_in(count: int = 1, width: int = 1):
        return inputs((GPU_ROWS, 1, width * GPU_HIDDEN), dtype, count)

    assert_parity(lambda backend: perturbed(norm_builder(kind, GPU_HIDDEN, dtype, backend)()),
                  lambda t, m: [m(t[0])], streams_in(), dtype)
    assert_parity(sublayer(kind, GPU_HIDDEN, dtype),
                  lambda t, m: m.entry(*streams.unpack(t[0])), streams_in(width=2), dtype)
    assert_parity(sublayer(kind, GPU_HIDDEN, dtype),
                  lambda t, m: list(m.entry_packed(t[0])[1:]), streams_in(width=2), dtype)
    assert_parity(gated_entry(kind, GPU_HIDDEN, dtype), gated, streams_in(width=2), dtype)
    assert_parity(sublayer(kind, GPU_HIDDEN, dtype),
                  lambda t, m: m.update_entry(*t, 3.0), streams_in(3), dtype)
    assert_parity(merge(kind, GPU_HIDDEN, dtype), lambda t, m: [m(t[0])], streams_in(width=2),
                  dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_wide_row_parity(kind, dtype):
    """The entry backward's wide-row variant as compiled (hidden 8192: each stream's row read
    again after Nc's reductions, 16 warps), from the packed input and with the update fused
    in; 2048 rows."""
    def entry_without_u(t, m):
        x, y, _, s = m.entry_packed(t[0], False)
        return [x * 0.5, y * 1.5, s]

    hidden = triton_ops.RELOAD_FROM
    assert_parity(sublayer(kind, hidden, dtype), entry_without_u,
                  inputs((2048, 1, 2 * hidden), dtype, 1), dtype)
    assert_parity(sublayer(kind, hidden, dtype), lambda t, m: m.update_entry(*t, 3.0),
                  inputs((2048, 1, hidden), dtype, 3), dtype)


def test_bench_table_and_cpu_exit(capsys):
    """The GPU benchmark's table from made-up timings, and its one-line exit without CUDA."""
    from bench import fused_norms

    op = fused_norms.OPS[1]
    results = [{"op": op.name, "pass": "fwd", "impl": impl, "ms": ms,
                "bytes": op.tensors_moved(False) * 8192 * 2048 * 2}
               for impl, ms in (("triton (fused)", 0.1), ("torch eager", 0.4))]
    results.append({"op": op.name, "pass": "fwd", "impl": "torch.compile", "ms": None,
                    "error": "RuntimeError"})
    rows = fused_norms.table_rows(results, copy_gbs=2000.0)
    assert rows[0][3:] == ["0.100", "1,342", "0.67", "4.00x"]  # 4 x 32 MiB in 0.1 ms
    assert rows[1][-1] == "1.00x" and rows[2][3] == "failed (RuntimeError)"
    assert fused_norms.report(results, 2000.0, "device").count("\n") == 6
    if not CUDA:
        assert fused_norms.main([]) == 0
        assert capsys.readouterr().out.count("\n") == 1


# ---- bf16: the fused model against the torch model in bf16, after training ----------------------
#
# tests/bf16_parity.py: the model is trained (fp32) so that its loss discriminates, its weights
# rounded to bf16, and the fused model (bf16) held to the torch model (bf16) and both to the
# fp32 reference, per tensor, by bounds derived from bf16's unit round-off and the depth.

BF16_MODELS = {"fp32": (torch.float32, TORCH), "torch": (torch.bfloat16, TORCH),
               "fused": (torch.bfloat16, TRITON)}


def fused_parity(cfg, tokens: torch.Tensor, lr: float) -> bf16_parity.Parity:
    """The torch model in fp32 (trained, the reference), in bf16, and the fused model in bf16,
    on the same bf16 weights."""
    def build(name):
        dtype, backend = BF16_MODELS[name]
        return build_model(cfg, ParallelConfig(), dtype, norm_backend=backend, seed=0)[0]

    return bf16_parity.measure(build, ["fused", "torch"], tokens, cfg.num_layers,
                               cfg.vocab_size, lr)


SMALL_LR = 1e-2  # a handful of steps to half of ln V at this size


def small_bf16_model(scheme: str):
    """A model small enough for Triton's CPU interpreter in seconds: (config, tokens)."""
    cfg = tiny_model(scheme, num_layers=2, hidden_size=64, num_attention_heads=4,
                     num_query_groups=2, ffn_hidden_size=176, vocab_size=512, seq_length=32)
    return cfg, bf16_parity.markov_tokens(4, cfg.seq_length, cfg.vocab_size, states=32)


class _ScaledGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by ``factor``."""

    @staticmethod
    def forward(ctx, x, factor: float):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def break_entry_kernel(monkeypatch, where: str, factor: float = 1 + 1e-2) -> None:
    """Make the fused entry kernel 1% wrong: its output s (the sublayer's input) scaled in
    forward (and so in backward), or only the gradient it passes back ("backward")."""
    apply = triton_ops.EntryFunction.apply

    def broken(*args):
        u, y, x, s = apply(*args)
        return u, y, x, s * factor if where == "forward" else _ScaledGrad.apply(s, factor)
    monkeypatch.setattr(triton_ops.EntryFunction, "apply", broken)


@pytest.mark.skipif(CUDA, reason="Triton's interpreter runs only without CUDA")
def test_interpreter_truncates_to_bf16_unless_told_to_round():
    """Why the CPU runs below round in the interpreter to nearest: its own fp32 -> bf16
    conversion truncates (every bf16 output biased by -u/2 on average), which the compiled
    kernels on a GPU do not. The fused norm's output, one rounding of the fp32 result: with
    the patch exactly torch's (round to nearest even), without it exactly truncation."""
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 256, generator=gen) * 2 + 0.5).bfloat16()
    w = (torch.rand(256, generator=gen) + 0.5).bfloat16()
    exact = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5) * w.float()
    truncated = (exact.view(torch.int32) & ~0xFFFF).view(torch.float32)
    assert torch.equal(triton_ops.norm(x, w, None, 1e-5, True).float(), truncated)
    with bf16_parity.interpreter_rounds_to_nearest():
        assert torch.equal(triton_ops.norm(x, w, None, 1e-5, True), exact.bfloat16())
    assert torch.equal(triton_ops.norm(x, w, None, 1e-5, True).float(), truncated)


@pytest.mark.parametrize("scheme", [s.value for s in ResidualScheme])
def test_whole_model_fused_matches_torch_in_bf16_after_training(single_rank, device, scheme):
    """Every registered scheme, a small trained model: the fused model in bf16 is within bf16
    rounding of the fp32 reference, per tensor no further from it than the torch model in
    bf16 plus one rounding and chance, and its loss within the mean's bound
    (tests/bf16_parity.py). Schemes without fused kernels of their own still run the fused
    norms (and Q/K head norms) in their own places. On a CPU the
    kernels run in the interpreter, made to round as a GPU does; on a GPU they are compiled."""
    cfg, tokens = small_bf16_model(scheme)
    with bf16_parity.interpreter_rounds_to_nearest():
        parity = fused_parity(cfg, tokens, SMALL_LR)
    print(f"\n{scheme}: {parity.summary('fused', 'torch')}")
    assert parity.discriminates(), parity.trained
    assert parity.violations("fused", "torch") == []


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_bf16_parity_fails_for_an_entry_kernel_one_percent_off(single_rank, device, monkeypatch,
                                                               where):
    """Negative control of the test above: the same comparison of a fused model whose entry
    kernel is 1% wrong (output scaled by 1.01, or only its gradient) finds violations."""
    cfg, tokens = small_bf16_model("siamese")
    break_entry_kernel(monkeypatch, where)
    with bf16_parity.interpreter_rounds_to_nearest():
        parity = fused_parity(cfg, tokens, SMALL_LR)
    print(f"\nbroken {where}: {parity.summary('fused', 'torch')}")
    assert parity.discriminates(), parity.trained
    assert parity.only_candidate_violates("fused", "torch")


@pytest.mark.skipif(CUDA, reason="Triton's interpreter runs only without CUDA")
def test_bf16_parity_fails_for_the_interpreters_truncation(single_rank):
    """Negative control without any change to the kernels: the interpreter's truncating bf16
    conversion (a -u/2 bias per rounding) is enough to break the bounds."""
    cfg, tokens = small_bf16_model("siamese")
    parity = fused_parity(cfg, tokens, SMALL_LR)
    print(f"\ntruncating: {parity.summary('fused', 'torch')}")
    assert parity.discriminates(), parity.trained
    assert parity.only_candidate_violates("fused", "torch")


# At width 2048 one AdamW step at lr 3e-4 takes this model from ln V (10.4) to 0.3 nats (measured
# on the CPU, fp32, sequences of 128): far past where the loss is informative and the gradients
# well conditioned. At 3e-5: 10.8, 8.1, 5.7, 3.7.
GPU_LR = 1e-5
GPU_MODEL = dict(num_layers=4, hidden_size=2048, num_attention_heads=16, num_query_groups=4,
                 ffn_hidden_size=5632, vocab_size=32000, seq_length=2048)


def gpu_bf16_model(scheme: str):
    """A 4-block model at the 1.3B preset's width (2048, 16 heads / 4 KV, seq 2048) and two
    sequences: (config, tokens)."""
    from model.config import ModelConfig

    cfg = ModelConfig(residual_scheme=scheme, **GPU_MODEL)
    return cfg, bf16_parity.markov_tokens(2, cfg.seq_length, cfg.vocab_size, states=512)


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", [s.value for s in ResidualScheme])
def test_gpu_whole_model_fused_matches_torch_in_bf16(single_rank, device, scheme):
    """Every registered scheme at the 1.3B preset's width, trained until its loss is half of
    ln V: the compiled fused kernels in bf16 against the torch model in bf16 and the fp32
    reference, per tensor (tests/bf16_parity.py)."""
    cfg, tokens = gpu_bf16_model(scheme)
    parity = fused_parity(cfg, tokens, GPU_LR)
    print(f"\n{scheme}: {parity.summary('fused', 'torch')}")
    assert parity.discriminates(), parity.trained
    assert parity.violations("fused", "torch") == []


@pytest.mark.gpu
def test_gpu_bf16_parity_fails_for_an_entry_kernel_one_percent_off(single_rank, device,
                                                                   monkeypatch):
    """Negative control at the full shape: a fused entry whose gradient is 1% off breaks the
    bounds the compiled kernels meet."""
    cfg, tokens = gpu_bf16_model("siamese")
    break_entry_kernel(monkeypatch, "backward")
    parity = fused_parity(cfg, tokens, GPU_LR)
    print(f"\nbroken backward: {parity.summary('fused', 'torch')}")
    assert parity.discriminates(), parity.trained
    assert parity.only_candidate_violates("fused", "torch")


@pytest.mark.parametrize("scheme", [s.value for s in ResidualScheme])
def test_every_scheme_same_loss_and_grads_with_triton(single_rank, device, scheme):
    """Every registered scheme built with the triton norms (Q/K head norms on strided views of
    the projection included) computes the torch-built model's loss and gradients, fp32.
    Hyper-connection weights (a few numbers each, their gradients sums over every token,
    stream and feature with heavy cancellation) get 5e-4, as in test_equations.py."""
    cfg = tiny_model(scheme, num_layers=2)
    tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    (loss_t, grads_t, _), (loss_f, grads_f, _) = _torch_and_triton(
        cfg, tokens.to(device), collections.Counter())
    assert rel_err(loss_f, loss_t) <= 1e-6
    for name, grad in grads_t.items():
        bound = 5e-4 if "_hc." in name else 1e-5
        assert rel_err(grads_f[name], grad) <= bound, name


@pytest.mark.slow  # about the module's launches checked, which the fast tier leaves unchecked
@pytest.mark.skipif(torch.cuda.is_available(), reason="the check reads the interpreter's addresses")
def test_every_kernel_ran_under_the_bounds_check(bounds_report):
    """The module's launches (odd widths 3 to 130, 1 to 41 rows, every entry variant, both
    dtypes) covered every kernel of ``kernels.triton_kernels`` and dozens of constexpr
    variants (the kernels are checked where these tests run them, not in a copy)."""
    assert set(bounds_report.launches) == kernel_names()
    assert len(bounds_report.variants) > 50 and bounds_report.lanes > 10**6
