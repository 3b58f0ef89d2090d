"""Checks of user-given paths, each failing with one line that says what the path really is.

"does not exist" is only said of a path that does not exist: a folder given where a file is
wanted (or the reverse) and an output under a regular file get their own words.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path

from runtime.errors import ConfigError, UserError

# Where `make demo` (scripts/demo.sh) writes the demo's corpus, tokenizer and data, which
# configs/demo-cpu.toml reads (relative to the repository root, where commands run).
DEMO_DATA = Path("runs/demo-data")
REPO = Path(__file__).resolve().parent.parent


def require_file(path: str | Path, what: str,
                 error: type[UserError] = ConfigError) -> Path:
    """``path`` is an existing regular file; ``what`` names it ("config file", "tokenizer")
    and ``error`` is the kind of input it is (a config file, a data file...)."""
    path = Path(path)
    if path.is_dir():
        raise error(f"{what} '{path}' is a folder, not a file")
    if not path.is_file():
        raise error(f"{what} '{path}' does not exist{missing_hint(path)}")
    return path


def missing_hint(path: Path) -> str:
    """How a missing file is usually found: a sibling that extends its name (a tokenizer
    given without ``.model``), or the command that creates the demo's files."""
    if path.parent.is_dir():
        near = sorted(path.parent.glob(glob.escape(path.name) + ".*"))
        if near:
            return f" (did you mean '{near[0]}'?)"
    absolute = Path(os.path.abspath(path))
    if DEMO_DATA in path.parents or REPO / DEMO_DATA in absolute.parents:
        return "; `make demo` (or scripts/demo.sh) creates it"
    return ""


def require_folder(path: str | Path, what: str) -> Path:
    """``path`` is an existing folder."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{what} '{path}' is a file, not a folder")
    if not path.is_dir():
        raise ConfigError(f"{what} '{path}' does not exist")
    return path


def require_creatable(path: str | Path, what: str, folder: bool = True) -> Path:
    """A folder (``folder``) or a file or output prefix (not ``folder``) that can be created
    here: no part of the way to it is a regular file, where mkdir would fail with an OS error
    far from the option that named it."""
    path = Path(path)
    for part in (path, *path.parents) if folder else path.parents:
        if part.exists():
            if not part.is_dir():
                raise ConfigError(f"{what} '{path}' cannot be created: '{part}' is a file")
            break
    return path


def require_writable(path: str | Path, what: str) -> Path:
    """A folder a command will write into, which may not exist yet: the folder, or the nearest
    existing one above it that it would be created in, accepts new files. Checked before
    anything is written, so a read-only place is one line naming it instead of an OSError
    from the middle of a start (root passes a permission check, not a read-only mount)."""
    path = require_creatable(path, what)
    existing = next((p for p in (path, *path.parents) if p.exists()), Path("."))
    if os.access(existing, os.W_OK | os.X_OK):
        return path
    reason = ("on a read-only file system" if os.statvfs(existing).f_flag & os.ST_RDONLY
              else "without write permission for this user")
    where = "" if existing == path else f" (it would be created in '{existing}')"
    raise ConfigError(f"{what} '{path}' is not writable{where}: {reason}")
