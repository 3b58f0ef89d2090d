"""The Norm module (torch reference path), the scoped CPU layer, and the TE backend spec."""

import pytest
import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from kernels.backend import NormBackend
from kernels.norms import Norm
from model.schemes import ResidualScheme
from runtime import cpu_compat


def config(normalization="RMSNorm", sequence_parallel=False, tp=1):
    return TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2,
                             normalization=normalization, sequence_parallel=sequence_parallel,
                             tensor_model_parallel_size=tp)


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


def test_cpu_layer_is_inert_when_cuda_exists(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with cpu_compat.enabled() as active:
        assert active is False


def test_cpu_layer_is_scoped(monkeypatch):
    """Entered, it redirects megatron's CUDA bookkeeping; left, every patched function is the
    original again (the test session holds it open, so the scope is checked from outside). On
    a machine with CUDA, where the layer is inert (checked above), the CPU is what
    runtime.device is told it computes on, so the layer enters there too."""
    from megatron.core.fusions import fused_softmax
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer import utils

    monkeypatch.setattr(cpu_compat.device, "uses_cuda", lambda: False)
    monkeypatch.setattr(cpu_compat, "_depth", 0)  # as if no entry point had entered it
    names = ("current_device", "synchronize", "manual_seed", "get_rng_state")
    megatron = [(mrandom, "_get_cuda_rng_state"), (mrandom, "_set_cuda_rng_state"),
                (utils, "get_default_causal_mask"), (fused_softmax, "get_default_causal_mask")]
    before = [getattr(torch.cuda, n) for n in names]
    before_megatron = [getattr(obj, n) for obj, n in megatron]
    with monkeypatch.context() as m:
        for name in names:  # put back by monkeypatch even if the scope failed to
            m.setattr(torch.cuda, name, getattr(torch.cuda, name))
        for obj, name in megatron:
            m.setattr(obj, name, getattr(obj, name))
        with cpu_compat.enabled() as active:
            assert active and cpu_compat.active()
            assert torch.cuda.current_device() == torch.device("cpu")
            assert torch.zeros(1, device="cuda").device.type == "cpu"
            assert mrandom._get_cuda_rng_state is cpu_compat._cpu_rng_state
        assert not cpu_compat.active()
        assert [getattr(torch.cuda, n) for n in names] == before
        assert [getattr(obj, n) for obj, n in megatron] == before_megatron


class _StandInTENorm(Norm):
    """Takes the place of megatron's TENorm, which cannot be imported without CUDA."""


@pytest.mark.parametrize("scheme", [s.value for s in ResidualScheme])
def test_te_backend_puts_te_norms_everywhere_in_the_spec(single_rank, monkeypatch, scheme):
    """Under ``kernels.norm_backend = te`` every norm the model holds is TE's."""
    from model import spec
    from model.builder import build_model
    from model.config import ParallelConfig
    from tests.helpers import tiny_model

    monkeypatch.setattr("model.builder.resolve", lambda requested: NormBackend(requested))
    monkeypatch.setattr(spec, "te_module", lambda name: {"TENorm": _StandInTENorm}[name])
    [model] = build_model(tiny_model(scheme, transformer_impl="local"),
                          ParallelConfig(distributed_optimizer=False), norm_backend="te")
    norms = [m for m in model.modules() if isinstance(m, Norm)]
    assert norms and all(type(m) is _StandInTENorm for m in norms), scheme
