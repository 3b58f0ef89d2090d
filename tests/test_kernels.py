"""The norm dispatch point and the Norm module (torch reference path)."""

import pytest
import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from kernels import dispatch
from kernels.norms import Norm
from model import cpu_compat


def config(normalization="RMSNorm", sequence_parallel=False, tp=1):
    return TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2,
                             normalization=normalization, sequence_parallel=sequence_parallel,
                             tensor_model_parallel_size=tp)


def test_auto_resolves_and_force_restores():
    """auto is the fused Triton path on a GPU (Triton is a dependency) and the torch
    reference on a CPU machine, where Triton would only run in its interpreter."""
    expected = dispatch.NormBackend.TRITON if torch.cuda.is_available() \
        else dispatch.NormBackend.TORCH
    assert dispatch.set_backend("auto") is expected
    with dispatch.forced_backend("torch") as backend:
        assert dispatch.active_backend() is backend
    assert dispatch.active_backend() is expected


def test_unknown_backend_is_one_clear_line():
    with pytest.raises(ValueError, match=r"kernels.norm_backend \(cuda-magic\) must be one of"):
        dispatch.set_backend("cuda-magic")


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("kind", ["RMSNorm", "LayerNorm"])
def test_norm_matches_torch_modules(kind, dtype, tol, device):
    torch.manual_seed(0)
    norm = Norm(config(kind), hidden_size=300, eps=1e-5).to(device)
    reference = (torch.nn.RMSNorm(300, eps=1e-5) if kind == "RMSNorm"
                 else torch.nn.LayerNorm(300, eps=1e-5)).to(device)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        reference.weight.copy_(norm.weight)
    x = (torch.randn(7, 300) * 3 + 1).to(device)
    out = norm(x.to(dtype))
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), reference(x), rtol=tol, atol=tol)


@pytest.mark.parametrize("sp", [False, True])
def test_norm_weights_marked_for_sequence_parallel_reduction(sp):
    norm = Norm(config("LayerNorm", sequence_parallel=sp, tp=2 if sp else 1), hidden_size=8)
    assert [p.sequence_parallel for p in norm.parameters()] == [sp, sp]
    assert torch.equal(norm.weight, torch.ones(8)) and torch.equal(norm.bias, torch.zeros(8))


def test_cpu_shim_is_inert_when_cuda_exists(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cpu_compat.install() is False


class _StandInTENorm(Norm):
    """Takes the place of megatron's TENorm, which cannot be imported without CUDA."""


@pytest.mark.parametrize("scheme", ["pre", "post", "siamese", "siamese_hybrid", "hybridnorm"])
def test_te_backend_puts_te_norms_everywhere_in_the_spec(single_rank, monkeypatch, scheme):
    """Under ``kernels.norm_backend = te`` every norm the model holds is TE's."""
    from model import spec
    from model.builder import build_model
    from model.config import ParallelConfig
    from tests.helpers import tiny_model

    monkeypatch.setattr(dispatch, "active_backend", lambda: dispatch.NormBackend.TE)
    monkeypatch.setattr(spec, "te_module", lambda name: {"TENorm": _StandInTENorm}[name])
    [model] = build_model(tiny_model(scheme, transformer_impl="local"),
                          ParallelConfig(distributed_optimizer=False))
    norms = [m for m in model.modules() if isinstance(m, Norm)]
    assert norms and all(type(m) is _StandInTENorm for m in norms), scheme
