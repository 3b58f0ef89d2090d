"""The normalization registry (``kernels/normalizations.py``): each kind's declaration is
what its norms hold, the config takes exactly the registered kinds, and mistakes in a
declaration or a config fail by name.

The kinds' computations are held elsewhere over every scheme (tests/model/test_equations.py,
test_precision.py, tests/runtime/test_parallel_parity.py, tests/pretrain/hf/test_hf_remote.py,
tests/kernels/test_triton_kernels.py; docs/schemes.md, "Adding a normalization")."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels import normalizations
from kernels.backend import NormBackend
from kernels.norms import Norm
from model import decay
from model.builder import build_model
from model.config import ModelConfig, ParallelConfig
from model.schemes import Normalization
from model.spec import plain_norm
from runtime.errors import ConfigError
from tests.helpers import tiny_model


def test_the_config_takes_exactly_the_registered_kinds():
    assert [n.value for n in Normalization] == list(normalizations.KINDS)
    for name, kind in normalizations.KINDS.items():
        assert Normalization(name).kind is kind


@pytest.mark.parametrize("name", list(normalizations.KINDS))
def test_each_norm_holds_its_kinds_parameters_at_their_starts_and_roles(single_rank, name):
    """Built from the declaration: each parameter (the optional bias with model.norm_bias),
    its shape, its start (DyT's alpha at model.dyt_alpha), its role (a Decay whose ranks fit
    the shape) and its sequence-parallel mark."""
    kind = normalizations.kind(name)
    cfg = tiny_model("pre", normalization=name, dyt_alpha=0.25,
                     norm_bias=any(p.optional for p in kind.parameters))
    [model] = build_model(cfg, ParallelConfig())
    norms = [m for m in model.modules() if isinstance(m, Norm)]
    assert norms and {n.kind for n in norms} == {kind}
    for norm in norms:
        assert list(norm.parameter_roles) == [p.name for p in kind.parameters]
        for spec in kind.parameters:
            param = getattr(norm, spec.name)
            start = 0.25 if spec.start == "dyt_alpha" else spec.start
            assert param.dim() == (1 if spec.shape == "hidden" else 0), (name, spec.name)
            assert torch.equal(param.detach(), torch.full_like(param, start)), (name, spec.name)
            role = getattr(param, decay.ROLE)
            assert role is decay.Decay(spec.role) and param.dim() in decay.RANKS[role]
            assert hasattr(param, "sequence_parallel"), (name, spec.name)


def test_a_role_its_rank_cannot_have_is_refused_from_the_declaration_too(single_rank,
                                                                          monkeypatch):
    """A kind that gives its scalar the role of a matrix (decayed by that accident): the role
    comes from the norm's kind, not a declare() call, and is rank-checked all the same, the
    error naming the declaration to fix."""
    dyt = normalizations.kind("dyt")
    wrong = dataclasses.replace(dyt, parameters=tuple(
        dataclasses.replace(p, role="matrix") if p.name == "alpha" else p
        for p in dyt.parameters))
    monkeypatch.setitem(normalizations.KINDS, "dyt", wrong)
    with pytest.raises(RuntimeError, match=r"alpha .* takes the role matrix from its module, "
                       r"which is for 2-d tensors, not 0-d ones .*"
                       r"kernels/normalizations\.py\) \(scalar\)"):
        build_model(tiny_model("pre", normalization="dyt"), ParallelConfig())


@pytest.mark.parametrize("fields, said", [
    ({"normalization": "dyt", "norm_bias": True},
     "model.norm_bias (true) requires model.normalization layernorm (got dyt): the others "
     "have no bias to switch (dyt always has one)"),
    ({"normalization": "dyt", "dyt_alpha": -0.5},
     "model.dyt_alpha (-0.5) must be >= 0 (0: the DyT paper's rule)"),
])
def test_a_normalization_mistake_is_one_line(fields, said):
    with pytest.raises(ConfigError) as refused:
        ModelConfig(**fields).validate()
    assert str(refused.value) == said


@pytest.mark.parametrize("width, attention, other", [
    (64, 0.8, 0.2), (4096, 0.8, 0.2), (5120, 0.6, 0.15), (6144, 0.6, 0.15), (8192, 0.2, 0.05),
    (16384, 0.2, 0.05)])
def test_dyt_alpha_starts_by_the_papers_rule_unless_set(width, attention, other):
    """The DyT paper's LLaMA starts by width (7B at 4096, 13B at 5120, 34B and 70B at 8192),
    the narrower model's between two, the 7B's below; a set model.dyt_alpha is every norm's."""
    starts = ModelConfig(normalization="dyt", hidden_size=width, num_attention_heads=8).norm_starts
    assert starts == {"dyt_alpha": other, "dyt_alpha_attention": attention}
    assert set(ModelConfig(normalization="dyt", dyt_alpha=0.5).norm_starts.values()) == {0.5}


def test_transformer_engine_refuses_a_kind_it_does_not_have():
    """Before TE is looked up: the CPU-side check of the TE path."""
    with pytest.raises(ConfigError) as refused:
        plain_norm(ModelConfig(normalization="dyt"), NormBackend.TE)
    assert str(refused.value) == (
        "kernels.norm_backend (te) computes rmsnorm and layernorm (Transformer Engine's "
        "norms), not model.normalization dyt: set --kernels.norm_backend=torch (or triton on "
        "a GPU)")
