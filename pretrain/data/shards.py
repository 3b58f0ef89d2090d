"""``prepare-data --shards N``: one corpus of many files prepared as N shards, by separate
processes or slurm array tasks, then merged into one prefix or kept as a blend.

Shard k holds a contiguous run of the inputs, in order, cut so the shards have about equal
bytes: the same inputs always give the same shards, so each array task can work out its own
(``--shard k``). With at least as many files as shards a shard is a run of whole files; with
fewer (one large file), the inputs' bytes are cut into equal parts, each moved to the next line
start, which JSON-lines files allow (one record per line; :func:`cut_lines`). A shard is an
ordinary prepared dataset, ``PREFIX.shards/shard-KKKKK``, written under temporary names and
renamed into place, its record last: a rerun skips every shard whose record exists, so a failed
or preempted array is resumed by submitting it again. The merge is megatron's own
(``IndexedDatasetBuilder.add_index``): the shards' documents concatenated in shard order, which
is the inputs' order, so the merged files are byte for byte those a single process writes from
the same inputs. The shards are removed once the merge is in place. With ``--blend`` they stay,
and the summary gives them as data.prefixes with their token counts as data.weights (a blend
that reads each shard in proportion to its size).
"""

from __future__ import annotations

import glob
import os
import shutil
from pathlib import Path

import numpy as np
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

from pretrain.data import record
from pretrain.data.documents import BY_DEFAULT, Reading, Span, can_cut, require_data_input
from pretrain.data.prepare import prepare_data
from pretrain.data.tokenizer import open_tokenizer
from pretrain.paths import require_creatable
from runtime.errors import ConfigError, DataError

GLOB_CHARACTERS = "*?["
# Bytes read at a time looking for the end of a line.
LINE_BLOCK = 1 << 16


def expand_inputs(inputs: list[str]) -> list[str]:
    """The inputs with every glob pattern replaced by the files it matches, sorted (the shell
    does the same to an unquoted one); a pattern that matches nothing is refused."""
    files = []
    for item in inputs:
        if any(c in item for c in GLOB_CHARACTERS) and not Path(item).exists():
            matched = sorted(glob.glob(item))
            if not matched:
                raise ConfigError(f"prepare-data input '{item}' matches no file")
            files.extend(matched)
        else:
            files.append(item)
    return files


def split_inputs(inputs: list[str], shards: int) -> list[list[str | Span]]:
    """``shards`` contiguous runs of ``inputs`` of about equal bytes, none empty: runs of whole
    files, or with fewer files than shards, runs of lines (:func:`cut_lines`)."""
    if shards < 1:
        raise ConfigError(f"prepare-data --shards ({shards}) must be >= 1")
    if shards > len(inputs):
        return cut_lines(inputs, shards)
    sizes = np.array([_size(path) for path in inputs], dtype=np.float64)
    ends = np.cumsum(sizes)
    groups, first = [], 0
    for k in range(1, shards + 1):
        # the first index whose running total reaches k/shards of the bytes, leaving at least
        # one file for each shard still to come
        last = int(np.searchsorted(ends, ends[-1] * k / shards)) + 1
        last = min(max(last, first + 1), len(inputs) - (shards - k))
        last = len(inputs) if k == shards else last
        groups.append(inputs[first:last])
        first = last
    return groups


def cut_lines(inputs: list[str], shards: int) -> list[list[Span]]:
    """The inputs' bytes, one stream in order, cut into ``shards`` parts of about equal size:
    shard k reads from the first line start at or after byte k/shards of the stream up to the
    first line start at or after byte (k+1)/shards. Every line is read by exactly one shard,
    in order, so the shards' documents, concatenated, are the inputs' documents."""
    for path in inputs:
        require_data_input(path)
    uncut = [path for path in inputs if not can_cut(path)]
    if uncut:
        raise ConfigError(f"prepare-data --shards ({shards}) is more than the input files "
                          f"({len(inputs)}), so they must be cut between lines, which only "
                          f"uncompressed JSON-lines files (.jsonl, .json) can be, and "
                          f"'{uncut[0]}' is not one; give at most --shards {len(inputs)}")
    sizes = [os.path.getsize(path) for path in inputs]
    starts = np.cumsum([0, *sizes])  # where each file begins in the stream
    total = int(starts[-1])
    cuts = [(0, 0)]  # (file, offset): where each shard begins, then the end
    for k in range(1, shards):
        at = total * k // shards
        i = int(np.searchsorted(starts, at, side="right")) - 1
        cuts.append((i, line_start(inputs[i], at - int(starts[i]))))
    cuts.append((len(inputs) - 1, sizes[-1]))
    groups = []
    for k, ((first, begin), (last, end)) in enumerate(zip(cuts, cuts[1:], strict=False)):
        spans = [Span(inputs[i], begin if i == first else 0, end if i == last else sizes[i])
                 for i in range(first, last + 1)]
        spans = [span for span in spans if span.end > span.begin]
        if not spans:
            raise ConfigError(f"prepare-data --shards ({shards}) cuts the inputs every "
                              f"~{total // shards:,} bytes, and shard {k} would begin and end "
                              f"inside one line of '{inputs[first]}'; give fewer shards")
        groups.append(spans)
    return groups


def line_start(path: str, offset: int) -> int:
    """The first line start at or after byte ``offset`` of ``path`` (its size if none is)."""
    if offset == 0:
        return 0
    with open(path, "rb") as f:
        f.seek(offset - 1)  # offset is a line start when the byte before it ends a line
        while block := f.read(LINE_BLOCK):
            newline = block.find(b"\n")
            if newline >= 0:
                return f.tell() - len(block) + newline + 1
        return f.tell()


def _size(path: str) -> int:
    source = Path(path)
    if source.is_dir():
        return sum(f.stat().st_size for f in source.rglob("*") if f.is_file())
    return source.stat().st_size if source.exists() else 0


def shard_prefix(output_prefix: str, index: int) -> str:
    return f"{output_prefix}.shards/shard-{index:05d}"


def _done(prefix: str) -> bool:
    """A shard is complete once its record exists (written after its files are in place)."""
    return record.path_of(prefix).exists()


def prepare_shard(inputs: list[str], tokenizer_model: str, output_prefix: str, shards: int,
                  index: int, workers: int = 1, reading: Reading = BY_DEFAULT,
                  allow_lossy: bool = False) -> dict:
    """Prepare shard ``index`` of ``shards`` (skipped if complete)."""
    if not 0 <= index < shards:
        raise ConfigError(f"prepare-data --shard ({index}) must be between 0 and --shards - 1 "
                          f"({shards - 1})")
    groups = split_inputs(inputs, shards)
    prefix = shard_prefix(output_prefix, index)
    if _done(prefix):
        return {"shard": index, "prefix": prefix, "skipped": "complete"}
    for suffix in (".bin", ".idx"):  # a shard killed after its rename, before its record
        Path(prefix + suffix).unlink(missing_ok=True)
    return {"shard": index, **prepare_data(groups[index], tokenizer_model, prefix, workers,
                                           reading, allow_lossy)}


def prepare_sharded(inputs: list[str], tokenizer_model: str, output_prefix: str, shards: int,
                    workers: int = 1, reading: Reading = BY_DEFAULT,
                    blend: bool = False, allow_lossy: bool = False) -> dict:
    """Every shard not yet complete, then the merge (or, ``blend``, the blend's summary)."""
    require_creatable(output_prefix, "prepare-data --output", folder=False)
    final = [Path(f"{output_prefix}{s}") for s in (".bin", ".idx")]
    if not blend and any(p.exists() for p in final):
        raise ConfigError(f"dataset file '{next(p for p in final if p.exists())}' already "
                          "exists; choose another --output")
    for index in range(shards):
        prepare_shard(inputs, tokenizer_model, output_prefix, shards, index, workers,
                      reading, allow_lossy)
    prefixes = [shard_prefix(output_prefix, k) for k in range(shards)]
    if blend:
        records = [record.read(p) for p in prefixes]
        tokens = [r["tokens"] for r in records]
        return {"prefixes": prefixes, "weights": tokens, "tokens": sum(tokens),
                "documents": sum(r["documents"] for r in records),
                "empty_skipped": sum(r.get("empty_skipped", 0) for r in records)}
    return merge(prefixes, output_prefix, tokenizer_model)


def merge(prefixes: list[str], output_prefix: str, tokenizer_model: str) -> dict:
    """megatron's merge of complete shards into ``output_prefix`` (temporary names, renamed
    into place), its record made from theirs (no token is read twice), then the shards go."""
    missing = [p for p in prefixes if not _done(p)]
    if missing:
        raise DataError(f"prepare-data cannot merge: {len(missing)} of {len(prefixes)} shards "
                        f"are not complete (first: '{missing[0]}'); run them first")
    records = [record.read(p) for p in prefixes]
    tokenizer = open_tokenizer(tokenizer_model)
    wanted = tokenizer.unique_identifiers["model_sha256"]
    for prefix, made in zip(prefixes, records, strict=True):
        made_by = made["tokenizer"] or {"path": "unknown", "sha256": "?"}
        if made_by["sha256"] != wanted:
            raise DataError(f"shard '{prefix}' was made with tokenizer '{made_by['path']}' "
                            f"#{made_by['sha256'][:8]}, not --tokenizer '{tokenizer_model}' "
                            f"#{wanted[:8]}; delete the shard folder and prepare again")
    dtype = IndexedDataset(prefixes[0]).index.dtype
    tmp_bin, tmp_idx = (Path(f"{output_prefix}{s}.tmp{os.getpid()}") for s in (".bin", ".idx"))
    try:
        builder = IndexedDatasetBuilder(str(tmp_bin), dtype=dtype)
        for prefix in prefixes:
            builder.add_index(prefix)
        builder.finalize(str(tmp_idx))
        for tmp, suffix in ((tmp_bin, ".bin"), (tmp_idx, ".idx")):
            if Path(output_prefix + suffix).exists():
                raise ConfigError(f"dataset file '{output_prefix}{suffix}' already exists; "
                                  "choose another --output")
            os.replace(tmp, output_prefix + suffix)
    finally:
        tmp_bin.unlink(missing_ok=True)
        tmp_idx.unlink(missing_ok=True)
    tokens = sum(r["tokens"] for r in records)
    documents = sum(r["documents"] for r in records)
    ids = (min(r["min_id"] for r in records), max(r["max_id"] for r in records))
    empty = sum(r.get("empty_skipped", 0) for r in records)  # 0: a shard made before it counted
    kept = {"lossy_tokenizer": True} if any(r.get("lossy_tokenizer") for r in records) else {}
    made = record.make(output_prefix, tokens, documents, ids, tokenizer)
    record.write(output_prefix, {**made, "empty_skipped": empty, **kept})
    shutil.rmtree(Path(prefixes[0]).parent)
    return {"documents": documents, "tokens": tokens, "dtype": np.dtype(dtype).name,
            "prefix": output_prefix, "empty_skipped": empty}


def prepare_command(inputs: list[str], tokenizer_model: str, output_prefix: str, workers: int,
                    reading: Reading, shards: int | None, shard: int | None,
                    blend: bool, allow_lossy: bool = False) -> dict:
    """``prepare-data``: one process (no ``--shards``), one shard (``--shard``), or every
    shard still to do and then the merge or the blend."""
    inputs = expand_inputs(inputs)
    if shards is None:
        if shard is not None or blend:
            raise ConfigError("prepare-data --shard and --blend need --shards")
        return prepare_data(inputs, tokenizer_model, output_prefix, workers, reading,
                            allow_lossy)
    if shard is not None:
        return prepare_shard(inputs, tokenizer_model, output_prefix, shards, shard, workers,
                             reading, allow_lossy)
    return prepare_sharded(inputs, tokenizer_model, output_prefix, shards, workers,
                           reading, blend, allow_lossy)
