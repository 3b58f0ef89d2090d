"""Fixtures shared by the data tests."""

import pytest

from pretrain.data import record


@pytest.fixture
def scans(monkeypatch) -> list[int]:
    """The number of tokens each scan of a .bin read."""
    counted, real = [], record.scan

    def counting(tokens):
        counted.append(len(tokens))
        return real(tokens)

    monkeypatch.setattr(record, "scan", counting)
    return counted
