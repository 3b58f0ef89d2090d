"""The lists of residual schemes that files must carry, written from the registry.

    python -m pretrain.report.scheme_lists [--write]

Some files cannot ask ``ResidualScheme`` (``model/schemes.py``) what the schemes are: the
Hugging Face remote code imports only torch and transformers, and an exported folder takes it
along. Each such list is a generated block between two marker lines,
``# <generated: NAME> ...`` and ``# </generated>``, that this module writes from the registry
and its traits. Without ``--write`` it checks them, and names every stale file at once with
the command that rewrites them (``tests/docs/test_scheme_lists.py`` runs the check): a new
scheme, or a changed trait, is one command away from every list.
"""

from __future__ import annotations

import argparse
import re
import textwrap
from collections.abc import Callable
from pathlib import Path

from model.schemes import ResidualScheme

ROOT = Path(__file__).resolve().parents[2]
COMMAND = "python -m pretrain.report.scheme_lists --write"
BLOCK = re.compile(r"(?P<begin># <generated: (?P<name>[\w-]+)>[^\n]*\n)(?P<body>.*?)"
                   r"(?P<end>[ \t]*# </generated>)", re.DOTALL)


def _tuple(name: str, values: list[str]) -> str:
    """``name = ("a", "b", ...)`` wrapped at 100 columns."""
    body = ", ".join(f'"{v}"' for v in values)
    lines = textwrap.wrap(f"{name} = ({body})", width=100, subsequent_indent=" " * (len(name) + 4),
                          break_long_words=False, break_on_hyphens=False)
    return "\n".join(lines)


def remote_schemes() -> str:
    """The remote configuration's schemes and, per scheme, the modules kept in fp32."""
    fp32 = {s.value: s.traits.fp32 for s in ResidualScheme if s.traits.fp32}
    entries = "".join(f"    {scheme!r}: {modules!r},\n".replace("'", '"')
                      for scheme, modules in fp32.items())
    return (_tuple("SCHEMES", [s.value for s in ResidualScheme]) + "\n"
            '"""The residual schemes this code builds (``ResidualScheme``, in its order)."""\n'
            f"FP32_MODULES = {{\n{entries}}}\n"
            '"""Per scheme, the modules that compute in fp32 (``Traits.fp32``): their weights '
            "stay fp32\nwhen a model loads in bf16 or fp16 "
            '(``_keep_in_fp32_modules_strict``)."""\n')


GENERATORS: dict[str, Callable[[], str]] = {
    "remote-schemes": remote_schemes,
}
"""Each block's text, by name."""

FILES = ("pretrain/hf/remote/configuration_siamesenorm.py",)
"""The files holding generated blocks."""


def fill(text: str, where: str) -> str:
    """``text`` with every generated block rewritten; SystemExit for a block of no known
    name (it would otherwise go stale unnoticed)."""
    def body(match: re.Match) -> str:
        if match["name"] not in GENERATORS:
            raise SystemExit(f"{where}: generated block {match['name']!r} has no generator "
                             "in pretrain/report/scheme_lists.py")
        return match["begin"] + GENERATORS[match["name"]]() + match["end"]

    return BLOCK.sub(body, text)


def stale(write: bool = False, root: Path = ROOT) -> list[str]:
    """The files (relative to ``root``) whose blocks differ from the registry's, rewritten
    when ``write``; a listed file without a block is stale too."""
    found = []
    for name in FILES:
        path = root / name
        text = path.read_text()
        new = fill(text, name)
        if new != text or not BLOCK.search(text):
            found.append(name)
            if write and new != text:
                path.write_text(new)
    return found


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--write", action="store_true", help="rewrite every stale list")
    args = p.parse_args(argv)
    found = stale(args.write)
    if found and not args.write:
        print(f"scheme lists out of date with model/schemes.py: {', '.join(found)}; "
              f"rewrite them: {COMMAND}")
        return 1
    if found:
        print(f"rewrote {', '.join(found)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
