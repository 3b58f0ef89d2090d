"""Full and selective activation recomputation leave gradients unchanged."""

import pytest
import torch

from model.builder import build_model, wrap_ddp
from model.config import ParallelConfig
from model.schemes import ResidualScheme
from runtime.schedule import forward_backward
from tests.helpers import MBS, SEQ, batches, tiny_model


def grads_with(scheme: str, model_fields: dict | None = None,
               **parallel) -> tuple[list[float], dict, int]:
    """Losses, gradients, and how often block 0's recomputable module ran."""
    par = ParallelConfig(distributed_optimizer=False, **parallel)
    torch.manual_seed(3)
    [ddp] = wrap_ddp(build_model(tiny_model(scheme, **(model_fields or {})), par), par)
    layer = ddp.module.decoder.layers[0]
    watched = layer.self_attention.core_attention if par.recompute == "selective" else layer
    calls = []
    watched.register_forward_hook(lambda *_: calls.append(1))
    losses = [float(loss) for loss in forward_backward([ddp], batches(2), 2, SEQ, MBS)]
    grads = {n: p.main_grad.clone() for n, p in ddp.module.named_parameters()}
    return losses, grads, len(calls)


@pytest.mark.parametrize("scheme", [s.value for s in ResidualScheme])  # every one
@pytest.mark.parametrize("recompute", [
    dict(recompute="full", recompute_num_layers=1),
    dict(recompute="full", recompute_num_layers=2),
    dict(recompute="selective"),
], ids=["full-1", "full-2", "selective"])
def test_recompute_gives_same_gradients(single_rank, scheme, recompute):
    base_losses, base, base_calls = grads_with(scheme)
    losses, grads, calls = grads_with(scheme, **recompute)
    assert calls == 2 * base_calls, "the module was not recomputed in backward"
    assert losses == pytest.approx(base_losses, rel=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, base[name], rtol=1e-5, atol=1e-7, msg=name)


# Experts in every other block, with the balancing and z losses: their gradients flow through
# megatron's MoEAuxLossAutoScaler, attached again when a block is recomputed.
MOE = {"num_experts": 4, "moe_router_topk": 2, "moe_layer_freq": 2, "moe_z_loss_coeff": 1e-3}


@pytest.mark.parametrize("scheme", [s.value for s in ResidualScheme])  # every one
def test_full_recompute_of_moe_blocks_gives_same_gradients(single_rank, scheme):
    base_losses, base, base_calls = grads_with(scheme, MOE)
    losses, grads, calls = grads_with(scheme, MOE, recompute="full", recompute_num_layers=1)
    assert calls == 2 * base_calls, "the block was not recomputed in backward"
    assert losses == pytest.approx(base_losses, rel=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, base[name], rtol=1e-5, atol=1e-7, msg=name)
