"""The Triton norm kernels against the torch reference, forward and backward.

On a CPU machine the kernels run in Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1 before any kernel module is imported), on small shapes whose hidden sizes
include non-powers of two (masked lanes) and single rows. The ``gpu`` tests repeat the parity
at the 1.3B shape with compiled kernels. Every op is checked through ``kernels.dispatch``, so the
same call the model makes is compared: forced ``triton`` versus forced ``torch``.
"""

from __future__ import annotations

import collections
import copy
import sys

import pytest
import torch
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.transformer_config import TransformerConfig

from kernels import dispatch, triton_kernels, triton_ops
from kernels.norms import Norm
from model import streams
from model.builder import build_model
from model.config import ParallelConfig
from tests.helpers import tiny_model

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
SHAPES = [(1, 3), (5, 48), (3, 100), (4, 130)]  # (rows, hidden)
KINDS = ["RMSNorm", "LayerNorm"]
DTYPES = [torch.float32, torch.bfloat16]


def test_kernels_are_interpreted_without_cuda():
    """Guards the conftest set-up: compiled kernels cannot run on CPU tensors."""
    if not CUDA:
        assert type(triton_kernels.entry_fwd).__name__ == "InterpretedFunction"


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def make_norms(kind: str, hidden: int, dtype: torch.dtype, count: int, seed: int = 0):
    """``count`` Norm modules with weights (and biases) moved away from their init."""
    config = TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=1,
                               normalization=kind, params_dtype=dtype)
    gen = torch.Generator().manual_seed(seed)
    norms = []
    for _ in range(count):
        norm = Norm(config, hidden_size=hidden, eps=1e-5).to(DEVICE)
        with torch.no_grad():
            for param in norm.parameters():
                param.add_((0.5 * torch.randn(param.shape, generator=gen)).to(param))
        norms.append(norm)
    return norms


def inputs(shape, dtype, count: int, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(shape, generator=gen) * 2 + 0.5).to(DEVICE, dtype).requires_grad_()
            for _ in range(count)]


def run(backend: str, op, tensors, modules):
    """Outputs of ``op(tensors, modules)`` and the gradients of the tensors and the modules'
    parameters, under ``backend``."""
    for t in tensors:
        t.grad = None
    for m in modules:
        m.zero_grad(set_to_none=True)
    with dispatch.forced_backend(backend):
        outs = [o for o in op(tensors, modules) if o is not None]
    gen = torch.Generator().manual_seed(2)
    # bf16-representable probes: the fp32 copies must see the same output gradients.
    probes = [torch.randn(o.shape, generator=gen).bfloat16().to(o) for o in outs]
    torch.autograd.backward(outs, probes)
    params = [p for m in modules for p in m.parameters()]
    return [o.detach() for o in outs] + [t.grad for t in tensors] + [p.grad for p in params]


def fp32_copies(tensors, modules):
    return ([t.detach().float().requires_grad_() for t in tensors],
            [copy.deepcopy(m).float() for m in modules])


def assert_parity(op, tensors, modules, dtype) -> float:
    """The triton path on (tensors, modules) against the torch reference on fp32 copies of the
    same values: for fp32 inputs that is the reference itself; for bf16 it is the reference's
    fp32 math without its bf16 roundings between norms, i.e. what the fused kernels compute
    before their single rounding of each output."""
    got = run("triton", op, tensors, modules)
    want = run("torch", op, *fp32_copies(tensors, modules))
    assert len(got) == len(want)
    errors = [rel_err(g, w) for g, w in zip(got, want, strict=True)]
    assert max(errors) <= TOLERANCE[dtype], errors
    return max(errors)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows,hidden", SHAPES)
def test_plain_norm(rows, hidden, kind, dtype):
    [norm] = make_norms(kind, hidden, dtype, 1)
    [x] = inputs((rows, hidden), dtype, 1)
    assert_parity(lambda t, m: [m[0](t[0])], [x], [norm], dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows,hidden", SHAPES)
@pytest.mark.parametrize("input_norm", [True, False], ids=["Nin", "no-Nin"])
def test_siamese_entry_from_packed(rows, hidden, kind, dtype, input_norm):
    """Entry of a sublayer reading the two halves (strided views) of a packed tensor."""
    post, pre, inp = make_norms(kind, hidden, dtype, 3)
    inp = inp if input_norm else IdentityOp()
    [packed] = inputs((rows, 1, 2 * hidden), dtype, 1)
    assert_parity(lambda t, m: dispatch.siamese_entry(*streams.unpack(t[0]), *m),
                  [packed], [post, pre, inp], dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows,hidden", SHAPES)
def test_siamese_entry_block_zero(rows, hidden, kind, dtype):
    """Block 0: both streams are the same embedding tensor."""
    post, pre, inp = make_norms(kind, hidden, dtype, 3)
    [emb] = inputs((rows, hidden), dtype, 1)
    assert_parity(lambda t, m: dispatch.siamese_entry(*streams.start(t[0]), *m),
                  [emb], [post, pre, inp], dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows,hidden", SHAPES)
@pytest.mark.parametrize("scale", [2.0 ** 0.5, 1.0])
def test_update_fused_with_entry(rows, hidden, kind, dtype, scale):
    """The attention's dual update applied inside the MLP's entry (u', y', s all checked)."""
    post, pre, inp = make_norms(kind, hidden, dtype, 3)
    u, y, r = inputs((rows, hidden), dtype, 3)
    assert_parity(lambda t, m: dispatch.siamese_update_entry(*t, scale, *m),
                  [u, y, r], [post, pre, inp], dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,hidden", SHAPES)
def test_dual_update_into_packed(rows, hidden, dtype):
    u, y, r = inputs((rows, 1, hidden), dtype, 3)
    assert_parity(lambda t, m: [dispatch.dual_update(*t, 6.0 ** 0.5, streams)],
                  [u, y, r], [], dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows,hidden", SHAPES)
def test_stream_merge(rows, hidden, kind, dtype):
    norms = make_norms(kind, hidden, dtype, 3)
    [packed] = inputs((rows, 1, 2 * hidden), dtype, 1)
    assert_parity(lambda t, m: [dispatch.stream_merge(*streams.unpack(t[0]), *m)],
                  [packed], norms, dtype)


def test_unknown_norm_module_falls_back_to_reference():
    """A norm the kernels do not know (here torch's own) keeps the reference composition."""
    post, pre = make_norms("RMSNorm", 48, torch.float32, 2)
    foreign = torch.nn.RMSNorm(48, eps=1e-5).to(DEVICE)
    x, y = inputs((3, 48), torch.float32, 2)
    with dispatch.forced_backend("triton"):
        u, s = dispatch.siamese_entry(x, y, post, pre, foreign)
        expected = foreign(post(x) + pre(y))
    assert s.grad_fn.name() != "EntryFunctionBackward"
    torch.testing.assert_close(s, expected, rtol=0, atol=0)


@pytest.mark.parametrize("scheme,extra", [
    ("siamese", {}), ("siamese", {"siamese_input_norm": False}),
    ("siamese_hybrid", {}), ("siamese_hybrid", {"hybrid_prenorm_first_block": True}),
])
@pytest.mark.parametrize("normalization", ["rmsnorm", "layernorm"])
def test_tiny_model_same_loss_and_grads(single_rank, device, monkeypatch, scheme, extra,
                                        normalization):
    """Interpreted kernels on a CPU machine, compiled ones on a GPU; fp32 either way."""
    calls = collections.Counter()
    for fn in (triton_ops.EntryFunction, triton_ops.DualUpdateFunction):
        def counted(*args, fn=fn, apply=fn.apply):
            calls[fn.__name__] += 1
            return apply(*args)
        monkeypatch.setattr(fn, "apply", counted)
    torch.manual_seed(0)
    [model] = build_model(tiny_model(scheme, num_layers=2, normalization=normalization, **extra),
                          ParallelConfig())
    _perturb_norms(model)
    tokens = torch.randint(0, 100, (2, 16)).to(device)
    (loss_t, grads_t), (loss_f, grads_f) = _torch_and_triton(model, tokens)
    errors = [rel_err(loss_f, loss_t)] + [rel_err(grads_f[n], grads_t[n]) for n in grads_t]
    assert errors[0] <= 1e-6 and max(errors) <= 1e-5, errors
    # The fused path really ran: per block the MLP entry (siamese also the attention entry;
    # HybridNorm*'s block 0 none) and the packed update, plus the merge.
    per_block = [2 if scheme == "siamese" else 1] * 2
    if extra.get("hybrid_prenorm_first_block"):
        per_block[0] = 0
    assert calls == {"EntryFunction": sum(per_block) + 1, "DualUpdateFunction": 2}, calls


def _perturb_norms(model) -> None:
    """Every norm weight and gate away from its init, so a misplaced one cannot hide."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "gate" in name:
                param.add_(0.3 * torch.randn_like(param))


def _torch_and_triton(model, tokens: torch.Tensor):
    """(loss, gradients by name) of one batch on the torch path, then on the fused path."""
    positions = torch.arange(tokens.shape[1], device=tokens.device).expand(tokens.shape[0], -1)
    results = []
    for backend in ("torch", "triton"):
        model.zero_grad(set_to_none=True)
        with dispatch.forced_backend(backend):
            loss = model(tokens, positions, None, labels=tokens).float().mean()
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    return results


def test_auto_follows_the_machine_and_te_needs_cuda():
    """auto: the compiled Triton kernels with CUDA, the torch reference without (a CPU never
    runs the interpreter in training); te without CUDA is refused and never imported."""
    expected = dispatch.NormBackend.TRITON if CUDA else dispatch.NormBackend.TORCH
    assert dispatch.set_backend("auto") is expected
    if not CUDA:
        with pytest.raises(ValueError, match=r"kernels.norm_backend \(te\) is not available "
                                             r"here: no CUDA device"):
            dispatch.set_backend("te")
        assert "transformer_engine" not in sys.modules


def test_triton_without_cuda_or_interpreter_is_one_clear_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"kernels.norm_backend \(triton\) is not available "
                                         r"here: no CUDA device"):
        dispatch.set_backend("triton")


# ---- GPU: compiled kernels at the 1.3B shape (4096 tokens x 2 sequences, hidden 2048) ----------

GPU_ROWS, GPU_HIDDEN = 8192, 2048


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_full_size_parity(kind, dtype):
    shape = (GPU_ROWS, 1, GPU_HIDDEN)
    post, pre, inp = make_norms(kind, GPU_HIDDEN, dtype, 3)
    u, y, r = inputs(shape, dtype, 3)
    [packed] = inputs((GPU_ROWS, 1, 2 * GPU_HIDDEN), dtype, 1)
    norms = [post, pre, inp]
    assert_parity(lambda t, m: [m[0](t[0])], [u], [post], dtype)
    assert_parity(lambda t, m: dispatch.siamese_entry(*streams.unpack(t[0]), *m),
                  [packed], norms, dtype)
    assert_parity(lambda t, m: dispatch.siamese_update_entry(*t, 3.0, *m), [u, y, r], norms,
                  dtype)
    assert_parity(lambda t, m: [dispatch.dual_update(*t, 3.0, streams)], [u, y, r], [], dtype)
    assert_parity(lambda t, m: [dispatch.stream_merge(*streams.unpack(t[0]), *m)],
                  [packed], norms, dtype)


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


def _grad_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want||: the whole tensor's relative error, which bf16 rounding in
    a different order moves by about its unit round-off, and a wrong kernel by order one."""
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", ["siamese", "siamese_hybrid"])
def test_gpu_whole_model_fused_matches_torch_in_bf16(single_rank, device, scheme):
    """A 4-block model at the 1.3B preset's width (2048, 16 heads / 4 KV, seq 2048) in bf16:
    the fused kernels give the torch path's loss and gradients up to bf16 rounding."""
    from model.config import ModelConfig

    cfg = ModelConfig(residual_scheme=scheme, num_layers=4, hidden_size=2048,
                      num_attention_heads=16, num_query_groups=4, ffn_hidden_size=5632,
                      vocab_size=32000, seq_length=2048)
    torch.manual_seed(0)
    [model] = build_model(cfg, ParallelConfig(), torch.bfloat16)
    _perturb_norms(model)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length),
                           generator=torch.Generator().manual_seed(1)).to(device)
    (loss_t, grads_t), (loss_f, grads_f) = _torch_and_triton(model, tokens)
    loss_t, loss_f = loss_t.item(), loss_f.item()
    errors = {name: _grad_error(grads_f[name], grads_t[name]) for name in grads_t}
    worst = max(errors, key=errors.get)
    print(f"\n{scheme}: loss {loss_t:.5f} vs {loss_f:.5f}; worst gradient {worst} "
          f"{errors[worst]:.2e}")
    assert abs(loss_f - loss_t) <= 2e-3 * abs(loss_t)
    assert errors[worst] <= 3e-2, (worst, errors[worst])
