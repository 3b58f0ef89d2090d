"""Our models compute what the official SiameseNorm code computes, weight for weight.

tests/official_reference.py transcribes the official code (OLMo hybrid_pre block, HybridNorm*
flags, the post_pre block, OLMo's Pre-Norm block); here a model built by this framework, with
every norm weight, gate and bias moved off its init, and the transcription over the same
weights must give the same logits (fp32 model against float64 transcription).
"""

import pytest
import torch

from model.builder import build_model
from model.config import ParallelConfig
from tests.helpers import tiny_model
from tests.official_reference import OfficialModel, official_params

HYBRIDNORM_STAR = {"attn_norm": True, "ffn_residual": False}  # the official flag on block 0
CASES = [  # (scheme, our fields, the official code's block-0 flag)
    ("pre", {}, None),
    ("siamese", {}, None),
    ("siamese", {"siamese_depth_constant": False}, None),
    ("siamese_hybrid", {}, None),
    ("siamese_hybrid", {"hybrid_first_block": "prenorm"}, HYBRIDNORM_STAR),
    ("siamese_hybrid", {"siamese_depth_constant": False}, None),
]
NORMS = {"rmsnorm": {"normalization": "rmsnorm"},
         "layernorm": {"normalization": "layernorm"},
         "layernorm+bias": {"normalization": "layernorm", "norm_bias": True}}


def max_rel_error(scheme: str, fields: dict, flag: dict | None, norm: str,
                  official_only: tuple[str, ...] = ()) -> float:
    """Max relative logit error; ``official_only``: norms only the official model has, which
    start at 1 there."""
    cfg = tiny_model(scheme, **fields, **NORMS[norm])
    [model] = build_model(cfg, ParallelConfig(), seed=5)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "gate" in name:
                param.add_((0.3 * torch.randn(param.shape, generator=generator)).to(param))
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=generator)
    device = next(model.parameters()).device
    positions = torch.arange(cfg.seq_length).expand_as(tokens)
    with torch.no_grad():
        ours = model(tokens.to(device), positions.to(device), None).cpu().double()
    params = official_params(cfg, dict(model.named_parameters()))
    params.update({name: torch.ones(cfg.hidden_size, dtype=torch.float64)
                   for name in official_only})
    official = OfficialModel(cfg, params, flag)
    theirs = official.logits(tokens)
    return ((ours - theirs).abs().max() / theirs.abs().max()).item()


@pytest.mark.parametrize("norm", list(NORMS))
@pytest.mark.parametrize("scheme,fields,flag", CASES, ids=lambda v: str(v) if v else "-")
def test_logits_equal_the_official_code(single_rank, scheme, fields, flag, norm):
    assert max_rel_error(scheme, fields, flag, norm) <= 1e-5


def test_the_literal_reading_is_another_function(single_rank):
    """SIAMESENORM.md's wording (no norm on x before block 0's MLP) against the official flag
    (a norm there, at its initial weight 1): the comparison tells the two readings apart."""
    error = max_rel_error("siamese_hybrid", {"hybrid_first_block": "prenorm_literal"},
                          HYBRIDNORM_STAR, "rmsnorm", official_only=("blocks.0.ff_norm.weight",))
    assert error > 1e-3
