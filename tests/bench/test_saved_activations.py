"""What each residual scheme's layer keeps for backward, counted tensor by tensor on the real
model (Triton norms, interpreted on a CPU machine), against the dry run's per-layer estimate.

The estimate (``pretrain.report.dry_run``) is derived from the code's design, tensor by tensor; the
count comes from autograd's saved-tensor hooks (``bench.saved_activations``), so a module that
starts keeping one more activation, or a kernel that stops keeping one, shows here. The estimate
leaves out two small terms, which bound the allowed gap: RoPE's cos/sin (4 x head_dim values
per token, unfused) and the norms' fp32 row statistics.
"""

from __future__ import annotations

import pytest

from bench import saved_activations
from model.schemes import ResidualScheme

pytestmark = pytest.mark.slow

HIDDEN, HEADS = 256, 16  # head_dim 16: RoPE's cos/sin stay a small fraction of h
WIDTH = 2  # bf16
ROPE = 4 * (HIDDEN // HEADS) * WIDTH
STATS = 64  # at most 16 fp32 statistics per token and layer (three entries of 6, or fewer)
ARGS = saved_activations.parse_args([f"--hidden={HIDDEN}", f"--heads={HEADS}", "--ffn=512",
                                     "--seq=64", "--vocab=256"])


# Every registered scheme: hyper-connections with their own allowance, below.
SCHEMES = [s.value for s in ResidualScheme if s is not ResidualScheme.HC]


@pytest.fixture(scope="module")
def kept(single_rank):
    """Bytes per token and layer, measured and estimated, for each scheme."""
    return {s: saved_activations.layer_bytes(ARGS, s) for s in SCHEMES}


@pytest.mark.parametrize("scheme", SCHEMES)
def test_estimate_accounts_for_every_kept_activation(kept, scheme):
    gap = kept[scheme]["measured"] - kept[scheme]["estimated"]
    assert 0 <= gap <= ROPE + STATS, kept[scheme]


def test_hyper_connection_estimate(single_rank):
    """Dynamic hyper-connections (4 streams): besides RoPE's terms the estimate leaves out each
    sublayer's per-token mixing coefficients and stream-norm statistics, O(n^2) values per
    token (at most 8 n (n + 2) bytes per sublayer), at a width where one missed h-sized tensor
    (1 KiB per token) is still larger than that allowance."""
    args = saved_activations.parse_args([f"--heads={HEADS}", "--hidden=512", "--ffn=1024",
                                         "--seq=64", "--vocab=256"])
    n, rope = 4, 4 * (512 // HEADS) * WIDTH
    kept = saved_activations.layer_bytes(args, "hc")
    gap = kept["measured"] - kept["estimated"]
    assert 0 <= gap <= rope + 2 * 8 * n * (n + 2) < 512 * WIDTH, kept


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
