"""Every registered scheme's fp32 computations (``Traits.fp32``, the one list of them) compute
in fp32 in a bf16 model.

A computation meant for fp32 and done in bf16 passes every other test: the equations are
checked in fp32, and the bf16 parity tests compare two bf16 paths that may round the same
way. Here each declared module of a bf16 model (every parameter moved off its start, fp32
weights off the bf16 grid) is called again, on the inputs it was given, as an fp32 copy; its
bf16 output must be that fp32 result rounded once. One rounding has a known size: the RMS
relative error of the fp32 result rounded to the output's dtype. A module that rounds
intermediates as well (a gate's weight rounded to bf16 before the product, a sigmoid's input
before the sigmoid) is further off: two independent roundings are sqrt(2) times one, in
RMS. The bound allows 1.25 times one rounding (mHC's mappings, whose product is taken in
the activation dtype on purpose, measure about 1.0), and a module declared that the model
does not have fails too.

The MoE blocks' fp32 modules (``EXPERT_FP32``: megatron's router) are held harder: their
outputs (routing weights and choices) stay fp32, so they must be their fp32 computation
exactly.
"""

from __future__ import annotations

import copy

import pytest
import torch

from kernels.norms import Norm
from kernels.reference import residual_sum
from model.builder import build_model
from model.config import ParallelConfig
from model.schemes import EXPERT_FP32, ResidualScheme
from tests.helpers import NORMS, norm_fields, perturb_every_parameter, tiny_model

ONE_ROUNDING = 1.25
"""How many times one rounding's RMS error a declared module's output may be off its fp32
computation (module docstring)."""


def rms_rel(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.shape == want.shape, (got.shape, want.shape)
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def as_fp32(value):
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.float()
    if isinstance(value, (tuple, list)):
        return type(value)(as_fp32(v) for v in value)
    return value


def outputs(value) -> list[torch.Tensor]:
    return list(value) if isinstance(value, (tuple, list)) else [value]


def declared_calls(scheme: ResidualScheme, chosen=None, **fields):
    """[(module name, module, args, kwargs, output)] of every call of a declared module (or of
    every module ``chosen(name, module)`` picks) in one forward pass of the scheme's bf16
    model (``fields``: more of its config)."""
    cfg = tiny_model(scheme.value, num_layers=2, hidden_size=64, num_attention_heads=4,
                     seq_length=64, **fields)
    [model] = build_model(cfg, ParallelConfig(), torch.bfloat16, norm_backend="torch", seed=0)
    perturb_every_parameter(model)
    if chosen is None:
        def chosen(name, module):
            return name.rsplit(".", 1)[-1] in scheme.traits.fp32
    calls, hooks = [], []
    for name, module in model.named_modules():
        if chosen(name, module):
            def hook(module, args, kwargs, output, name=name):
                calls.append((name, module, args, kwargs, output))
            hooks.append(module.register_forward_hook(hook, with_kwargs=True))
            if isinstance(module, Norm):  # a Post-Norm sublayer's N(h + r) is its own call
                module.add_norm = _recorded(module, f"{name}.add_norm", calls)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length),
                           generator=torch.Generator().manual_seed(1))
    positions = torch.arange(cfg.seq_length).expand_as(tokens)
    device = next(model.parameters()).device
    with torch.no_grad():
        model(tokens.to(device), positions.to(device), None)
    for handle in hooks:
        handle.remove()
    return calls


@pytest.mark.parametrize("scheme", list(ResidualScheme), ids=str)
def test_declared_fp32_computations_round_once(single_rank, scheme):
    if not scheme.traits.fp32:
        return  # nothing this scheme computes in fp32 on purpose: nothing to hold
    calls = declared_calls(scheme)
    seen = {name.rsplit(".", 1)[-1] for name, *_ in calls}
    assert seen == set(scheme.traits.fp32), \
        f"{scheme}: Traits.fp32 names {sorted(set(scheme.traits.fp32) - seen)}, which the " \
        "model has no module of (or never calls): model/schemes.py"
    assert_round_once(scheme, calls, "Traits.fp32 declares it fp32, so compute it in fp32 "
                      "and round its output once (or take it out of Traits.fp32)")


def _recorded(module, name: str, calls: list):
    """``module.add_norm``, each call recorded as ``name`` (as a forward hook records one)."""
    add_norm = module.add_norm

    def recorded(*args, **kwargs):
        output = add_norm(*args, **kwargs)
        calls.append((name, module, args, kwargs, output))
        return output
    return recorded


def assert_round_once(scheme, calls, fix: str) -> None:
    for name, module, args, kwargs, output in calls:
        exact = copy.deepcopy(module).float()
        if name.endswith(".add_norm"):  # the sum in the activation dtype, as the unfused
            # model adds (kernels.reference.residual_sum); the norm of it in fp32
            args = (residual_sum(*args[:2], args[2] if len(args) > 2 else
                                 kwargs.get("alpha", 1.0)),)
            kwargs = {}
        with torch.no_grad():
            want = outputs(exact(*as_fp32(args), **as_fp32(kwargs)))
        for i, (got, fp32) in enumerate(zip(outputs(output), want, strict=True)):
            once = rms_rel(fp32.to(got.dtype), fp32)
            err = rms_rel(got, fp32)
            assert err <= ONE_ROUNDING * once + 1e-6, (
                f"{scheme}: {name} (output {i}, {got.dtype}) is {err / max(once, 1e-30):.2f} "
                f"roundings off its fp32 computation, not one: {fix}")


@pytest.mark.parametrize("normalization", NORMS)
@pytest.mark.parametrize("scheme", list(ResidualScheme), ids=str)
def test_every_normalization_computes_in_fp32(single_rank, scheme, normalization):
    """Every norm of every scheme, of every registered kind, in a bf16 model: its output is
    its fp32 computation rounded once (a kind whose reference computed in the activation
    dtype, as DyT's tanh in bf16 would, is two or more roundings off)."""
    calls = declared_calls(scheme, lambda name, module: isinstance(module, Norm),
                           **norm_fields(normalization))
    assert calls, f"{scheme}: no norm module called"
    assert_round_once(scheme, calls, f"{normalization}'s compute in kernels/normalizations.py "
                      "must compute in fp32 and round its output once")



def test_the_experts_fp32_computations_are_fp32(single_rank):
    """A bf16 model with experts (sigmoid scores and the expert bias, the most arithmetic):
    every declared module's outputs are what it computes on its inputs and weights in fp32,
    in fp32, not rounded at all (the router's weight is bf16 in a bf16 model, as megatron
    keeps it; its product is fp32)."""
    cfg = tiny_model("siamese", num_layers=2, hidden_size=64, num_attention_heads=4,
                     seq_length=64, num_experts=4, moe_router_score_function="sigmoid",
                     moe_router_enable_expert_bias=True)
    [model] = build_model(cfg, ParallelConfig(), torch.bfloat16, norm_backend="torch", seed=0)
    perturb_every_parameter(model)
    calls, hooks = [], []
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in EXPERT_FP32:
            hooks.append(module.register_forward_hook(
                lambda module, args, kwargs, output, name=name:
                calls.append((name, module, args, kwargs, output)), with_kwargs=True))
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length),
                           generator=torch.Generator().manual_seed(1))
    device = next(model.parameters()).device
    with torch.no_grad():
        model(tokens.to(device), torch.arange(cfg.seq_length).expand_as(tokens).to(device), None)
    for handle in hooks:
        handle.remove()
    assert {name.rsplit(".", 1)[-1] for name, *_ in calls} == set(EXPERT_FP32)
    for name, module, args, kwargs, output in calls:
        module.float()  # in place: megatron's modules hold process groups, which do not copy
        with torch.no_grad():
            want = outputs(module(*as_fp32(args), **as_fp32(kwargs)))
        for i, (got, fp32) in enumerate(zip(outputs(output), want, strict=True)):
            assert got.dtype == fp32.dtype and torch.equal(got, fp32), (
                f"{name} (output {i}, {got.dtype}) is not its fp32 computation: EXPERT_FP32 "
                "declares it fp32 (model/schemes.py), so compute it in fp32")
