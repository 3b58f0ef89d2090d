"""prepare-data --shards: shards that run as separate processes (or slurm array tasks), skip
what a rerun finds complete, and merge with megatron's own merge into files byte-identical to
a single-process preparation of the same inputs, or stay a blend; one large JSON-lines file
(or fewer files than shards) is cut between lines."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from pretrain.data import prepare, shards
from pretrain.data.documents import Reading, Span, iter_documents
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


@pytest.fixture(scope="module")
def one_file(data, tmp_path_factory) -> str:
    """The session corpus's paragraphs as one file of short lines, with what a large real file
    has: a byte-order mark, blank lines, an empty text and a Windows line end."""
    texts = [json.loads(line)["text"] for line in Path(data["corpus"]).read_text().splitlines()]
    lines = [json.dumps({"text": p}) + "\n" for text in texts for p in text.split("\n\n")]
    n = len(lines)
    lines[n // 5] = lines[n // 5].replace("\n", "\r\n")
    for at in sorted((3, n // 3, n // 3 + 1, 2 * n // 3, n - 1), reverse=True):
        lines.insert(at, "\n" if at % 2 else json.dumps({"text": ""}) + "\n")
    path = tmp_path_factory.mktemp("one") / "corpus.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + "".join(lines).encode())
    return str(path)


def test_shards_are_contiguous_runs_of_whole_files_in_order(inputs):
    for count in range(1, FILES + 1):
        groups = split_inputs(inputs, count)
        assert len(groups) == count and all(groups)
        assert [path for group in groups for path in group] == inputs
    with pytest.raises(UserError, match=r"--shards \(0\) must be >= 1"):
        split_inputs(inputs, 0)


@pytest.mark.parametrize("count", [2, 3, 8])
def test_one_file_is_cut_at_the_line_starts_after_equal_parts(one_file, count):
    """Shard k reads from the first line start at or after k/N of the bytes up to the first
    at or after (k+1)/N: every byte once, in order, each part beginning a line."""
    content = Path(one_file).read_bytes()
    size = len(content)
    groups = split_inputs([one_file], count)
    assert len(groups) == count and all(len(group) == 1 for group in groups)
    spans = [group[0] for group in groups]
    assert spans[0].begin == 0 and spans[-1].end == size
    for k, span in enumerate(spans):
        assert span.path == one_file and span.begin < span.end
        if k:
            assert span.begin == spans[k - 1].end
            target = size * k // count
            assert content[span.begin - 1:span.begin] == b"\n"  # a line start
            assert b"\n" not in content[target:span.begin - 1]  # the first at or after
            assert span.begin >= target


@pytest.fixture(scope="module")
def few_files(one_file, tmp_path_factory) -> list[str]:
    """The one file cut into three by lines, for more shards than files."""
    lines = Path(one_file).read_bytes().splitlines(keepends=True)
    folder = tmp_path_factory.mktemp("few")
    paths = []
    for i, part in enumerate((lines[:10], lines[10:len(lines) // 2], lines[len(lines) // 2:])):
        paths.append(str(folder / f"part{i}.jsonl"))
        Path(paths[-1]).write_bytes(b"".join(part))
    return paths


def test_more_shards_than_files_cut_the_files_between_lines(few_files):
    groups = split_inputs(few_files, 7)
    assert len(groups) == 7 and all(groups)
    spans = [span for group in groups for span in group]
    assert [s.path for s in spans if s.begin == 0] == few_files  # each file, once, in order
    for before, after in zip(spans, spans[1:], strict=False):
        same = before.path == after.path
        assert (after.begin == before.end) if same else \
            (before.end == Path(before.path).stat().st_size and after.begin == 0)


def test_a_single_file_in_shards_merges_byte_for_byte(data, one_file, tmp_path):
    """`prepare-data ONE.jsonl --shards 3`, one array task at a time and then the merge, gives
    the files, documents and empty-line count of preparing it in one process."""
    single = prepare_data([one_file], data["tokenizer"], str(tmp_path / "single"))
    out = str(tmp_path / "sharded")
    for index in (1, 0, 2):
        done = prepare_command([one_file], data["tokenizer"], out, 1, Reading(), 3, index, False)
        assert done["documents"] > 0
    merged = prepare_command([one_file], data["tokenizer"], out, 1, Reading(), 3, None, False)
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"sharded{suffix}").read_bytes() == \
            (tmp_path / f"single{suffix}").read_bytes()
    assert single["empty_skipped"] == 5
    assert {k: merged[k] for k in ("documents", "tokens", "dtype", "empty_skipped")} == \
        {k: single[k] for k in ("documents", "tokens", "dtype", "empty_skipped")}
    record = json.loads((tmp_path / "sharded.record.json").read_text())
    expected = json.loads((tmp_path / "single.record.json").read_text())
    for key in ("tokenizer", "tokens", "documents", "min_id", "max_id", "idx_fingerprint",
                "empty_skipped"):
        assert record[key] == expected[key], key


def test_files_cut_into_more_shards_than_files_merge_byte_for_byte(data, few_files, tmp_path):
    prepare_data(few_files, data["tokenizer"], str(tmp_path / "single"))
    prepare_command(few_files, data["tokenizer"], str(tmp_path / "cut"), 1, Reading(), 7, None,
                    False)
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"cut{suffix}").read_bytes() == \
            (tmp_path / f"single{suffix}").read_bytes()


def test_a_file_that_cannot_be_cut_is_one_line(tmp_path):
    lines = tmp_path / "three.jsonl"
    lines.write_text("".join(json.dumps({"text": "x" * 200}) + "\n" for _ in range(3)))
    with pytest.raises(UserError) as info:
        split_inputs([str(lines)], 10)
    assert str(info.value) == (
        "prepare-data --shards (10) cuts the inputs every ~63 bytes, and shard 1 would begin "
        f"and end inside one line of '{lines}'; give fewer shards")
    packed = tmp_path / "corpus.jsonl.gz"
    packed.write_bytes(gzip.compress(lines.read_bytes()))
    with pytest.raises(UserError) as info:
        split_inputs([str(packed)], 2)
    assert str(info.value) == (
        "prepare-data --shards (2) is more than the input files (1), so they must be cut "
        "between lines, which only uncompressed JSON-lines files (.jsonl, .json) can be, and "
        f"'{packed}' is not one; give at most --shards 1")


def test_merged_shards_equal_one_process_byte_for_byte(data, inputs, tmp_path, monkeypatch):
    single = prepare_data(inputs, data["tokenizer"], str(tmp_path / "single"))
    out = str(tmp_path / "sharded")
    glob = str(Path(inputs[0]).parent / "part*.jsonl")
    for index in (2, 0):  # array tasks, in any order, each in its own call
        prepare_command([glob], data["tokenizer"], out, 1, Reading(), 3, index, False)
    calls = []
    real = shards.prepare_data
    monkeypatch.setattr(shards, "prepare_data", lambda *a: calls.append(a) or real(*a))
    merged = prepare_command([glob], data["tokenizer"], out, 1, Reading(), 3, None, False)
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
    summary = prepare_command(inputs, data["tokenizer"], out, 1, Reading(), 2, None, True)
    assert summary["prefixes"] == [f"{out}.shards/shard-00000", f"{out}.shards/shard-00001"]
    sizes = [Path(p + ".bin").stat().st_size // 2 for p in summary["prefixes"]]
    assert summary["weights"] == sizes and summary["tokens"] == sum(sizes)


def test_a_killed_shard_is_redone_and_an_incomplete_set_not_merged(data, inputs, tmp_path,
                                                                  monkeypatch):
    out = str(tmp_path / "k")
    prepare_command(inputs, data["tokenizer"], out, 1, Reading(), 2, 1, False)
    first = shards.shard_prefix(out, 0)
    Path(first).parent.mkdir(exist_ok=True)
    Path(first + ".bin").write_bytes(b"half")  # renamed into place, record never written
    with pytest.raises(UserError, match="1 of 2 shards are not complete"):
        shards.merge([first, shards.shard_prefix(out, 1)], out, data["tokenizer"])
    monkeypatch.setattr(prepare, "CHUNK_DOCUMENTS", 16)
    prepare_command(inputs, data["tokenizer"], out, 1, Reading(), 2, None, False)
    single = prepare_data(inputs, data["tokenizer"], str(tmp_path / "single"))
    assert Path(out + ".bin").stat().st_size == single["tokens"] * 2


def test_a_glob_that_matches_nothing_is_one_line(data, tmp_path):
    with pytest.raises(UserError) as info:
        prepare_command([str(tmp_path / "none*.jsonl")], data["tokenizer"],
                        str(tmp_path / "o"), 1, Reading(), None, None, False)
    assert str(info.value) == f"prepare-data input '{tmp_path}/none*.jsonl' matches no file"


def test_a_bad_line_in_a_later_shard_is_named_by_its_line_in_the_file(tmp_path):
    path = tmp_path / "bad.jsonl"
    lines = [json.dumps({"text": f"line {i}"}) + "\n" for i in range(1, 11)]
    lines[7] = "not json\n"
    path.write_text("".join(lines))
    begin = sum(len(line) for line in lines[:5])
    with pytest.raises(UserError) as info:
        list(iter_documents(Span(str(path), begin, path.stat().st_size)))
    assert str(info.value) == (f"data file '{path}' line 8 is not a JSON object with a string "
                               "\"text\" field")
