"""A start reads each dataset once: its data checks are one pass (pretrain/data/checks.py)
that returns what it read, and what comes after them (the run's data identity, the lossy
tokenizer's allowance) takes it from there instead of opening the files again. At 100
prefixes on a network filesystem every extra read of a record or an .idx is paid 100 times
per rank at every start; these tests count them whatever state the records are in."""

from __future__ import annotations

import os
from collections import Counter

import numpy as np
import pytest

from pretrain.config import load_config
from pretrain.data import index, record
from pretrain.data.checks import check_data
from pretrain.run.identity import data_identity
from runtime.errors import DataError
from tests.pretrain.data.datasets import megatron_dataset, stub_tokenizer
from tests.pretrain_fixtures import REPO, TINY

VOCAB = 512


@pytest.fixture
def prefixes(tmp_path) -> dict[str, str]:
    """Two training prefixes and a further validation set, as Megatron-LM writes them (no
    record), each of 40 documents of 20 tokens."""
    rng = np.random.default_rng(0)
    made = {}
    for name in ("a", "b", "extra"):
        made[name] = str(tmp_path / name)
        megatron_dataset(tmp_path / name, [[rng.integers(4, VOCAB, 20).tolist()]
                                           for _ in range(40)], np.uint16)
    return made


def _config(prefixes: dict[str, str], folder):
    return load_config(str(REPO / "configs" / "demo-cpu.toml"), [
        *TINY, f"--data.prefixes={prefixes['a']},{prefixes['b']}",
        f"--data.valid_sets=extra={prefixes['extra']}:8", f"--run.dir={folder / 'run'}",
        "--data.split=50,50,0", "--data.valid_samples=8", "--run.steps=4"])


def _count_reads(monkeypatch) -> Counter:
    """Calls of what reads a dataset's files, by (what, prefix): its record, its .idx's
    fingerprint (the head and tail of the .idx), its .idx checked whole, its tokens scanned."""
    calls: Counter = Counter()

    def count(module, name: str, prefix_of) -> None:
        real = getattr(module, name)

        def counted(first, *rest):
            calls[(f"{module.__name__.rsplit('.', 1)[1]}.{name}", prefix_of(first))] += 1
            return real(first, *rest)

        monkeypatch.setattr(module, name, counted)

    count(record, "read", str)
    count(record, "fingerprint", str)
    count(index, "read", lambda path: path.removesuffix(".idx"))
    count(record, "scan", lambda tokens: tokens.filename.removesuffix(".bin"))
    return calls


@pytest.mark.parametrize("state", ["no record", "recorded", "bin copied without its time"])
def test_a_start_reads_each_dataset_once(prefixes, tmp_path, monkeypatch, state):
    """The checks and the data identity together: each .idx read and fingerprinted once,
    each record read once (twice where it is scanned: again under the lock, in case another
    rank recorded it meanwhile), each .bin scanned at most once; and the identity's
    fingerprints are the files' own."""
    config, tokenizer = _config(prefixes, tmp_path), stub_tokenizer(VOCAB)
    if state != "no record":
        check_data(config, tokenizer)
    if state == "bin copied without its time":
        for prefix in prefixes.values():
            stat = os.stat(prefix + ".bin")
            os.utime(prefix + ".bin", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    calls = _count_reads(monkeypatch)
    data = check_data(config, tokenizer)
    identity = data_identity(config, data.fingerprints)
    scanned = state != "recorded"
    for prefix in prefixes.values():
        assert calls[("index.read", prefix)] == 1, calls
        assert calls[("record.fingerprint", prefix)] == 1, calls
        assert calls[("record.read", prefix)] == (2 if scanned else 1), calls
        assert calls[("record.scan", prefix)] == (1 if scanned else 0), calls
    monkeypatch.undo()
    assert [d["fingerprint"] for d in identity["datasets"]] == [
        record.fingerprint(prefixes[name]) for name in ("a", "b")]


def test_a_lossy_tokenizers_allowance_is_read_with_the_record(prefixes, tmp_path,
                                                            monkeypatch, caplog):
    """A tokenizer that loses text is checked against the records the checks read: each
    record still read once, and the allowance it carries honoured."""
    config = _config(prefixes, tmp_path)
    check_data(config, stub_tokenizer(VOCAB))
    for prefix in prefixes.values():
        made = record.read(prefix)
        record.write(prefix, {**made, "lossy_tokenizer": True})
    lossy = stub_tokenizer(VOCAB)
    lossy.decode = lambda ids: bytes(ids).decode().replace("  ", " ")
    calls = _count_reads(monkeypatch)
    with caplog.at_level("WARNING", logger="pretrain"):
        check_data(config, lossy)
    assert [calls[("record.read", p)] for p in prefixes.values()] == [1, 1, 1], calls
    assert any("loses text" in r.getMessage() for r in caplog.records)
    record.write(prefixes["extra"], {**record.read(prefixes["extra"]), "lossy_tokenizer": False})
    with pytest.raises(DataError, match=f"and '{prefixes['extra']}' was not prepared with "
                                        "--allow-lossy-tokenizer"):
        check_data(config, lossy)
