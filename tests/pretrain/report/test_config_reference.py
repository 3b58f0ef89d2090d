"""The config's field reference: every field documented by the string literal after it,
docs/config.md held equal to those docstrings, and ``python -m pretrain explain FIELD``
printing one field (an unknown one: one line naming the closest, exit 2)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import tomllib
import typing
import warnings
from dataclasses import dataclass, field

import pytest

from pretrain.arguments import OVERRIDES_HELP
from pretrain.config import Config
from pretrain.report import config_reference
from pretrain.report.dry_run import REFERENCE_HINT


def test_every_config_field_has_a_docstring():
    missing = config_reference.undocumented()
    assert not missing, ("config fields without a docstring (write what each does in the "
                         f"string literal after it): {', '.join(missing)}")


@dataclass
class _Toy:
    documented: int = 1
    """Says what it does."""
    bare: str = ""
    # a comment is not a docstring
    listed: list[str] = field(default_factory=list)
    """Read back whole,
    over two lines."""


def test_a_field_without_a_docstring_is_named():
    assert config_reference.undocumented([("toy", _Toy)]) == ["toy.bare"]
    docs = {d.name: d for d in config_reference.fields([("toy", _Toy)])}
    assert docs["toy.listed"] == config_reference.FieldDoc(
        "toy.listed", "list of str", "[]", (), "Read back whole, over two lines.")


def test_docs_config_md_matches_the_config_classes(capsys):
    assert config_reference.main([]) == 0, capsys.readouterr().out


def test_the_reference_has_every_field_with_its_type_default_and_choices():
    text = config_reference.reference()
    every = [f"{s.name}.{f.name}" for s in dataclasses.fields(Config)
             for f in dataclasses.fields(typing.get_type_hints(Config)[s.name])]
    rows = [line.split(" | ")[0].strip("|` ") for line in text.splitlines()
            if line.startswith("| `")]
    assert rows == every
    assert ("| `run.params_dtype` | one of `auto`, `fp32`, `bf16` | `\"auto\"` | auto (bf16 "
            "on GPU, fp32 on CPU), fp32 or bf16. |") in text
    assert "| `model.num_query_groups` | int or unset | unset | Grouped-query" in text
    assert "| `data.prefixes` | list of str | `[]` |" in text
    # a union of two types names both (an unset option only where None is one of them)
    assert "| `model.moe_layer_freq` | int or list of int | `1` | Which blocks" in text
    assert "| `parallel.etp` | int or unset | unset |" in text
    # markdown in a docstring's text is escaped; its ``code`` becomes `code`
    assert "online \\| offline \\| disabled \\| auto" in text
    assert "`&lt;run.dir&gt;" not in text and "&lt;run.dir&gt;/hangs" in text
    assert "(`include_bias` false)" in text


def test_explain_prints_description_type_default_and_allowed_values():
    assert config_reference.explain("optim.lr").splitlines() == [
        "optim.lr",
        "  Peak learning rate, reached at the end of the warm-up.",
        "  type:    float",
        "  default: 0.0003",
        "  set:     --optim.lr=VALUE on the command line, or lr = VALUE under [optim] in a "
        "config",
        "           file",
        "every field: docs/config.md"]
    assert config_reference.explain("--optim.lr=1e-3") == config_reference.explain("optim.lr")
    lines = config_reference.explain("run.params_dtype").splitlines()
    assert "  allowed: auto, fp32, bf16" in lines and '  default: "auto"' in lines
    assert "  type:    int or unset" in config_reference.explain("parallel.vp").splitlines()
    moved = config_reference.explain("run.max_nonfinite_steps").splitlines()
    assert moved[:2] == ["run.max_nonfinite_steps moved to guard.max_skipped (old configs "
                         "still load into it)", "guard.max_skipped"]
    section = config_reference.explain("optim")
    assert section.startswith("[optim]\n  AdamW") and "  optim.lr " in section
    assert all(f"  optim.{f.name} " in section
               for f in dataclasses.fields(typing.get_type_hints(Config)["optim"]))


@pytest.mark.parametrize(("name", "line"), [
    ("optim.lrr", "unknown config field 'optim.lrr' (did you mean optim.lr?)"),
    ("run.lr", "unknown config field 'run.lr' (did you mean optim.lr?)"),
    ("seq_length", "unknown config field 'seq_length' (did you mean model.seq_length or "
                   "data.seq_length?)"),
    ("foo.bar", "unknown config field 'foo.bar'; sections: model, parallel, optim, data, run, "
                "guard, logging, kernels, diagnostics, eval"),
    ("run.eval_iters", "run.eval_iters is no longer a setting: every evaluation now covers"),
])
def test_explain_of_an_unknown_field_is_one_line_exit_2(name, line, capsys):
    from pretrain.__main__ import main

    with _console_restored():
        code = main(["explain", name])
    out, err = capsys.readouterr()
    assert code == 2 and out == "", (out, err)
    assert len(err.strip().splitlines()) == 1 and err.startswith(f"error: {line}"), err


def test_train_help_and_the_dry_run_point_to_the_reference():
    assert "python -m pretrain explain optim.lr" in OVERRIDES_HELP
    assert "docs/config.md" in OVERRIDES_HELP
    assert "python -m pretrain explain" in REFERENCE_HINT and "docs/config.md" in REFERENCE_HINT
    assert tomllib.loads(REFERENCE_HINT) == {}  # a comment: the printed config stays TOML


@contextlib.contextmanager
def _console_restored():
    """main() sets the process's logging and warning filters up; put them back."""
    root, ours = logging.getLogger(), logging.getLogger("pretrain")
    saved = root.handlers[:], root.level, ours.level
    try:
        with warnings.catch_warnings():
            yield
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
        ours.setLevel(saved[2])
