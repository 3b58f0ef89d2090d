"""Why a checkpoint save failed, named so that a user can act on it ("No space left on device").

The exception a failed save ends in often no longer says why. megatron-core 0.19's filesystem
writer keeps only the *type* of a worker's error (it asserts on the worker's result and wraps
that assertion in a RuntimeError inside torch's CheckpointException), so a full disk reads as
``CheckpointException ranks:dict_keys([0])``; torch's own writer reports a short write as
``unexpected pos``, with no errno. The cause is therefore looked for in two places:

1. the exception chain: an OSError with an errno anywhere in it (our own writes, a writer that
   keeps it) is the cause, named by ``os.strerror`` and its file;
2. the target's filesystem, after the fact: a file-size limit (``ulimit -f``) smaller than a
   file of the previous checkpoint, or less free space than the previous checkpoint took.
   The partial folder is already removed by then, so free space is compared with what a
   checkpoint needs, not with zero. Quotas are not visible this way.

Otherwise the exception's first line stays the reason, with the free space beside it.
"""

from __future__ import annotations

import errno
import os
import resource
import shutil
from pathlib import Path

from runtime import weights


def save_failure(err: BaseException, root: Path) -> str:
    """One line naming why saving a checkpoint under ``root`` failed with ``err``."""
    found = os_error(err)
    if found is not None:
        return f"{os.strerror(found.errno)}: '{found.filename or root}'"
    largest, total = previous_checkpoint_sizes(root)
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if largest is not None and limit != resource.RLIM_INFINITY and limit < largest:
        return (f"{os.strerror(errno.EFBIG)}: '{root}', files are limited to {size(limit)} "
                f"(RLIMIT_FSIZE, ulimit -f) and the last checkpoint has one of {size(largest)}")
    free = free_bytes(root)
    if free is None:
        return weights.first_line(err)
    if total is not None and free < total:
        return (f"{os.strerror(errno.ENOSPC)}: '{root}', {size(free)} free where the last "
                f"checkpoint took {size(total)}")
    return f"{weights.first_line(err)}, {size(free)} free on '{root}'"


def os_error(err: BaseException) -> OSError | None:
    """The first OSError with an errno in ``err``'s chain: causes, contexts, and the
    exceptions that wrappers carry in their arguments (torch's CheckpointException holds a
    dict of rank -> (exception, traceback))."""
    pending, seen = [err], set()
    while pending:
        item = pending.pop(0)
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, OSError) and item.errno is not None:
            return item
        if isinstance(item, BaseException):
            pending += [item.__cause__, item.__context__, *item.args]
        elif isinstance(item, dict):
            pending += item.values()
        elif isinstance(item, (list, tuple)):
            pending += item
    return None


def previous_checkpoint_sizes(root: Path) -> tuple[int | None, int | None]:
    """(largest file, total bytes) of the biggest checkpoint folder under ``root``, which a
    new checkpoint of the same model needs again; (None, None) when there is none."""
    largest = total = None
    for folder in root.glob("step_*"):
        try:
            sizes = [p.stat().st_size for p in folder.rglob("*") if p.is_file()]
        except OSError:  # removed meanwhile (keep_last of another save): not evidence
            continue
        if sizes and (total is None or sum(sizes) > total):
            largest, total = max(sizes), sum(sizes)
    return largest, total


def free_bytes(path: Path) -> int | None:
    """Free bytes on the filesystem of ``path`` (or of its nearest existing parent)."""
    for folder in (path, *path.parents):
        try:
            return shutil.disk_usage(folder).free
        except OSError:
            continue
    return None


def size(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    units = ["bytes", "KiB", "MiB", "GiB", "TiB"]
    index = 0
    while n >= 1024 and index < len(units) - 1:
        n, index = n / 1024, index + 1
    return f"{n:.0f} bytes" if index == 0 else f"{n:.1f} {units[index]}"
