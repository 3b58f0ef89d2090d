"""Whether a filesystem provides ``flock``: one definition for every lock a run takes.

Lustre mounted without ``flock`` and some NFS set-ups refuse it (ENOLCK, EOPNOTSUPP, ENOSYS or
EINVAL). The run lock falls back to a lock file with a heartbeat there
(``pretrain.run.lock``); inductor's compile cache, whose own file locks fall back only on
ENOSYS, moves to a folder where locks work (``model.compiled.use_cache``); the data record is
written without its lock (``pretrain.data.record``).
"""

from __future__ import annotations

import errno
import fcntl
import tempfile
from pathlib import Path

# How flock says that this filesystem does not provide it (ENOTSUP is EOPNOTSUPP on Linux).
UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL}


def unsupported(err: OSError) -> bool:
    """Whether ``err``, raised by ``flock``, says the filesystem has none (not that it failed)."""
    return err.errno in UNSUPPORTED


def refusal(folder: Path) -> OSError | None:
    """The error ``flock`` gives in ``folder`` when its filesystem has none, else None (it
    works). Tried on an unnamed file in the folder, which leaves nothing behind."""
    with tempfile.TemporaryFile(dir=folder) as probe:
        try:
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if unsupported(err):
                return err
            raise
    return None
