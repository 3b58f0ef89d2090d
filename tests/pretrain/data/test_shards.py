"""prepare-data --shards: shards that run as separate processes (or slurm array tasks), skip
what a rerun finds complete, and merge with megatron's own merge into files byte-identical to
a single-process preparation of the same inputs, or stay a blend."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pretrain.data import prepare, shards
from pretrain.data.prepare import prepare_data
from pretrain.data.shards import prepare_command, split_inputs
from runtime.errors import UserError

FILES = 7


@pytest.fixture(scope="module")
def inputs(data, tmp_path_factory) -> list[str]:
    """The session corpus cut into files of unequal sizes."""
    folder = tmp_path_factory.mktemp("inputs")
    lines = Path(data["corpus"]).read_text().splitlines(keepends=True)
    n = len(lines)
    cuts = [0, 3, n // 4, n // 4 + 1, n // 2, 3 * n // 4, 3 * n // 4 + 2, n]
    paths = []
    for i in range(FILES):
        path = folder / f"part{i}.jsonl"
        path.write_text("".join(lines[cuts[i]:cuts[i + 1]]))
        paths.append(str(path))
    return paths


def test_shards_are_contiguous_runs_of_whole_files_in_order(inputs):
    for count in range(1, FILES + 1):
        groups = split_inputs(inputs, count)
        assert len(groups) == count and all(groups)
        assert [path for group in groups for path in group] == inputs
    with pytest.raises(UserError, match=r"--shards \(8\) must be between 1 and the number"):
        split_inputs(inputs, FILES + 1)


def test_merged_shards_equal_one_process_byte_for_byte(data, inputs, tmp_path, monkeypatch):
    single = prepare_data(inputs, data["tokenizer"], str(tmp_path / "single"))
    out = str(tmp_path / "sharded")
    glob = str(Path(inputs[0]).parent / "part*.jsonl")
    for index in (2, 0):  # array tasks, in any order, each in its own call
        prepare_command([glob], data["tokenizer"], out, 1, "text", 3, index, False)
    calls = []
    real = shards.prepare_data
    monkeypatch.setattr(shards, "prepare_data", lambda *a: calls.append(a) or real(*a))
    merged = prepare_command([glob], data["tokenizer"], out, 1, "text", 3, None, False)
    assert [Path(call[2]).name for call in calls] == ["shard-00001"]  # 0 and 2 were complete
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"sharded{suffix}").read_bytes() == \
            (tmp_path / f"single{suffix}").read_bytes()
    assert {k: merged[k] for k in ("documents", "tokens", "dtype")} == \
        {k: single[k] for k in ("documents", "tokens", "dtype")}
    record = json.loads((tmp_path / "sharded.record.json").read_text())
    expected = json.loads((tmp_path / "single.record.json").read_text())
    for key in ("tokenizer", "tokens", "documents", "min_id", "max_id", "idx_fingerprint"):
        assert record[key] == expected[key], key
    assert not (tmp_path / "sharded.shards").exists()


def test_a_blend_keeps_the_shards_with_their_sizes_as_weights(data, inputs, tmp_path):
    out = str(tmp_path / "blend")
    summary = prepare_command(inputs, data["tokenizer"], out, 1, "text", 2, None, True)
    assert summary["prefixes"] == [f"{out}.shards/shard-00000", f"{out}.shards/shard-00001"]
    sizes = [Path(p + ".bin").stat().st_size // 2 for p in summary["prefixes"]]
    assert summary["weights"] == sizes and summary["tokens"] == sum(sizes)


def test_a_killed_shard_is_redone_and_an_incomplete_set_not_merged(data, inputs, tmp_path,
                                                                  monkeypatch):
    out = str(tmp_path / "k")
    prepare_command(inputs, data["tokenizer"], out, 1, "text", 2, 1, False)
    first = shards.shard_prefix(out, 0)
    Path(first).parent.mkdir(exist_ok=True)
    Path(first + ".bin").write_bytes(b"half")  # renamed into place, record never written
    with pytest.raises(UserError, match="1 of 2 shards are not complete"):
        shards.merge([first, shards.shard_prefix(out, 1)], out, data["tokenizer"])
    monkeypatch.setattr(prepare, "CHUNK_DOCUMENTS", 16)
    prepare_command(inputs, data["tokenizer"], out, 1, "text", 2, None, False)
    single = prepare_data(inputs, data["tokenizer"], str(tmp_path / "single"))
    assert Path(out + ".bin").stat().st_size == single["tokens"] * 2


def test_a_glob_that_matches_nothing_is_one_line(data, tmp_path):
    with pytest.raises(UserError) as info:
        prepare_command([str(tmp_path / "none*.jsonl")], data["tokenizer"],
                        str(tmp_path / "o"), 1, "text", None, None, False)
    assert str(info.value) == f"prepare-data input '{tmp_path}/none*.jsonl' matches no file"
