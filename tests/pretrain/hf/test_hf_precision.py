"""The Hugging Face remote code keeps every scheme's fp32 modules (``Traits.fp32``) in fp32 when
a model loads in bf16, for every registered scheme, and a bf16 model of every scheme runs.

In-process and from the remote code's own classes (no export, no subprocess): what is tested is
the list the remote code reads, ``FP32_MODULES`` (generated from the registry by
``python -m pretrain.report.scheme_lists --write``), and what transformers does with it.
"""

from __future__ import annotations

import pytest
import torch

from model.schemes import ResidualScheme


def remote_model(scheme: str):
    from pretrain.hf.remote.configuration_siamesenorm import SiameseNormConfig
    from pretrain.hf.remote.modeling_siamesenorm import SiameseNormForCausalLM

    config = SiameseNormConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                               num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, residual_scheme=scheme)
    return SiameseNormForCausalLM(config)


@pytest.mark.parametrize("scheme", list(ResidualScheme), ids=str)
def test_bf16_keeps_the_declared_fp32_modules_in_fp32(scheme, tmp_path):
    """Loaded in bf16, exactly the weights under the scheme's fp32 modules are fp32 (every
    declared module exists in the remote model), the rest bf16, and the model runs."""
    from pretrain.hf.remote.modeling_siamesenorm import SiameseNormForCausalLM

    remote_model(scheme.value).save_pretrained(tmp_path)
    half = SiameseNormForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    declared = set(scheme.traits.fp32)
    modules = {name.rsplit(".", 1)[-1] for name, _ in half.named_modules()}
    assert declared <= modules, f"{scheme}: the remote code has no {sorted(declared - modules)}"
    for name, param in half.named_parameters():
        kept = bool(declared & set(name.split(".")))
        want = torch.float32 if kept else torch.bfloat16
        assert param.dtype == want, f"{scheme}: {name} loads as {param.dtype}, not {want}"
    with torch.no_grad():
        logits = half(torch.arange(8)[None]).logits
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all(), scheme
