"""One file per residual scheme, each saying which layer class builds each block.

A scheme's file holds ``layer(model, index)`` and optionally ``final_norm(model, norm)``,
``init_std(model, key)``, ``scale_init(model, key, weight)`` and ``START`` (where its own
undrawn parameters start: model/init.py). ``pre`` is megatron's own TransformerLayer; the
shared classes live in ``base``, ``two_stream`` and ``merge``.
"""

from __future__ import annotations

from types import ModuleType

# <generated: layer-files> python -m pretrain.report.scheme_lists --write
from model.layers import (
    deepnorm,
    hc,
    hybridnorm,
    mhc,
    mixln,
    olmo2,
    periln,
    post,
    pre,
    siamese,
    siamese_hybrid,
)
from model.schemes import ResidualScheme

SCHEME_FILES: dict[ResidualScheme, ModuleType] = {
    ResidualScheme.PRE: pre,
    ResidualScheme.POST: post,
    ResidualScheme.SIAMESE: siamese,
    ResidualScheme.SIAMESE_HYBRID: siamese_hybrid,
    ResidualScheme.DEEPNORM: deepnorm,
    ResidualScheme.HYBRIDNORM: hybridnorm,
    ResidualScheme.MIXLN: mixln,
    ResidualScheme.HC: hc,
    ResidualScheme.PERILN: periln,
    ResidualScheme.OLMO2: olmo2,
    ResidualScheme.MHC: mhc,
}
# </generated>
