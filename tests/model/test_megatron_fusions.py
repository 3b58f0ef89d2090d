"""``model.megatron_fusions``: megatron's fused bias-SwiGLU/GELU, bias-dropout-add and native
cross-entropy compute the unfused function.

On a GPU the fused functions run compiled, as in training. On the CPU they run as plain torch
(``torch._dynamo`` disabled: compiling them to C++ would cost the suite a minute and test the
compiler rather than megatron's code); that still runs every fused code path, which is where a
numerical difference would come from (megatron's fused cross-entropy, for one, returns bf16
gradients: it is only used in bf16 runs).
"""

import pytest
import torch
import torch._dynamo
from megatron.core.transformer.module import Float16Module

from model.builder import build_model, wrap_ddp
from model.config import ParallelConfig
from model.megatron_config import transformer_config
from runtime.schedule import forward_backward
from tests.helpers import MBS, SEQ, batches, tiny_model

CUDA = torch.cuda.is_available()
CASES = {
    "pre-swiglu-bias": ("pre", {"add_bias_linear": True}),
    "pre-gelu-bias": ("pre", {"activation": "gelu", "add_bias_linear": True}),
    "siamese-swiglu": ("siamese", {}),
    "siamese_hybrid-swiglu-bias": ("siamese_hybrid", {"add_bias_linear": True}),
}


def flags(dtype=torch.float32, **fields) -> dict:
    tc = transformer_config(tiny_model("pre", **fields), ParallelConfig(), dtype)
    return {name: getattr(tc, name) for name in (
        "bias_activation_fusion", "bias_dropout_fusion", "cross_entropy_loss_fusion",
        "apply_rope_fusion", "gradient_accumulation_fusion")}


def test_which_fusions_apply():
    assert not any(flags(megatron_fusions="off").values())
    assert any(flags().values()) == CUDA  # auto: on with CUDA only
    on = flags(megatron_fusions="on")
    assert on["bias_activation_fusion"] and on["bias_dropout_fusion"]
    assert not on["cross_entropy_loss_fusion"]  # fp32: its gradient would be bf16
    assert flags(torch.bfloat16, megatron_fusions="on")["cross_entropy_loss_fusion"]
    # megatron's fused GELU is the tanh approximation: another function, never used
    assert not flags(megatron_fusions="on", activation="gelu",
                     add_bias_linear=True)["bias_activation_fusion"]


def loss_and_grads(scheme: str, fields: dict, fusions: str, dtype: torch.dtype):
    cfg = tiny_model(scheme, megatron_fusions=fusions, **fields)
    parallel = ParallelConfig()
    chunks = build_model(cfg, parallel, dtype, seed=2)
    if dtype is torch.bfloat16:
        chunks = [Float16Module(c.config, c) for c in chunks]
    chunks = wrap_ddp(chunks, parallel)
    with torch._dynamo.config.patch(disable=not CUDA):
        losses = forward_backward(chunks, batches(2), 2, SEQ, MBS)
    grads = {n.replace("module.", ""): p.main_grad.detach().float().cpu().clone()
             for n, p in chunks[0].named_parameters()}
    return torch.stack(losses).float().cpu(), grads


def max_rel(a: dict, b: dict) -> float:
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-12)).item()
               for k in b)


@pytest.mark.parametrize("case", list(CASES))
def test_fused_fp32_equals_unfused(single_rank, case):
    scheme, fields = CASES[case]
    loss, grads = loss_and_grads(scheme, fields, "on", torch.float32)
    ref_loss, ref_grads = loss_and_grads(scheme, fields, "off", torch.float32)
    assert torch.allclose(loss, ref_loss, rtol=1e-6, atol=0)
    assert max_rel(grads, ref_grads) <= 1e-5


def test_fused_bf16_is_as_close_to_fp32_as_unfused(single_rank):
    """bf16 with every fusion (the fused cross-entropy included) stays as close to the fp32
    computation as bf16 without them."""
    scheme, fields = CASES["pre-swiglu-bias"]
    _, exact = loss_and_grads(scheme, fields, "off", torch.float32)
    _, fused = loss_and_grads(scheme, fields, "on", torch.bfloat16)
    _, unfused = loss_and_grads(scheme, fields, "off", torch.bfloat16)
    assert max_rel(fused, exact) <= 1.5 * max_rel(unfused, exact) + 1e-3
