"""The lists of residual schemes that files must carry, written from the registry.

    python -m pretrain.report.scheme_lists [--write]

Some files cannot ask ``ResidualScheme`` (``model/schemes.py``) what the schemes are: the
Hugging Face remote code imports only torch and transformers (an exported folder takes it
along), ``model/layers/__init__.py`` must import each scheme's file by name, and a page's
shell loop or sentence is text. Each such list is written here from the registry and its
traits, in one of two ways: a generated block between two marker lines (``# <generated:
NAME> ...`` and ``# </generated>``, Python files), or a list found in the text by its
pattern (:data:`INLINE`: the paper's presets sentence, the submission loops), whose paragraph
is re-wrapped when it changes. Without ``--write`` it checks them all and names every stale
file at once with the command that rewrites them (``tests/docs/test_scheme_lists.py`` runs
the check): a new scheme, or a changed trait, is one command away from every list.
"""

from __future__ import annotations

import importlib.util
import re
import textwrap
from collections.abc import Callable
from pathlib import Path

from kernels import normalizations
from model.schemes import EXPERT_FP32, ResidualScheme
from runtime.markdown import check_or_rewrite

ROOT = Path(__file__).resolve().parents[2]
COMMAND = "python -m pretrain.report.scheme_lists --write"
BLOCK = re.compile(r"(?P<begin># <generated: (?P<name>[\w-]+)>[^\n]*\n)(?P<body>.*?)"
                   r"(?P<end>[ \t]*# </generated>)", re.DOTALL)


def _tuple(name: str, values: list[str]) -> str:
    """``name = ("a", "b", ...)`` wrapped at 100 columns (``("a",)`` for one value)."""
    body = ", ".join(f'"{v}"' for v in values) + ("," if len(values) == 1 else "")
    lines = textwrap.wrap(f"{name} = ({body})", width=100, subsequent_indent=" " * (len(name) + 4),
                          break_long_words=False, break_on_hyphens=False)
    return "\n".join(lines)


def remote_schemes() -> str:
    """The remote configuration's schemes, normalizations and, per scheme (and in every MoE
    block), the modules kept in fp32."""
    fp32 = {s.value: s.traits.fp32 for s in ResidualScheme if s.traits.fp32}
    entries = "".join(f"    {scheme!r}: {modules!r},\n".replace("'", '"')
                      for scheme, modules in fp32.items())
    ends = "".join(f'    "{s.value}": "{s.traits.final.value}",\n' for s in ResidualScheme)
    return (_tuple("SCHEMES", [s.value for s in ResidualScheme]) + "\n"
            '"""The residual schemes this code builds (``ResidualScheme``, in its order)."""\n'
            + _tuple("NORMALIZATIONS", list(normalizations.KINDS)) + "\n"
            '"""The normalizations ``modeling_siamesenorm.Norm`` computes (the registered '
            'kinds,\n``kernels.normalizations``)."""\n'
            f"FINAL_NORMS = {{\n{ends}}}\n"
            '"""What closes each scheme\'s decoder (``Traits.final``, ``FinalNorm``): '
            '"norm", "none", "merge"\n(SiameseNorm\'s), or "scheme", its own."""\n'
            f"FP32_MODULES = {{\n{entries}}}\n"
            '"""Per scheme, the modules that compute in fp32 (``Traits.fp32``): their weights '
            "stay fp32\nwhen a model loads in bf16 or fp16 "
            '(``_keep_in_fp32_modules_strict``)."""\n'
            + _tuple("EXPERT_FP32_MODULES", list(EXPERT_FP32)) + "\n"
            '"""The modules of every scheme\'s MoE blocks that compute in fp32 (``EXPERT_FP32``),'
            '\nkept in fp32 in a model with experts as ``FP32_MODULES`` are."""\n')


def layer_files() -> str:
    """``model/layers/__init__.py``'s imports of every scheme's file and ``SCHEME_FILES``."""
    names = sorted(s.value for s in ResidualScheme)
    imports = "".join(f"    {name},\n" for name in names)
    entries = "".join(f"    ResidualScheme.{s.name}: {s.value},\n" for s in ResidualScheme)
    return (f"from model.layers import (\n{imports})\n"
            "from model.schemes import ResidualScheme\n\n"
            f"SCHEME_FILES: dict[ResidualScheme, ModuleType] = {{\n{entries}}}\n")


GENERATORS: dict[str, Callable[[], str]] = {
    "remote-schemes": remote_schemes,
    "layer-files": layer_files,
}
"""Each block's text, by name."""


def _paper_presets() -> dict[str, str]:
    """configs/paper/generate.py's presets (a script, loaded from its file)."""
    spec = importlib.util.spec_from_file_location("paper_presets",
                                                  ROOT / "configs" / "paper" / "generate.py")
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    return generate.presets()


def _loop(_match: re.Match) -> str:
    return f"for scheme in {' '.join(s.value for s in ResidualScheme)}; do"


def _presets_sentence(_match: re.Match) -> str:
    presets = _paper_presets()
    per_scheme = sum(1 for name in presets if Path(name).stem.split("-")[0] == "pre")
    names = ", ".join(f"`{s.value}`" for s in ResidualScheme)
    return (f"for every residual scheme ({names}; the list is `ResidualScheme` in "
            f"`model/schemes.py`): {len(presets)} presets, {per_scheme} per scheme")


PROSE = r"\s+".join
INLINE: list[tuple[str, re.Pattern, Callable[[re.Match], str]]] = [
    ("README.md docs/*.md", re.compile(r"for scheme in [\w ]+; do"), _loop),
    ("docs/parallelism.md", re.compile(PROSE([
        r"for", r"every", r"residual", r"scheme", r"\([^;]*;", r"the", r"list", r"is",
        r"`ResidualScheme`", r"in", r"`model/schemes.py`\):", r"\d+", r"presets,", r"\d+",
        r"per", r"scheme"])), _presets_sentence),
]
"""Lists written in text: (the files, as globs under the root; the pattern that finds the
list; its text now)."""

FILES = ("pretrain/hf/remote/configuration_siamesenorm.py", "model/layers/__init__.py")
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


def _rewrap(text: str, start: int, end: int, new: str) -> str:
    """``text`` with ``text[start:end]`` replaced by ``new`` and its paragraph (the lines
    between blank lines, keeping the first line's indent) wrapped again at 96 columns."""
    first = text.rfind("\n\n", 0, start) + 2 if text.rfind("\n\n", 0, start) >= 0 else 0
    last = text.find("\n\n", end)
    last = len(text) if last < 0 else last
    paragraph = text[first:start] + new + text[end:last]
    indent = paragraph[:len(paragraph) - len(paragraph.lstrip(" "))]
    wrapped = textwrap.fill(" ".join(paragraph.split()), width=96, initial_indent=indent,
                            subsequent_indent=indent, break_long_words=False,
                            break_on_hyphens=False)
    return text[:first] + wrapped + text[last:]


def fill_inline(text: str, pattern: re.Pattern, render: Callable[[re.Match], str]) -> str:
    """``text`` with every list ``pattern`` finds made ``render``'s, its paragraph re-wrapped
    where it spans lines; unchanged where the words already agree."""
    for match in reversed(list(pattern.finditer(text))):
        new = render(match)
        if " ".join(match[0].split()) == new:
            continue
        if "\n" in match[0]:
            text = _rewrap(text, match.start(), match.end(), new)
        else:
            text = text[:match.start()] + new + text[match.end():]
    return text


def _inline_files(root: Path) -> list[tuple[str, re.Pattern, Callable[[re.Match], str]]]:
    sites = []
    for globs, pattern, render in INLINE:
        for glob in globs.split():
            for path in sorted(root.glob(glob)):
                sites.append((path.relative_to(root).as_posix(), pattern, render))
    return sites


def stale(write: bool = False, root: Path = ROOT) -> list[str]:
    """The files (relative to ``root``) whose lists differ from the registry's, rewritten
    when ``write``; a file of :data:`FILES` without a block, or a pattern of :data:`INLINE`
    found in none of its files, is stale too."""
    found: dict[str, str] = {}
    for name in FILES:
        text = (root / name).read_text()
        new = fill(text, name)
        if new != text or not BLOCK.search(text):
            found[name] = new
    for globs, pattern, _ in INLINE:
        if not any(pattern.search((root / n).read_text()) for n, p, _ in _inline_files(root)
                   if p is pattern):
            found[globs] = ""
    for name, pattern, render in _inline_files(root):
        text = found.get(name) or (root / name).read_text()
        new = fill_inline(text, pattern, render)
        if new != text or name in found:
            found[name] = new
    if write:
        for name, new in found.items():
            if new and (root / name).is_file() and new != (root / name).read_text():
                (root / name).write_text(new)
    return list(found)


def main(argv: list[str] | None = None) -> int:
    return check_or_rewrite(argv, __doc__.splitlines()[0], stale,
                            "scheme lists out of date with model/schemes.py", COMMAND)


if __name__ == "__main__":
    raise SystemExit(main())
