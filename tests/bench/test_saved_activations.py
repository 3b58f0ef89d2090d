"""What each residual scheme's layer keeps for backward, counted tensor by tensor on the real
model (Triton norms, interpreted on a CPU machine), against the dry run's per-layer estimate.

The estimate (``pretrain.report.dry_run``) is derived from the code's design, tensor by tensor,
a scheme's own share declared with it (``Traits.stream_values``, ``Traits.token_bytes``); the
count comes from autograd's saved-tensor hooks (``bench.saved_activations``), so a module that
starts keeping one more activation, or a kernel that stops keeping one, shows here.
"""

from __future__ import annotations

import pytest

from bench import saved_activations
from model.config import ModelConfig
from model.schemes import ResidualScheme

pytestmark = pytest.mark.slow

HIDDEN, HEADS = 256, 16
WIDTH = 2  # bf16
ARGS = saved_activations.parse_args([f"--hidden={HIDDEN}", f"--heads={HEADS}", "--ffn=512",
                                     "--seq=64", "--vocab=256"])
SCHEMES = [s.value for s in ResidualScheme]
# Bytes per token and layer the count and the estimate may differ by: none. The count adds
# up whole storages, and its share per token is the growth between two token counts
# (bench.saved_activations), so nothing is rounded and what a layer keeps once (mHC's fp32
# gate vectors, 192 B per layer at n = 4) drops out; every per-token term of the estimate is
# an integer number of bytes. So one value per token kept and not counted, even a single bf16
# scalar per token (2 B), fails.
ROUNDING = 0


@pytest.fixture(scope="module")
def kept(single_rank):
    """Bytes per token and layer, measured and estimated, for each scheme."""
    return {s: saved_activations.layer_bytes(ARGS, s) for s in SCHEMES}


@pytest.mark.parametrize("scheme", SCHEMES)
def test_estimate_accounts_for_every_kept_activation(kept, scheme):
    """Every registered scheme: what autograd keeps per token and layer equals the dry run's
    estimate, a scheme's own per-token tensors (norm statistics, gates, mixing weights)
    included, so a tensor kept and not counted (or counted and not kept) fails here, naming
    the scheme and the bytes."""
    gap = kept[scheme]["measured"] - kept[scheme]["estimated"]
    assert abs(gap) <= ROUNDING, (
        f"{scheme}: a layer keeps {kept[scheme]['measured']:.0f} bytes per token for backward, "
        f"the dry run estimates {kept[scheme]['estimated']:.0f} ({gap:+.0f}): declare the "
        f"scheme's per-token tensors in its Traits.token_bytes (h-sized ones in "
        f"stream_values)")


def test_second_stream_costs_one_value_per_token_and_layer(kept):
    """Each sublayer entry reads x and y where Pre-Norm reads one h, but the MLP entry keeps only
    the attention output r (the updated streams and u are recomputed from the layer input,
    which the attention entry keeps): SiameseNorm keeps h more per layer than Pre-Norm, the
    hybrid form 2h more than HybridNorm (whose attention has no norm in front to keep an
    input; the channel gate keeps x itself, no fp32 copy), each besides its norms'
    statistics (``Traits.token_bytes``)."""
    h = HIDDEN * WIDTH

    def stats(scheme: str) -> int:
        return ResidualScheme(scheme).traits.token_bytes(ModelConfig(residual_scheme=scheme),
                                                          WIDTH)

    extra = kept["siamese"]["measured"] - kept["pre"]["measured"]
    extra_hybrid = kept["siamese_hybrid"]["measured"] - kept["hybridnorm"]["measured"]
    assert extra == h + stats("siamese") - stats("pre"), extra
    assert extra_hybrid == 2 * h + stats("siamese_hybrid") - stats("hybridnorm"), extra_hybrid
