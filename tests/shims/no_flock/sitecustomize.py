"""Loaded at the start of a CLI child whose PYTHONPATH holds this folder: ``flock`` refuses
(ENOLCK, as on Lustre mounted without it) every file under $NO_FLOCK_UNDER and works
elsewhere, whoever calls it (the run lock, the data record, inductor's cache through
filelock)."""

import errno
import fcntl
import os

_flock = fcntl.flock
_UNDER = os.path.realpath(os.environ["NO_FLOCK_UNDER"]) + os.sep


def _refusing(fd, operation):
    number = fd if isinstance(fd, int) else fd.fileno()
    if os.path.realpath(f"/proc/self/fd/{number}").startswith(_UNDER):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))
    return _flock(fd, operation)


fcntl.flock = _refusing
