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
    assert table_schemes(ROOT / page) == REGISTERED, (
        f"{page}: the equation table's schemes are not ResidualScheme's (model/schemes.py): "
        f"give each scheme its row, with its equations, in the registry's order {REGISTERED}")


def test_shell_loops_over_schemes_name_every_scheme():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    loops = [(page.name, m.group(1).split()) for page in pages
             for m in re.finditer(r"for scheme in ([\w ]+); do", page.read_text())]
    assert loops, "no loop over schemes found"
    for page, names in loops:
        assert names == REGISTERED, (f"{page}: a loop over schemes is stale; rewrite it: "
                                     "python -m pretrain.report.scheme_lists --write")


def test_config_docstring_leaves_the_list_to_the_registry():
    """``residual_scheme``'s docstring names the registry instead of listing the schemes (the
    config reference lists them from ``ResidualScheme``, docs/config.md)."""
    source = (ROOT / "model" / "config.py").read_text()
    doc = re.search(r'residual_scheme: ResidualScheme = [^\n]*\n\s*"""(.*?)"""', source,
                    re.DOTALL)
    assert doc, "model/config.py: residual_scheme's docstring not found"
    assert "``ResidualScheme``" in doc.group(1)
    assert len(set(re.findall(r"\w+", doc.group(1))) & set(REGISTERED)) <= 1, doc.group(1)


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
    fix = ("docs/parallelism.md: the presets sentence is stale; run python configs/paper/"
           "generate.py, then python -m pretrain.report.scheme_lists --write")
    assert names == REGISTERED, fix
    assert (int(found.group(2)), int(found.group(3))) == (len(presets), per_scheme), fix


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
    assert named == set(REGISTERED), (
        f"{where}: the per-layer memory sentence leaves out {sorted(set(REGISTERED) - named)}: "
        "add each one's bytes per layer (its Traits.kept; measured by python -m "
        "bench.saved_activations --schemes pre,<name>)")


def test_generated_scheme_lists_and_sweep_counts_are_the_registrys():
    """Every generated list (``pretrain/report/scheme_lists.py``) and every count the sweep's
    prose states (``lab/sweep_counts.py``: each preset's cells, "every registered scheme"'s
    number) is what the registry gives now; a stale one fails naming every stale file and the
    command that rewrites it. Two commands, because ``pretrain`` may not import ``lab``, which
    counts a preset's cells."""
    from lab import sweep_counts
    from pretrain.report import scheme_lists

    lists, counts = scheme_lists.stale(), sweep_counts.stale()
    stale = ([f"scheme lists out of date with model/schemes.py: {', '.join(lists)}; rewrite "
              f"them: {scheme_lists.COMMAND}"] if lists else []) + (
        [f"sweep counts out of date with the presets and the registry: {'; '.join(counts)}; "
         f"rewrite them: {sweep_counts.COMMAND}"] if counts else [])
    assert not stale, "\n".join(stale)


def test_the_count_check_names_every_stale_count_and_the_command_rewrites_them(tmp_path):
    """In a copy whose prose predates ``mhc`` (the CPU sweep's 54 cells, 10 schemes: what a
    newly registered scheme leaves behind), the check names each stale count with its file,
    its number now and what it counts, and the rewrite makes every file what it is here."""
    from lab import sweep_counts

    names = ["docs/lab.md", *(p.relative_to(ROOT).as_posix()
                              for p in sorted((ROOT / "configs" / "sweep").glob("*.toml")))]
    edits = {"docs/lab.md": [("sweep/cpu.toml`: 59 cells", "sweep/cpu.toml`: 54 cells"),
                             ('"all"`, 11 today', '"all"`, 10 today')],
             "configs/sweep/cpu.toml": [("# 59 cells", "# 54 cells")]}
    for name in names:
        text = (ROOT / name).read_text()
        for old, new in edits.get(name, []):
            assert old in text, (name, old)
            text = text.replace(old, new, 1)
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert sweep_counts.stale(root=tmp_path) == [
        "docs/lab.md: 59 cells of configs/sweep/cpu.toml, not 54",
        "configs/sweep/cpu.toml: 59 cells of configs/sweep/cpu.toml, not 54",
        "docs/lab.md: 11 registered schemes, not 10"]
    sweep_counts.stale(write=True, root=tmp_path)
    assert sweep_counts.stale(root=tmp_path) == []
    for name in names:
        assert (tmp_path / name).read_text() == (ROOT / name).read_text(), name


def test_the_list_check_names_every_stale_file_and_the_command_rewrites_them(tmp_path):
    """In a copy where each list lost ``mhc`` (a block's entry, a submission loop, the presets
    sentence's name and count), the check names every one of those files at once, and the
    rewrite makes each what the registry gives (the same words; a sentence re-wrapped)."""
    from pretrain.report import scheme_lists

    edits = {
        "pretrain/hf/remote/configuration_siamesenorm.py": (', "mhc")', ")"),
        "model/layers/__init__.py": ("    ResidualScheme.MHC: mhc,\n", ""),
        "docs/parallelism.md": ("olmo2 mhc; do", "olmo2; do"),
        "README.md": ("", ""),
    }
    for path in ROOT.glob("docs/*.md"):
        edits.setdefault(path.relative_to(ROOT).as_posix(), ("", ""))
    for name, (old, new) in edits.items():
        copy = tmp_path / name
        copy.parent.mkdir(parents=True, exist_ok=True)
        text = (ROOT / name).read_text()
        assert old in text, name
        copy.write_text(text.replace(old, new, 1) if old else text)
    sentence = tmp_path / "docs/parallelism.md"
    sentence.write_text(sentence.read_text().replace("`olmo2`, `mhc`; the", "`olmo2`; the"))
    stale = scheme_lists.stale(root=tmp_path)
    assert sorted(stale) == sorted(n for n, (old, _) in edits.items() if old), stale
    scheme_lists.stale(write=True, root=tmp_path)
    assert scheme_lists.stale(root=tmp_path) == []
    for name in stale:
        assert (tmp_path / name).read_text().split() == (ROOT / name).read_text().split(), name


def test_the_readmes_sweep_over_every_registered_scheme_is_one():
    """README.md says the CPU learning-rate sweep ran "over every registered scheme": the
    preset it names has cells for each registered scheme, and the results table it shows
    (generated from the dated results file) has a row for each, in the registry's order."""
    from lab.lr_sweep import load_preset

    text = (ROOT / "README.md").read_text()
    claim = re.search(r"sweep over every registered scheme\s+\(`(configs/sweep/[\w-]+\.toml)`",
                      text)
    assert claim, "README.md: the sentence on the sweep over every registered scheme not found"
    swept = {cell.scheme for cell in load_preset(ROOT / claim.group(1))[2]}
    assert swept == set(REGISTERED), (
        f"README.md: {claim.group(1)} runs {sorted(swept)}, not every registered scheme: "
        "give its grid schemes = \"all\"")
    block = text[claim.end():].split("<!-- /sweep-results -->", 1)[0]
    rows = re.findall(r"^\| (\w+) \|", block, re.MULTILINE)
    assert [r for r in rows if r != "scheme"] == REGISTERED, (
        "README.md: the sweep's results table does not have a row per registered scheme: run "
        "the sweep's missing cells (python -m lab.lr_sweep --preset "
        f"{claim.group(1)}), then python -m lab.docs_tables --write")
