"""Weight decay follows each parameter's declared role (model.decay), for every scheme.

megatron's own rule exempts what is one-dimensional or named ``bias`` and decays the rest, so a
learned scalar (0-d) or a static n x n mixing matrix was decayed by the accident of its shape.
Here every parameter has a role, and the optimizer decays the weight matrices only.
"""

import pytest
import torch

from model import decay
from model.builder import build_model, wrap_ddp
from model.config import ParallelConfig
from model.schemes import ResidualScheme
from pretrain.config import Config, OptimConfig
from pretrain.optim import build_optimizer
from tests.helpers import tiny_model

SCHEMES = [s.value for s in ResidualScheme]


def groups_by_param(optimizer) -> dict[int, float]:
    """{id(param): wd_mult} over megatron's (possibly chained) torch optimizers."""
    found = {}
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        for group in inner.optimizer.param_groups:
            for param in group["params"]:
                found[id(param)] = group["wd_mult"]
    return found


@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_optimizer_decays_exactly_the_weight_matrices(single_rank, scheme):
    """Every parameter has a role; the optimizer's groups give weight decay to exactly the
    parameters whose role is decayed (matrices), none to norms, biases, gates, scalars and
    mixing coefficients."""
    parallel = ParallelConfig(distributed_optimizer=False)  # groups hold the parameters
    config = Config(model=tiny_model(scheme), parallel=parallel,
                    optim=OptimConfig(weight_decay=0.1))
    chunks = wrap_ddp(build_model(config.model, parallel, seed=1), parallel)
    optimizer, _ = build_optimizer(config, chunks, torch.float32)
    wd = groups_by_param(optimizer)
    for name, param in chunks[0].module.named_parameters():
        role = getattr(param, decay.ROLE)
        assert isinstance(role, decay.Decay), (scheme, name)
        assert wd[id(param)] == (1.0 if role is decay.Decay.MATRIX else 0.0), (scheme, name, role)


def test_the_roles_of_each_kind(single_rank):
    """Norm weights, linear weights, embeddings, gates, scalars and mixing coefficients get the
    role they are (checked by name on models that hold each kind)."""
    expected = {
        "embedding.word_embeddings.weight": decay.Decay.MATRIX,
        "decoder.layers.1.self_attention.linear_qkv.weight": decay.Decay.MATRIX,
        "decoder.layers.1.mlp_norms.pre.weight": decay.Decay.NORM,
        "decoder.layers.1.attn_gate.weight": decay.Decay.GATE,
        "decoder.layers.1.self_attention.q_layernorm.weight": decay.Decay.NORM,
    }
    [hybrid] = build_model(tiny_model("siamese_hybrid"), ParallelConfig())
    [hc] = build_model(tiny_model("hc"), ParallelConfig())
    roles = {n: getattr(p, decay.ROLE) for n, p in hybrid.named_parameters()}
    roles |= {f"hc:{n}": getattr(p, decay.ROLE) for n, p in hc.named_parameters()}
    expected |= {"hc:decoder.layers.0.attn_hc.depth": decay.Decay.MIXING,
                 "hc:decoder.layers.0.attn_hc.width_scale": decay.Decay.SCALAR,
                 "hc:decoder.layers.0.attn_hc.proj": decay.Decay.MATRIX}
    assert {n: roles[n] for n in expected} == expected


def test_an_undeclared_parameter_is_refused_naming_scheme_and_parameter(single_rank):
    """A scheme's layer that makes a parameter without a role (a ReZero scale, say) fails
    when the model is built, naming the scheme and the parameter."""
    [model] = build_model(tiny_model("pre"), ParallelConfig())
    layer = model.decoder.layers[1]
    layer.alpha = torch.nn.Parameter(torch.zeros(()))
    with pytest.raises(RuntimeError, match=r"pre: parameter decoder\.layers\.1\.alpha "):
        decay.assign([model], "pre")
    decay.declare(layer.alpha, decay.Decay.SCALAR)
    decay.assign([model], "pre")
    assert not decay.decayed(layer.alpha)
    decay.declare(layer.alpha, decay.Decay.SCALAR, decayed=True)  # a scheme may say otherwise
    assert decay.decayed(layer.alpha)
