"""The Hugging Face remote code keeps every scheme's fp32 modules (``Traits.fp32``) in fp32 when
a model loads in bf16, for every registered scheme, and with experts the router too
(``EXPERT_FP32``: its weight and the expert bias it routes by); a bf16 model of every scheme,
dense and with experts, runs.

In-process and from the remote code's own classes (no export, no subprocess): what is tested is
the list the remote code reads, ``FP32_MODULES`` (generated from the registry by
``python -m pretrain.report.scheme_lists --write``), and what transformers does with it.
"""

from __future__ import annotations

import pytest
import torch

from model.schemes import EXPERT_FP32, ResidualScheme

# every routed part of an MoE block: a shared expert beside the routed ones, the expert bias
EXPERTS = dict(num_experts=4, moe_router_topk=2, moe_shared_expert_intermediate_size=32,
               moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)


def remote_model(scheme: str, experts: bool = False):
    from pretrain.hf.remote.configuration_siamesenorm import SiameseNormConfig
    from pretrain.hf.remote.modeling_siamesenorm import SiameseNormForCausalLM

    config = SiameseNormConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                               num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, residual_scheme=scheme,
                               **(EXPERTS if experts else {}))
    model = SiameseNormForCausalLM(config)
    with torch.no_grad():  # the router's values off the bf16 grid, which bf16 would round
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if ".router." in name:
                tensor.copy_(torch.linspace(-0.3, 0.3, tensor.numel()).view(tensor.shape)
                             + 1e-4)
    return model


@pytest.mark.parametrize("experts", [False, True], ids=["dense", "experts"])
@pytest.mark.parametrize("scheme", list(ResidualScheme), ids=str)
def test_bf16_keeps_the_declared_fp32_modules_in_fp32(scheme, experts, tmp_path):
    """Loaded in bf16, exactly the weights (and buffers) under the scheme's fp32 modules, and
    with experts the router's, are fp32 (every declared module exists in the remote model),
    the rest bf16, and the model runs."""
    from pretrain.hf.remote.modeling_siamesenorm import SiameseNormForCausalLM

    saved = remote_model(scheme.value, experts)
    saved.save_pretrained(tmp_path)
    half = SiameseNormForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    declared = set(scheme.traits.fp32) | (set(EXPERT_FP32) if experts else set())
    modules = {name.rsplit(".", 1)[-1] for name, _ in half.named_modules()}
    assert declared <= modules, f"{scheme}: the remote code has no {sorted(declared - modules)}"
    tensors = [*half.named_parameters(), *half.named_buffers()]
    assert any(name.endswith("router.expert_bias") for name, _ in tensors) == experts
    before = dict([*saved.named_parameters(), *saved.named_buffers()])
    for name, param in tensors:
        kept = bool(declared & set(name.split(".")))
        want = torch.float32 if kept else torch.bfloat16
        assert param.dtype == want, f"{scheme}: {name} loads as {param.dtype}, not {want}"
        if kept:  # the saved fp32 values, not their bf16 rounding
            assert torch.equal(param, before[name]), f"{scheme}: {name} was rounded"
    with torch.no_grad():
        logits = half(torch.arange(8)[None]).logits
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all(), scheme
