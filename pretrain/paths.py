"""Checks of user-given paths, each failing with one line that says what the path really is.

"does not exist" is only said of a path that does not exist: a folder given where a file is
wanted (or the reverse) and an output under a regular file get their own words.
"""

from __future__ import annotations

from pathlib import Path

from runtime.errors import ConfigError, UserError


def require_file(path: str | Path, what: str,
                 error: type[UserError] = ConfigError) -> Path:
    """``path`` is an existing regular file; ``what`` names it ("config file", "tokenizer")
    and ``error`` is the kind of input it is (a config file, a data file...)."""
    path = Path(path)
    if path.is_dir():
        raise error(f"{what} '{path}' is a folder, not a file")
    if not path.is_file():
        raise error(f"{what} '{path}' does not exist")
    return path


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
