"""Each parameter's weight-decay role, declared where the parameter is made.

megatron's optimizer exempts from weight decay whatever is one-dimensional or named ``bias``
and decays the rest. That rule is about shapes, not meaning: a learned scalar (a 0-d tensor),
an n x n static mixing matrix or a [1]-shaped gate would be decayed or not by the accident of
its shape. Here every parameter has a role instead, and only weight matrices (linear layers,
embeddings, the schemes' own projections) are decayed, as the papers' recipes do: norms,
biases, gates, learned scalars and mixing coefficients are not, unless a scheme declares
otherwise.

megatron's own modules get their role from their kind (linear, embedding, norm); a scheme's
own parameters declare theirs with :func:`declare`. :func:`assign` runs when a model is built
and refuses a parameter with neither, naming the scheme and the parameter, so a new scheme
cannot leave a scalar to megatron's shape rule unnoticed. It also refuses a role that does not
fit the parameter: one its shape cannot have (:data:`RANKS`: a 0-d scalar declared a matrix
would be decayed by that accident instead), or one that contradicts its module's kind (a norm's
weight declared a gate). Whether a role is decayed is the role's default; a scheme that means
otherwise says so by name, ``declare(param, role, decayed=..., why="...")``, and the reason
stays on the parameter for the tests and the reader.
"""

from __future__ import annotations

from enum import StrEnum

import torch


class Decay(StrEnum):
    """What a parameter is, for weight decay (``MATRIX`` alone is decayed by default)."""

    MATRIX = "matrix"
    """A weight matrix: linear layers, embeddings, a scheme's learned projections."""
    NORM = "norm"
    """A norm's weight or bias."""
    BIAS = "bias"
    """A linear layer's bias."""
    GATE = "gate"
    """A per-channel gate (siamese_hybrid's g)."""
    SCALAR = "scalar"
    """A learned scalar (a gate's strength, a branch's scale)."""
    MIXING = "mixing"
    """Static mixing coefficients between residual streams."""


RANKS: dict[Decay, tuple[int, ...]] = {
    Decay.MATRIX: (2,),
    Decay.NORM: (1,),
    Decay.BIAS: (1,),
    Decay.GATE: (1,),
    Decay.SCALAR: (0, 1),  # one scalar, or a few side by side (mHC's three gates)
    Decay.MIXING: (1, 2),  # per stream, or stream by stream
}
"""The tensor ranks each role fits: what a parameter of another rank declared in that role is
refused for."""

ROLE = "decay_role"
"""The parameter attribute holding its :class:`Decay`."""
DECAYED = "weight_decayed"
"""The parameter attribute holding whether the optimizer decays it."""


MUON = "muon_matrix"
"""The parameter attribute holding whether optim.name muon steps it with Muon: a weight of one
of megatron's linear layers (the blocks' attention and MLP projections), set by :func:`assign`
from the module's kind like the role. Not the output layer (megatron marks it an embedding's
kin, ``is_embedding_or_output_parameter``), nor a scheme's declared matrix (a hyper-connection
projection reads the streams, not a hidden feature), nor a router or an embedding: those, and
every parameter that is not a matrix, stay AdamW's."""

WHY = "weight_decay_override"
"""The parameter attribute holding why its decay differs from its role's default (absent when
it does not)."""


def declare(param: torch.nn.Parameter, role: Decay, *, decayed: bool | None = None,
            why: str | None = None) -> torch.nn.Parameter:
    """Give ``param`` its role, decayed by the role's default (MATRIX only). ``decayed``
    against that default is an override and needs ``why``, the reason, kept on the parameter
    (``WHY``); ValueError without one."""
    role = Decay(role)
    default = role is Decay.MATRIX
    setattr(param, ROLE, role)
    setattr(param, DECAYED, default if decayed is None else decayed)
    if decayed is not None and decayed != default:
        if not why:
            raise ValueError(f"declare({role}, decayed={decayed}) overrides the role's default "
                             "weight decay: say why, declare(..., why=\"...\")")
        setattr(param, WHY, why)
    elif hasattr(param, WHY):
        delattr(param, WHY)
    return param


def _kind(module: torch.nn.Module, name: str) -> Decay | None:
    """The role of megatron's (and Transformer Engine's) own parameters, from the module
    that holds them: norms, linear layers (TE's fuse a norm in: ``layer_norm_*``),
    embeddings and the MoE router's; None for anything else."""
    kind = type(module).__name__
    roles = getattr(module, "parameter_roles", None)  # a registered normalization's own
    if roles is not None and name in roles:
        return Decay(roles[name])
    if kind.endswith("Norm"):
        return Decay.NORM
    if name.startswith("layer_norm_"):
        return Decay.NORM
    if name == "bias" and ("Linear" in kind or "Embedding" in kind):
        return Decay.BIAS
    if name == "weight" and ("Linear" in kind or "Embedding" in kind):
        return Decay.MATRIX
    # megatron's MoE: the router's projection [experts, h] and the shared expert's gate
    # [1, h] are projections of the hidden state, decayed like any other (megatron's rule).
    if (name == "weight" and kind.endswith("Router")) or \
            (name == "gate_weight" and kind.startswith("SharedExpert")):
        return Decay.MATRIX
    if name == "bias" and kind.endswith("Router"):  # its logits' bias (model.add_bias_linear)
        return Decay.BIAS
    return None


def assign(chunks, scheme: str) -> None:
    """Give every parameter of ``chunks`` its role (declared, or from its module's kind);
    RuntimeError naming ``scheme``, the parameter and the fix for one that has neither, or
    whose declared role does not fit its rank (:data:`RANKS`) or its module's kind."""
    for chunk in chunks:
        for module_name, module in chunk.named_modules():
            for name, param in module.named_parameters(recurse=False):
                where = f"{module_name}.{name}" if module_name else name
                what = (f"residual scheme {scheme}: parameter {where} ({type(module).__name__}, "
                        f"shape {tuple(param.shape)})")
                kind = _kind(module, name)
                setattr(param, MUON, _block_linear(module, name, param, kind))
                role = getattr(param, ROLE, None)
                if role is None and kind is None:
                    raise RuntimeError(
                        f"{what} declares no weight-decay role: give it one with "
                        "model.decay.declare where the layer makes it")
                if role is None:
                    declare(param, kind)
                    _require_rank(param, kind, f"{what} takes the role {kind} from its module",
                                  _fix_of_kind(module))
                    continue
                if kind is not None and role is not kind:
                    raise RuntimeError(
                        f"{what} is declared {role}, but its module makes it a {kind}: "
                        f"declare it {kind} (model/decay.py), or make it in a module of its own")
                _require_rank(param, role, f"{what} is declared {role}",
                              "declare the role it is")


def _fix_of_kind(module: torch.nn.Module) -> str:
    """Where a role that comes from the module's kind is fixed."""
    if getattr(module, "parameter_roles", None) is not None:
        return ("declare the role it is in its normalization's NormParameter "
                "(kernels/normalizations.py)")
    return "give it its role in model.decay._kind, or declare it where the layer makes it"


def _require_rank(param: torch.nn.Parameter, role: Decay, what: str, fix: str) -> None:
    """Refuse a role the parameter's rank cannot have (:data:`RANKS`), whatever its source: a
    0-d scalar that took the role of a matrix from its module would be decayed by accident."""
    if param.dim() in RANKS[role]:
        return
    fits = ", ".join(r.value for r, ranks in RANKS.items() if param.dim() in ranks)
    raise RuntimeError(
        f"{what}, which is for {_ranks(RANKS[role])} tensors, not {param.dim()}-d ones "
        f"(model.decay.RANKS): {fix} ({fits}); to decay it or not against that role's "
        "default, declare(param, role, decayed=..., why=\"...\")")


def _block_linear(module: torch.nn.Module, name: str, param: torch.nn.Parameter,
                  kind: Decay | None) -> bool:
    return (kind is Decay.MATRIX and name == "weight" and "Linear" in type(module).__name__
            and not getattr(param, "is_embedding_or_output_parameter", False))


def muon_matrix(param: torch.nn.Parameter) -> bool:
    """Whether optim.name muon steps ``param`` with Muon (after :func:`assign`, :data:`MUON`)."""
    if not hasattr(param, MUON):
        raise RuntimeError(f"a parameter of shape {tuple(param.shape)} has no optimizer role: "
                           "the model was not built by model.builder.build_model")
    return getattr(param, MUON)


def _ranks(ranks: tuple[int, ...]) -> str:
    return " or ".join(f"{r}-d" for r in ranks)


def decayed(param: torch.nn.Parameter) -> bool:
    """Whether the optimizer decays ``param`` (after :func:`assign`)."""
    if not hasattr(param, DECAYED):
        raise RuntimeError(f"a parameter of shape {tuple(param.shape)} has no weight-decay "
                           "role: the model was not built by model.builder.build_model")
    return getattr(param, DECAYED)
