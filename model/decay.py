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
cannot leave a scalar to megatron's shape rule unnoticed.
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


ROLE = "decay_role"
"""The parameter attribute holding its :class:`Decay`."""
DECAYED = "weight_decayed"
"""The parameter attribute holding whether the optimizer decays it."""


def declare(param: torch.nn.Parameter, role: Decay, *, decayed: bool | None = None
            ) -> torch.nn.Parameter:
    """Give ``param`` its role; ``decayed`` overrides the role's default (MATRIX only)."""
    setattr(param, ROLE, Decay(role))
    setattr(param, DECAYED, role is Decay.MATRIX if decayed is None else decayed)
    return param


def _kind(module: torch.nn.Module, name: str) -> Decay | None:
    """The role of megatron's (and Transformer Engine's) own parameters, from the module
    that holds them: norms, linear layers (TE's fuse a norm in: ``layer_norm_*``) and
    embeddings; None for anything else."""
    kind = type(module).__name__
    if kind.endswith("Norm"):
        return Decay.NORM
    if name.startswith("layer_norm_"):
        return Decay.NORM
    if name == "bias" and ("Linear" in kind or "Embedding" in kind):
        return Decay.BIAS
    if name == "weight" and ("Linear" in kind or "Embedding" in kind):
        return Decay.MATRIX
    return None


def assign(chunks, scheme: str) -> None:
    """Give every parameter of ``chunks`` its role (declared, or from its module's kind);
    RuntimeError naming ``scheme`` and the parameter for one that has neither."""
    for chunk in chunks:
        for module_name, module in chunk.named_modules():
            for name, param in module.named_parameters(recurse=False):
                if getattr(param, ROLE, None) is not None:
                    continue
                role = _kind(module, name)
                if role is None:
                    where = f"{module_name}.{name}" if module_name else name
                    raise RuntimeError(
                        f"residual scheme {scheme}: parameter {where} ({type(module).__name__}, "
                        f"shape {tuple(param.shape)}) declares no weight-decay role: give it "
                        "one with model.decay.declare where the layer makes it")
                declare(param, role)


def decayed(param: torch.nn.Parameter) -> bool:
    """Whether the optimizer decays ``param`` (after :func:`assign`)."""
    if not hasattr(param, DECAYED):
        raise RuntimeError(f"a parameter of shape {tuple(param.shape)} has no weight-decay "
                           "role: the model was not built by model.builder.build_model")
    return getattr(param, DECAYED)
