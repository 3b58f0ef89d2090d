"""The lists and counts of residual schemes in README.md, docs/ and docstrings are the
registry's (``ResidualScheme``), so a new scheme cannot leave them stale."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from model.schemes import ResidualScheme

ROOT = Path(__file__).resolve().parents[2]
REGISTERED = [s.value for s in ResidualScheme]


def table_schemes(page: Path) -> list[str]:
    """The first column of the page's first table headed ``| scheme | per sublayer``."""
    lines = page.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| scheme | per sublayer"))
    names = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        names.append(line.split("|")[1].strip().strip("`"))
    return names


@pytest.mark.parametrize("page", ["README.md", "docs/schemes.md"])
def test_equation_tables_list_every_scheme(page):
    assert table_schemes(ROOT / page) == REGISTERED


def test_shell_loops_over_schemes_name_every_scheme():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    loops = [(page.name, m.group(1).split()) for page in pages
             for m in re.finditer(r"for scheme in ([\w ]+); do", page.read_text())]
    assert loops, "no loop over schemes found"
    for page, names in loops:
        assert names == REGISTERED, page


def test_config_docstring_lists_every_scheme():
    source = (ROOT / "model" / "config.py").read_text()
    listed = re.search(r'residual_scheme: ResidualScheme = .*\n\s*"""([^(]*)\(', source)
    assert listed, "model/config.py: residual_scheme's docstring not found"
    assert [s.strip() for s in listed.group(1).split("|")] == REGISTERED


def test_preset_count_and_scheme_list_in_parallelism_doc():
    spec = importlib.util.spec_from_file_location("generate",
                                                  ROOT / "configs" / "paper" / "generate.py")
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    presets = generate.presets()
    per_scheme = sum(1 for name in presets if Path(name).stem.split("-")[0] == "pre")
    text = " ".join((ROOT / "docs" / "parallelism.md").read_text().split())
    found = re.search(r"for every residual scheme \(([^;]*); the list is `ResidualScheme` in "
                      r"`model/schemes.py`\): (\d+) presets, (\d+) per scheme", text)
    assert found, "docs/parallelism.md: the sentence on the paper's presets not found"
    names = [n.strip(" `") for n in found.group(1).split(",")]
    assert names == REGISTERED
    assert (int(found.group(2)), int(found.group(3))) == (len(presets), per_scheme)


@pytest.mark.parametrize("where", ["dry-run docstring", "docs/memory.md"])
def test_per_layer_memory_summaries_name_every_scheme(where):
    """The sentences that give each scheme's per-layer bytes (``That is pre, post, ... 7h +
    3kv + 5f, ...``) name every registered scheme."""
    from pretrain.report.dry_run import activation_bytes

    if where == "docs/memory.md":
        text = (ROOT / "docs" / "memory.md").read_text()
        start = text.index("So pre, post")
    else:
        text = activation_bytes.__doc__
        start = text.index("That is pre, post")
    sentence = text[start:text.index(" per layer" if where == "docs/memory.md" else "(2f less",
                                     start)]
    named = set(re.findall(r"\b[a-z][a-z0-9_]*\b", sentence)) & set(REGISTERED)
    assert named == set(REGISTERED), sorted(set(REGISTERED) - named)


def test_sweep_cell_counts_in_the_docs_are_the_presets():
    """Every "`configs/sweep/NAME.toml`: N cells" (and "N cells" in a preset's own header
    comment) is the number of cells the preset really runs: a grid naming ``schemes = "all"``
    grows with the registry, and the prose must follow."""
    from lab.lr_sweep import load_preset

    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    claims = [(page.name, m.group(1), int(m.group(2))) for page in pages
              for m in re.finditer(r"`(configs/sweep/[\w-]+\.toml)`[^.\n]*?: (\d+) cells",
                                   " ".join(page.read_text().split()))]
    for preset in sorted((ROOT / "configs" / "sweep").glob("*.toml")):
        header = re.search(r"^# (\d+) cells", preset.read_text(), re.MULTILINE)
        if header:
            claims.append((preset.name, f"configs/sweep/{preset.name}", int(header.group(1))))
    assert {c[1] for c in claims} >= {"configs/sweep/cpu.toml", "configs/sweep/gpu.toml"}
    for where, preset, count in claims:
        assert len(load_preset(ROOT / preset)[2]) == count, (where, preset, count)


def test_generated_scheme_lists_are_the_registrys():
    """Every generated list (``pretrain/report/scheme_lists.py``) is what the registry gives
    now; a stale one fails naming every stale file and the command that rewrites them."""
    from pretrain.report import scheme_lists

    stale = scheme_lists.stale()
    assert not stale, (f"scheme lists out of date with model/schemes.py: {', '.join(stale)}; "
                       f"rewrite them: {scheme_lists.COMMAND}")


def test_the_list_check_finds_a_stale_list_and_the_command_rewrites_it(tmp_path):
    from pretrain.report import scheme_lists

    for name in scheme_lists.FILES:
        copy = tmp_path / name
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.write_text((ROOT / name).read_text().replace('"mhc"', '"gated"'))
    assert scheme_lists.stale(root=tmp_path) == list(scheme_lists.FILES)
    scheme_lists.stale(write=True, root=tmp_path)
    assert scheme_lists.stale(root=tmp_path) == []
    for name in scheme_lists.FILES:
        assert (tmp_path / name).read_text() == (ROOT / name).read_text()
