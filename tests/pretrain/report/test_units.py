"""Numbers in logs read as English: sizes with a suffix, counts with the right noun form."""

import pytest

from pretrain.report.units import count, human


@pytest.mark.parametrize("n,noun,text", [
    (1, "micro-batch", "1 micro-batch"), (2, "micro-batch", "2 micro-batches"),
    (1, "sequence", "1 sequence"), (16, "sequence", "16 sequences"),
    (0, "step", "0 steps"), (1200, "step", "1,200 steps"),
])
def test_count(n, noun, text):
    assert count(n, noun) == text


@pytest.mark.parametrize("n,text", [(999, "999"), (1234567, "1.23M"), (2.5e12, "2.50T")])
def test_human(n, text):
    assert human(n) == text
