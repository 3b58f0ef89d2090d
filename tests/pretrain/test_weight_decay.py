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
from tests.helpers import NORMS, norm_fields, tiny_model

SCHEMES = [s.value for s in ResidualScheme]


def groups_by_param(optimizer) -> dict[int, float]:
    """{id(param): wd_mult} over megatron's (possibly chained) torch optimizers."""
    found = {}
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        for group in inner.optimizer.param_groups:
            for param in group["params"]:
                found[id(param)] = group["wd_mult"]
    return found


def optimizer_groups(model_config, add=None) -> tuple[dict[int, float], list]:
    """({id(param): wd_mult}, the wrapped chunks) of the optimizer built over ``model_config``'s
    model, after ``add(model)`` gave it more parameters."""
    parallel = ParallelConfig(distributed_optimizer=False)  # groups hold the parameters
    config = Config(model=model_config, parallel=parallel, optim=OptimConfig(weight_decay=0.1))
    chunks = build_model(config.model, parallel, seed=1)
    if add is not None:
        add(chunks[0])
        decay.assign(chunks, model_config.residual_scheme)
    chunks = wrap_ddp(chunks, parallel)
    optimizer, _ = build_optimizer(config, chunks, torch.float32)
    return groups_by_param(optimizer), chunks


@pytest.mark.parametrize("normalization", NORMS)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_optimizer_decays_exactly_the_weight_matrices(single_rank, scheme, normalization):
    """With every registered normalization: every parameter has a role that fits its rank
    (``decay.RANKS``: a 0-d scalar is never a matrix); the optimizer's groups give weight
    decay to exactly the parameters whose role is decayed (matrices), none to norms, biases,
    gates, scalars (DyT's alpha) and mixing coefficients, unless a parameter's declaration
    overrides its role by name (``decay.WHY``)."""
    wd, chunks = optimizer_groups(tiny_model(scheme, **norm_fields(normalization)))
    for name, param in chunks[0].module.named_parameters():
        role = getattr(param, decay.ROLE)
        assert isinstance(role, decay.Decay), (scheme, name)
        assert param.dim() in decay.RANKS[role], (scheme, name, role, tuple(param.shape))
        overridden = bool(getattr(param, decay.WHY, ""))
        assert decay.decayed(param) == ((role is decay.Decay.MATRIX) != overridden), \
            (scheme, name, role)
        assert wd[id(param)] == (1.0 if decay.decayed(param) else 0.0), (scheme, name, role)


def test_with_experts_the_routed_experts_have_an_optimizer_of_their_own(single_rank):
    """In one process too (parallel.ep 1, etp = tp), the routed experts' parameters, and only
    they, are expert parameters in the second optimizer of the chain
    (``model.moe.mark_experts``: one optimizer-state layout at every ep), with the decay of
    their role like every other parameter (the router and the shared expert stay with the
    rest)."""
    model = tiny_model("siamese", num_experts=4, moe_router_topk=2,
                       moe_shared_expert_intermediate_size=32)
    parallel = ParallelConfig(distributed_optimizer=False)
    config = Config(model=model, parallel=parallel, optim=OptimConfig(weight_decay=0.1))
    chunks = wrap_ddp(build_model(model, parallel, seed=1), parallel)
    optimizer, _ = build_optimizer(config, chunks, torch.float32)
    wd = groups_by_param(optimizer)
    dense, experts = ({id(p) for group in inner.optimizer.param_groups for p in group["params"]}
                      for inner in optimizer.chained_optimizers)
    routed = 0
    for name, param in chunks[0].module.named_parameters():
        is_routed = ".mlp.experts." in name
        routed += is_routed
        assert getattr(param, "allreduce", True) is not is_routed, name
        assert id(param) in (experts if is_routed else dense), name
        assert wd[id(param)] == (1.0 if decay.decayed(param) else 0.0), name
    assert routed and len(experts) == routed


def test_a_named_override_is_what_the_optimizer_does(single_rank):
    """A scheme that decays a scalar (or spares a matrix) says why, and the optimizer follows
    the declaration."""
    def add(model):
        layer = model.decoder.layers[1]
        layer.alpha = decay.declare(torch.nn.Parameter(torch.zeros(())), decay.Decay.SCALAR,
                                    decayed=True, why="a test of the override")
        layer.spared = decay.declare(torch.nn.Parameter(torch.zeros(2, 2)),
                                     decay.Decay.MATRIX, decayed=False, why="another")
    wd, chunks = optimizer_groups(tiny_model("pre"), add)
    layer = chunks[0].module.decoder.layers[1]
    assert (wd[id(layer.alpha)], wd[id(layer.spared)]) == (1.0, 0.0)
    assert getattr(layer.alpha, decay.WHY) == "a test of the override"
    with pytest.raises(ValueError, match="say why"):
        decay.declare(torch.nn.Parameter(torch.zeros(())), decay.Decay.SCALAR, decayed=True)
    assert not hasattr(decay.declare(layer.alpha, decay.Decay.SCALAR), decay.WHY)


@pytest.mark.parametrize("shape,role,refused", [
    ((), decay.Decay.MATRIX, r"declared matrix, which is for 2-d tensors, not 0-d ones .*"
                             r"declare the role it is \(scalar\)"),
    ((4, 4), decay.Decay.GATE, r"declared gate, which is for 1-d tensors, not 2-d ones .*"
                               r"\(matrix, mixing\)"),
    ((4,), decay.Decay.MATRIX, r"declared matrix, .* not 1-d ones"),
])
def test_a_role_its_shape_cannot_have_is_refused(single_rank, shape, role, refused):
    """A role must fit the parameter's rank: a 0-d scalar declared a matrix would be decayed
    by that accident. The message names the scheme, the parameter, the roles that fit and
    the named override."""
    [model] = build_model(tiny_model("pre"), ParallelConfig())
    model.decoder.layers[1].alpha = decay.declare(torch.nn.Parameter(torch.zeros(shape)), role)
    with pytest.raises(RuntimeError, match=r"pre: parameter decoder\.layers\.1\.alpha .*"
                                           + refused + r".*why="):
        decay.assign([model], "pre")


def test_a_role_against_the_modules_kind_is_refused(single_rank):
    """A norm's weight (a norm by its module) declared a gate is refused, naming its kind."""
    [model] = build_model(tiny_model("post"), ParallelConfig())
    norm = model.decoder.layers[0].attn_post_norm
    decay.declare(norm.weight, decay.Decay.GATE)
    with pytest.raises(RuntimeError, match=r"attn_post_norm\.weight .* is declared gate, but "
                                           r"its module makes it a norm"):
        decay.assign([model], "post")


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
