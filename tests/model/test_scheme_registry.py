"""The scheme registry is the one list of schemes: every registered scheme has its layer file,
and "Adding a scheme" names every file a new scheme touches. (What its traits say about the
memory a block keeps is held to the tensors autograd keeps by
tests/bench/test_saved_activations.py.)"""

import dataclasses
import re
import sys
from pathlib import Path

import pytest

from model.builder import build_model
from model.config import ModelConfig, ParallelConfig
from model.layers import SCHEME_FILES
from model.schemes import ResidualScheme
from pretrain.report.dry_run import Fusions, estimated_layer_bytes
from tests.helpers import tiny_model


def test_every_scheme_has_its_layer_file():
    assert set(SCHEME_FILES) == set(ResidualScheme)
    for scheme, module in SCHEME_FILES.items():
        assert module.__name__ == f"model.layers.{scheme.value}", scheme


ROOT = Path(__file__).resolve().parents[2]
# Written by configs/paper/generate.py, not by hand.
GENERATED = ("configs/paper/1.3b/", "configs/paper/depth/", "configs/paper/moe/",
             "configs/paper/long/")
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


MODEL_FIELDS = frozenset(f.name for f in dataclasses.fields(ModelConfig))


def fields_read(scheme: ResidualScheme) -> dict[str, set[str]]:
    """{field: {"file:line", ...}}: the model fields read, outside model/config.py (whose
    checks read every field), while the scheme's tiny model is built and its memory
    estimated: the code decides which fields a scheme reads, not a list."""
    reads: dict[str, set[str]] = {}

    class Recording(ModelConfig):
        def __getattribute__(self, name):
            if name in MODEL_FIELDS:
                caller = sys._getframe(1)
                path = Path(caller.f_code.co_filename)
                if path != ROOT / "model" / "config.py" and ROOT in path.parents:
                    reads.setdefault(name, set()).add(
                        f"{path.relative_to(ROOT)}:{caller.f_lineno}")
            return super().__getattribute__(name)

    cfg = Recording(**vars(tiny_model(scheme.value)))
    build_model(cfg, ParallelConfig())
    estimated_layer_bytes(cfg, 2, Fusions())
    return reads


def test_scheme_only_fields_are_found_from_the_code(single_rank):
    """A model field read only under some schemes is a scheme-only field: each scheme that
    reads it must list it in ``Traits.fields`` (so the config refuses it under the others
    and the export writes it), and a listed field must be one the scheme reads. Which fields
    those are is found by recording what building each scheme's model reads, not from a
    list someone must remember."""
    read = {scheme: fields_read(scheme) for scheme in ResidualScheme}
    everywhere = set.intersection(*(set(fields) for fields in read.values()))
    for scheme, fields in read.items():
        for name in sorted(set(fields) - everywhere - set(scheme.traits.fields)):
            pytest.fail(f"residual scheme {scheme}: model.{name} is read only under some "
                        f"schemes (here at {', '.join(sorted(fields[name]))}) but "
                        f"Traits.fields of {scheme} does not list it (model/schemes.py)")
        for name in sorted(set(scheme.traits.fields) - set(fields)):
            pytest.fail(f"residual scheme {scheme}: Traits.fields lists model.{name}, which "
                        "building its model never reads")
