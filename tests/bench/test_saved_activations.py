"""What each residual scheme's layer keeps for backward, counted tensor by tensor on the real
model (Triton norms, interpreted on a CPU machine), against the dry run's per-layer estimate.

The estimate (``pretrain.report.dry_run``) is derived from the code's design, tensor by tensor; the
count comes from autograd's saved-tensor hooks (``bench.saved_activations``), so a module that
starts keeping one more activation, or a kernel that stops keeping one, shows here. The estimate
leaves out small terms, which bound the allowed gap: RoPE's cos/sin (4 x head_dim values
per token, unfused), the norms' fp32 row statistics and the per-token mixing coefficients of
schemes that mix several streams.
"""

from __future__ import annotations

import pytest

from bench import saved_activations
from model.config import ModelConfig
from model.schemes import ResidualScheme

pytestmark = pytest.mark.slow

HIDDEN, HEADS = 256, 16  # head_dim 16: RoPE's cos/sin stay a small fraction of h
WIDTH = 2  # bf16
STATS = 64  # at most 16 fp32 statistics per token and layer (three entries of 6, or fewer)
ARGS = saved_activations.parse_args([f"--hidden={HIDDEN}", f"--heads={HEADS}", "--ffn=512",
                                     "--seq=64", "--vocab=256"])
# Schemes that mix more than two streams keep per-token mixing coefficients the estimate
# leaves out; they are measured at a width where one missed h-sized tensor is still larger
# than that allowance.
WIDE = saved_activations.parse_args(["--hidden=768", "--heads=24", "--ffn=1024", "--seq=64",
                                     "--vocab=256"])
SCHEMES = [s.value for s in ResidualScheme]


def mixes(scheme: str) -> int:
    """The streams a scheme mixes with per-token coefficients (0 for one or two streams)."""
    traits = ResidualScheme(scheme).traits
    n = ModelConfig(residual_scheme=scheme).residual_streams
    return 0 if n == 1 or traits.two_stream else n


def allowance(scheme: str, args) -> int:
    """Bytes per token and layer the estimate may miss: RoPE's cos/sin (4 x head_dim values,
    unfused), the norms' fp32 statistics and, for n mixed streams, per sublayer at most five
    fp32 copies of its n^2 + 2n mixing coefficients (mhc measured 755 bytes at n = 4, hc 256)."""
    n = mixes(scheme)
    return 4 * (args.hidden // args.heads) * WIDTH + STATS + 2 * 5 * 4 * (n * n + 2 * n)


@pytest.fixture(scope="module")
def kept(single_rank):
    """Bytes per token and layer, measured and estimated, for each scheme."""
    return {s: saved_activations.layer_bytes(WIDE if mixes(s) else ARGS, s) for s in SCHEMES}


@pytest.mark.parametrize("scheme", SCHEMES)
def test_estimate_accounts_for_every_kept_activation(kept, scheme):
    """Every registered scheme: what autograd keeps per layer equals the dry run's estimate
    (``Traits.stream_values`` for what a block keeps outside its branches) up to the terms it
    leaves out, an allowance smaller than one h-sized tensor, so a tensor kept and not
    counted (or counted and not kept) fails here, naming the scheme."""
    args = WIDE if mixes(scheme) else ARGS
    bound = allowance(scheme, args)
    assert bound < args.hidden * WIDTH, (scheme, bound)
    gap = kept[scheme]["measured"] - kept[scheme]["estimated"]
    assert 0 <= gap <= bound, (scheme, f"measured - estimated = {gap:.0f} bytes per token and "
                               f"layer, allowed 0..{bound}", kept[scheme])


def test_second_stream_costs_one_value_per_token_and_layer(kept):
    """Each sublayer entry reads x and y where Pre-Norm reads one h, but the MLP entry keeps only
    the attention output r (the updated streams and u are recomputed from the layer input,
    which the attention entry keeps): SiameseNorm keeps h more per layer than Pre-Norm, the
    hybrid form 2h more than HybridNorm (whose attention has no norm in front to keep an
    input; the channel gate keeps x itself, no fp32 copy)."""
    h = HIDDEN * WIDTH
    extra = kept["siamese"]["measured"] - kept["pre"]["measured"]
    extra_hybrid = kept["siamese_hybrid"]["measured"] - kept["hybridnorm"]["measured"]
    assert abs(extra - h) <= STATS, extra
    assert abs(extra_hybrid - 2 * h) <= STATS, extra_hybrid
