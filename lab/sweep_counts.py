"""python -m lab.sweep_counts [--write]

The counts the sweep's prose states, written from the presets and the scheme registry: how
many cells each preset runs ("`configs/sweep/NAME.toml`: N cells" in README.md and the docs,
"# N cells" in a preset's header comment) and how many schemes "every registered scheme"
is. A grid naming ``schemes = "all"`` grows with the registry, so a new scheme changes them:
without ``--write`` this exits 1 naming every stale count and the command that rewrites them
(``tests/docs/test_scheme_lists.py`` runs this check with the scheme lists'). Only the number
is rewritten, the words around it kept.

It lives in the lab, not with ``pretrain.report.scheme_lists``: counting a preset's cells is
``lab.lr_sweep.load_preset``'s, and ``pretrain`` never imports ``lab``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from lab.lr_sweep import load_preset
from model.schemes import ResidualScheme
from runtime.markdown import check_or_rewrite

ROOT = Path(__file__).resolve().parent.parent
COMMAND = "python -m lab.sweep_counts --write"


def _cells(root: Path, name: str, match: re.Match) -> tuple[int, str]:
    """The cells of the preset the match names, else of the file holding it (a preset's
    header)."""
    preset = match.groupdict().get("preset") or name
    return len(load_preset(root / preset)[2]), f"cells of {preset}"


def _schemes(_root: Path, _name: str, _match: re.Match) -> tuple[int, str]:
    return len(ResidualScheme), "registered schemes"


COUNTS: list[tuple[str, re.Pattern, Callable[[Path, str, re.Match], tuple[int, str]]]] = [
    ("README.md docs/*.md",
     re.compile(r"`(?P<preset>configs/sweep/[\w-]+\.toml)`[^.`]*?:\s+(?P<n>\d+)\s+cells"),
     _cells),
    ("configs/sweep/*.toml", re.compile(r"\A(?:#[^\n]*\n)*?# (?P<n>\d+) cells"), _cells),
    ("README.md docs/*.md",
     re.compile(r"every\s+registered\s+scheme\s+\((?:`schemes\s+=\s+\"all\"`,\s+)?(?P<n>\d+)"),
     _schemes),
]
"""(the files, as globs under the root; the pattern whose ``n`` group is a count; the count
now and what it counts)."""


def stale(write: bool = False, root: Path = ROOT) -> list[str]:
    """Every count that differs from what it counts, as "FILE: N WHAT, not M", each file
    rewritten when ``write``."""
    found = []
    for globs, pattern, count in COUNTS:
        for path in sorted(p for glob in globs.split() for p in root.glob(glob)):
            name = path.relative_to(root).as_posix()
            text = path.read_text()
            pieces, end = [], 0
            for match in pattern.finditer(text):
                now, what = count(root, name, match)
                if int(match["n"]) != now:
                    found.append(f"{name}: {now} {what}, not {match['n']}")
                    pieces += [text[end:match.start("n")], str(now)]
                    end = match.end("n")
            if write and end:
                path.write_text("".join(pieces) + text[end:])
    return found


def main(argv: list[str] | None = None) -> int:
    return check_or_rewrite(argv, __doc__.splitlines()[0], stale,
                            "sweep counts out of date with the presets and the registry",
                            COMMAND, joiner="; ")


if __name__ == "__main__":
    raise SystemExit(main())
