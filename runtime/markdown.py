"""Markdown the benchmarks, the lab and the docs generators share: tables, and the generated
blocks through which a page carries a table made from a results file (so the figure and its
file cannot drift apart)."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from pathlib import Path


def markdown_table(header: list[str], rows: list[list[str]], right_from: int = 1) -> str:
    """A markdown table; columns from ``right_from`` on are right-aligned (numbers)."""
    align = ["---" if i < right_from else "---:" for i in range(len(header))]
    lines = [header, align, *rows]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in lines)


def fill_blocks(text: str, tag: str, generated: dict[str, str]) -> str:
    """``text`` with the body of every ``<!-- TAG: NAME -->`` ... ``<!-- /TAG -->`` block
    replaced by ``generated[NAME]``: how a page carries a table made from a results file. A
    block no generator knows is an error (it would otherwise go stale unnoticed)."""
    pattern = re.compile(rf"(<!-- {tag}: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /{tag} -->)",
                         re.DOTALL)

    def fill(match: re.Match) -> str:
        if match["name"] not in generated:
            raise SystemExit(f"{tag}: unknown block {match['name']!r}")
        return match[1] + generated[match["name"]] + "\n" + match[4]

    return pattern.sub(fill, text)


def refresh_docs(docs: list[Path], tag: str, generated: dict[str, str], source: str,
                 write: bool) -> int:
    """Rewrite (``write``) or check the generated blocks of ``docs``: 0 if up to date or
    rewritten, else 1 with one line naming the stale pages."""
    stale = []
    for doc in docs:
        text = doc.read_text()
        new = fill_blocks(text, tag, generated)
        if new != text:
            stale.append(doc.name)
            if write:
                doc.write_text(new)
    if stale and not write:
        print(f"{tag}: out of date with {source}: {', '.join(stale)}")
        return 1
    return 0


def check_or_rewrite(argv: list[str] | None, description: str,
                     stale: Callable[[bool], list[str]], subject: str, command: str,
                     joiner: str = ", ") -> int:
    """The command line of a generator of text the docs carry inline: ``stale(write)`` names
    what is out of date (rewriting it if ``write``). Without ``--write``: 0 if nothing is, else
    1 with one line naming it and ``command``, the command that rewrites it."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--write", action="store_true", help="rewrite everything out of date")
    args = p.parse_args(argv)
    found = stale(args.write)
    if found and not args.write:
        print(f"{subject}: {joiner.join(found)}; rewrite them: {command}")
        return 1
    if found:
        print(f"rewrote {joiner.join(found)}")
    return 0
