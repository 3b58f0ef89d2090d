"""The scheme registry is the one list of schemes: every registered scheme has its layer file,
and "Adding a scheme" names every file a new scheme touches. (What its traits say about the
memory a block keeps is held to the tensors autograd keeps by
tests/bench/test_saved_activations.py.)"""

import re
from pathlib import Path

from model.layers import SCHEME_FILES
from model.schemes import ResidualScheme


def test_every_scheme_has_its_layer_file():
    assert set(SCHEME_FILES) == set(ResidualScheme)
    for scheme, module in SCHEME_FILES.items():
        assert module.__name__ == f"model.layers.{scheme.value}", scheme


ROOT = Path(__file__).resolve().parents[2]
# Written by configs/paper/generate.py, not by hand.
GENERATED = ("configs/paper/1.3b/", "configs/paper/depth/")
TEXT = {".py", ".md", ".toml", ".sh", ".sbatch"}


def files_naming(words: tuple[str, ...]) -> set[str]:
    """Repository files (hidden folders, run folders and generated presets aside) that name
    one of ``words`` as a whole word."""
    pattern = re.compile(r"\b(?:" + "|".join(words) + r")\b")
    found = set()
    for path in ROOT.rglob("*"):
        rel = path.relative_to(ROOT).as_posix()
        if (path.suffix not in TEXT or not path.is_file() or rel.startswith(GENERATED)
                or any(part.startswith(".") or part == "runs" for part in path.parts[
                    len(ROOT.parts):])):
            continue
        if pattern.search(path.read_text(errors="replace")):
            found.add(rel)
    return found


def test_adding_a_scheme_names_every_file_a_new_scheme_touched():
    """docs/schemes.md's "Adding a scheme" names every file that names the schemes added by
    following it, and nothing it names is missing: its list is what adding one takes."""
    text = (ROOT / "docs" / "schemes.md").read_text()
    section = text.split("## Adding a scheme", 1)[1].split("\n## ", 1)[0]
    named = {p for p in re.findall(r"`([\w./-]+\.(?:py|md|toml))`", section)}
    named = {p if "/" in p or p == "README.md" else f"pretrain/hf/remote/{p}" for p in named}
    touched = files_naming(("periln", "olmo2")) - {"tests/model/test_scheme_registry.py",
                                                    "docs/schemes.md"}
    assert touched <= named, sorted(touched - named)
    missing = [p for p in named if "<" not in p and not (ROOT / p).is_file()]
    assert not missing, missing
