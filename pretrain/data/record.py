"""A dataset's record: ``PREFIX.record.json`` beside ``PREFIX.bin``/``.idx``.

It says which tokenizer made the dataset (its content hash, path and vocabulary size, as a
checkpoint records its own) and the lowest and highest token id in the ``.bin``, for the files
it was made for (sizes and modification times of both, and :func:`fingerprint` of the
``.idx``). A start then checks the vocabulary by reading one small file instead of every token
of the corpus, which at 100B tokens would be minutes per node at every start.

``prepare-data`` writes it. A dataset made elsewhere (Megatron-LM's preprocessing, an older
version of this framework) has none: the first start scans its tokens once and records the
result without a tokenizer, so later starts are as fast and the tokenizer stays unknown.

Every start compares the record with the files: the ``.bin``'s size and time, and the
``.idx``'s fingerprint (at most 2 MiB read, so its contents are compared even where a copy
kept the times). The record holds when both agree. Otherwise:

- a ``.idx`` with other contents beside an unchanged ``.bin`` is refused: the pair no longer
  belongs together (another dataset's index, a restored or half-copied file), and the counts
  and ids the record gives could be another dataset's; the refusal says what changed and the
  fix (prepare again, or delete the record when the change was deliberate);
- a ``.bin`` with another time (or size) and the same ``.idx`` is scanned again and keeps its
  tokenizer (a copy without ``-p``);
- both changed (another dataset under the same name): one warning saying what changed, a scan,
  and the tokenizer is no longer known.

A record that cannot be read is refused, naming it, rather than guessed around. The ids a
record gives are checked again where batches are read (:mod:`pretrain.data.batch_ids`): a
``.bin`` rewritten in place with its time kept is not seen here.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from runtime import flock
from runtime.errors import DataError

log = logging.getLogger("pretrain")

SUFFIX = ".record.json"
VERSION = 1
# Token ids scanned at once: bounded memory on arbitrarily large files.
SCAN_TOKENS = 1 << 26
# The head and tail of the .idx that identify it (its header and the document table).
FINGERPRINT_BYTES = 1 << 20


def path_of(prefix: str) -> Path:
    return Path(prefix + SUFFIX)


def fingerprint(prefix: str) -> str:
    """A short content hash of a dataset: the sizes of .bin and .idx and the head and tail of
    the .idx (its header and the document table). Cheap for any corpus size, and different
    for any other tokenisation or document set in practice. Every start compares it with the
    record's, so changing how it is computed needs a new VERSION (old records would otherwise
    be refused as another dataset's index)."""
    digest = hashlib.sha256()
    idx = prefix + ".idx"
    size = os.path.getsize(idx)
    digest.update(f"{os.path.getsize(prefix + '.bin')}:{size}".encode())
    with open(idx, "rb") as f:
        digest.update(f.read(FINGERPRINT_BYTES))
        f.seek(max(0, size - FINGERPRINT_BYTES))
        digest.update(f.read(FINGERPRINT_BYTES))
    return digest.hexdigest()[:16]


def file_state(prefix: str) -> dict[str, list[int]]:
    """[size, mtime_ns] of the .bin and the .idx: what a record is valid for."""
    state = {}
    for suffix in ("bin", "idx"):
        stat = os.stat(f"{prefix}.{suffix}")
        state[suffix] = [stat.st_size, stat.st_mtime_ns]
    return state


class Files(NamedTuple):
    """What a record is valid for, read from the files once per start: [size, mtime_ns] of
    the .bin and the .idx (:func:`file_state`) and the .idx's :func:`fingerprint`."""

    state: dict[str, list[int]]
    fingerprint: str


def files_of(prefix: str) -> Files:
    return Files(file_state(prefix), fingerprint(prefix))


def tokenizer_entry(tokenizer) -> dict[str, Any]:
    return {"path": tokenizer.path, "sha256": tokenizer.unique_identifiers["model_sha256"],
            "vocab_size": tokenizer.vocab_size}


def scan(tokens: np.ndarray) -> tuple[int, int]:
    """(lowest, highest) token id, a bounded chunk at a time."""
    lowest, highest = None, None
    for start in range(0, len(tokens), SCAN_TOKENS):
        chunk = tokens[start:start + SCAN_TOKENS]
        low, high = int(chunk.min()), int(chunk.max())
        lowest = low if lowest is None else min(lowest, low)
        highest = high if highest is None else max(highest, high)
    return (lowest or 0), (highest or 0)


def make(prefix: str, tokens: int, documents: int, ids: tuple[int, int],
         tokenizer=None, files: Files | None = None) -> dict[str, Any]:
    """The record of ``prefix`` as its files are now (``files``, when already read): ``ids``
    is (lowest, highest), the tokenizer (None: unknown) made it."""
    lowest, highest = ids
    files = files or files_of(prefix)
    return {"version": VERSION,
            "tokenizer": tokenizer_entry(tokenizer) if tokenizer is not None else None,
            "tokens": int(tokens), "documents": int(documents),
            "min_id": int(lowest), "max_id": int(highest),
            "files": files.state, "idx_fingerprint": files.fingerprint}


def write(prefix: str, record: dict[str, Any]) -> None:
    """Atomically: a reader sees the old record or the new one, never half of one."""
    path = path_of(prefix)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(json.dumps(record, indent=1) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def read(prefix: str) -> dict[str, Any] | None:
    """The record of ``prefix``, None if it has none; a damaged one is refused."""
    path = path_of(prefix)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        record = json.loads(text)
        valid = (record["version"] == VERSION
                 and all(isinstance(record[k], int) for k in ("tokens", "documents", "min_id",
                                                                "max_id"))
                 and set(record["files"]) == {"bin", "idx"}
                 and isinstance(record["idx_fingerprint"], str)
                 and (record["tokenizer"] is None or isinstance(record["tokenizer"]["sha256"],
                                                                  str)))
    except (ValueError, KeyError, TypeError):
        valid = False
    if not valid:
        raise DataError(f"data record '{path}' is damaged (not a version {VERSION} record); "
                        "delete it and the next start scans the dataset again")
    return record


@contextmanager
def _exclusive(prefix: str):
    """One process at a time scans and records ``prefix`` (a job's ranks start together):
    a lock on its .idx, which needs no write access and leaves no file behind. Where the
    filesystem has no flock the ranks scan without it: each writes the same record, and
    atomically, so the lock only saves work."""
    with open(prefix + ".idx", "rb") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError as err:
            if not flock.unsupported(err):
                raise
        yield


class Change(NamedTuple):
    """How the files of a prefix differ from its record."""

    bin: bool  # the .bin's size or modification time is not the recorded one
    index: bool  # the .idx's fingerprint is not the recorded one


def compare(stored: dict[str, Any], files: Files) -> Change:
    return Change(stored["files"]["bin"] != files.state["bin"],
                  stored["idx_fingerprint"] != files.fingerprint)


def _trusted(stored: dict[str, Any] | None, prefix: str, files: Files, tokens: int,
             documents: int) -> bool:
    """Whether ``stored`` describes ``prefix`` now (``files``: what its files are;
    ``tokens`` and ``documents``: its .idx's counts). An index changed under an unchanged .bin
    is refused: the pair no longer belongs together, and nothing the record says can be
    trusted for it."""
    if stored is None:
        return False
    change = compare(stored, files)
    if change.index and not change.bin:
        path = path_of(prefix)
        raise DataError(
            f"data prefix '{prefix}': '{prefix}.idx' is not the index its record '{path}' was "
            f"made with ({_index_change(stored, tokens, documents)}) while '{prefix}.bin' is "
            "unchanged (the recorded size and time): the index belongs to other data; prepare "
            f"the data again, or, if the change was deliberate, delete '{path}' and the next "
            "start scans the dataset again")
    return not (change.bin or change.index)


def _index_change(stored: dict[str, Any], tokens: int, documents: int) -> str:
    """What differs in an index from its record: the counts first, else only the contents."""
    counts = [(documents, stored["documents"], "documents"), (tokens, stored["tokens"], "tokens")]
    changed = [f"{now:,} {what}, recorded {then:,}" for now, then, what in counts if now != then]
    if changed:
        return "; ".join(changed)
    return f"the same {documents:,} documents and {tokens:,} tokens, other contents"


def _bin_change(stored: dict[str, Any], files: Files) -> str:
    (size, _), (then, _) = files.state["bin"], stored["files"]["bin"]
    return f"{size:,} bytes, recorded {then:,}" if size != then else "another modification time"


KEPT_ON_RESCAN = ("tokenizer", "lossy_tokenizer", "empty_skipped")
"""What a fresh scan keeps of the record it replaces when the index is the recorded one (the
same tokenisation): the tokenizer that made it and what its preparation allowed or skipped
(``pretrain.data.prepare``); a scan reads ids, it cannot tell any of them."""


def _kept(stored: dict[str, Any] | None, prefix: str, files: Files, tokens: int,
          documents: int) -> dict[str, Any]:
    """What a fresh scan of ``prefix`` keeps from the record ``stored`` it replaces
    (:data:`KEPT_ON_RESCAN`; the tokenizer None when unknown), saying why it scans."""
    if stored is None:
        log.info("data prefix %s has no record (%s): scanning its %s tokens once",
                 prefix, SUFFIX, f"{tokens:,}")
        return {"tokenizer": None}
    if not compare(stored, files).index:
        log.info("data record %s: %s.bin has %s, %s.idx the recorded contents; scanning its "
                 "%s tokens again", path_of(prefix), prefix, _bin_change(stored, files),
                 prefix, f"{tokens:,}")
        return {key: stored[key] for key in KEPT_ON_RESCAN if key in stored}
    log.warning("data prefix %s changed since its record %s: %s.idx (%s) and %s.bin (%s); "
                "scanning its %s tokens again, the tokenizer that made it is no longer known",
                prefix, path_of(prefix), prefix, _index_change(stored, tokens, documents),
                prefix, _bin_change(stored, files), f"{tokens:,}")
    return {"tokenizer": None}


def current(prefix: str, tokens: np.ndarray, documents: int) -> dict[str, Any]:
    """The record describing ``prefix`` now: the stored one when its files are unchanged,
    else a fresh scan, recorded for the next start where the folder is writable (the module's
    docstring: which changes are refused, warned of or scanned quietly). The files' sizes,
    times and fingerprint are read once, whichever way it goes; its ``idx_fingerprint`` is
    the .idx's now."""
    count, stored, files = len(tokens), read(prefix), files_of(prefix)
    if _trusted(stored, prefix, files, count, documents):
        return stored
    with _exclusive(prefix):
        stored = read(prefix)  # another rank may have recorded it while this one waited
        if _trusted(stored, prefix, files, count, documents):
            return stored
        kept = _kept(stored, prefix, files, count, documents)
        fresh = {**make(prefix, count, documents, scan(tokens), files=files), **kept}
        try:
            write(prefix, fresh)
        except OSError:
            log.info("data record %s cannot be written (a read-only folder): every start "
                     "scans %s again", path_of(prefix), prefix)
        return fresh
