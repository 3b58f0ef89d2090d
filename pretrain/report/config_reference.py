"""What each config field means, from the config classes' own docstrings: one field printed by
``python -m pretrain explain FIELD``, every field in docs/config.md.

python -m pretrain.report.config_reference [--write]

A field is documented by the string literal after it in its dataclass (``pretrain/config/``,
``model/config.py``), the one place a change to a field is made, so its description cannot
drift from the code. docs/config.md carries the reference between
``<!-- config-reference: fields -->`` and ``<!-- /config-reference -->``: ``--write``
regenerates it, without it the script exits 1 if the page is out of date or a field has no
docstring (tests/pretrain/report/test_config_reference.py holds both).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import inspect
import json
import re
import sys
import textwrap
import types
import typing
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from pretrain.config import MOVED_KEYS, RETIRED_KEYS, Config
from runtime.errors import ConfigError
from runtime.markdown import markdown_table, refresh_docs

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "config.md"
TAG = "config-reference"
WIDTH = 88


@dataclass(frozen=True)
class FieldDoc:
    """One config field as the reference shows it."""

    name: str  # section.key
    type: str
    default: str  # as TOML writes it, or "unset"
    choices: tuple[str, ...]  # a StrEnum field's allowed values
    description: str  # "" when the field has no docstring


def sections() -> list[tuple[str, type]]:
    """(section name, its dataclass) in the order a config file lists them."""
    hints = typing.get_type_hints(Config)
    return [(f.name, hints[f.name]) for f in dataclasses.fields(Config)]


def docstrings(cls: type) -> dict[str, str]:
    """The string literal after each field of dataclass ``cls``, by field name, read from its
    source (Python keeps no such string at run time)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    found = {}
    for statement, after in zip(body, body[1:], strict=False):
        if (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            found[statement.target.id] = inspect.cleandoc(after.value.value)
    return found


def _type(annotation) -> tuple[str, tuple[str, ...]]:
    """(the type as a reader writes it, a StrEnum's values)."""
    if isinstance(annotation, type) and issubclass(annotation, StrEnum):
        return "str", tuple(member.value for member in annotation)
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(annotation)
        described = [_type(a) for a in args if a is not type(None)]
        text = " or ".join(t for t, _ in described)
        choices = tuple(c for _, cs in described for c in cs)
        return f"{text} or unset" if type(None) in args else text, choices
    if origin is list:
        return f"list of {_type(typing.get_args(annotation)[0])[0]}", ()
    return annotation.__name__, ()


def _default(item: dataclasses.Field) -> str:
    value = item.default_factory() if item.default is dataclasses.MISSING else item.default
    if value is None:
        return "unset"
    return json.dumps(value.value if isinstance(value, StrEnum) else value)


def fields(chosen: list[tuple[str, type]] | None = None) -> list[FieldDoc]:
    """Every field of ``chosen`` (default: every section of the config), in source order."""
    out = []
    for section, cls in chosen if chosen is not None else sections():
        hints, described = typing.get_type_hints(cls), docstrings(cls)
        for item in dataclasses.fields(cls):
            text, choices = _type(hints[item.name])
            out.append(FieldDoc(f"{section}.{item.name}", text, _default(item), choices,
                                " ".join(described.get(item.name, "").split())))
    return out


def undocumented(chosen: list[tuple[str, type]] | None = None) -> list[str]:
    """The fields without a docstring: each must say what it does."""
    return [f.name for f in fields(chosen) if not f.description]


def _markdown(text: str) -> str:
    """A docstring as markdown table text: ``code`` as `code`; outside code spans, what
    markdown would read as a tag, emphasis or a cell boundary escaped."""
    parts = re.split(r"(``.+?``|`[^`]+`)", text)
    out = []
    for i, part in enumerate(parts):
        if i % 2:
            out.append("`" + part.strip("`") + "`")
        else:
            out.append(part.replace("\\", "\\\\").replace("*", "\\*").replace("<", "&lt;")
                       .replace(">", "&gt;"))
    return "".join(out).replace("|", "\\|")


def _class_doc(cls: type) -> str:
    return " ".join(inspect.cleandoc(cls.__doc__ or "").split())


def reference() -> str:
    """docs/config.md's generated block: one table per section."""
    parts = []
    by_section: dict[str, list[FieldDoc]] = {}
    for doc in fields():
        by_section.setdefault(doc.name.partition(".")[0], []).append(doc)
    for section, cls in sections():
        rows = []
        for doc in by_section[section]:
            kind = ("one of " + ", ".join(f"`{c}`" for c in doc.choices)) if doc.choices \
                else doc.type
            default = doc.default if doc.default == "unset" else f"`{doc.default}`"
            rows.append([f"`{doc.name}`", _markdown(kind), default,
                         _markdown(doc.description)])
        parts.append(f"## [{section}]\n\n{_markdown(_class_doc(cls))}\n\n"
                     + markdown_table(["field", "type", "default", "what it does"], rows,
                                      right_from=4))
    return "\n\n".join(parts)


def _wrap(text: str, indent: str = "  ") -> str:
    """A docstring for the terminal: ``code`` as `code`, wrapped."""
    text = re.sub(r"``(.+?)``", r"`\1`", text)
    return textwrap.fill(text, WIDTH, initial_indent=indent, subsequent_indent=indent)


def explain(name: str) -> str:
    """What ``python -m pretrain explain NAME`` prints: a field (``optim.lr``; also written
    ``--optim.lr=...``) with its description, type, allowed values and default, or a section
    (``optim``) with its fields. Anything else is a ConfigError naming the closest field."""
    name = name.strip().removeprefix("--").partition("=")[0].strip()
    known = {doc.name: doc for doc in fields()}
    classes = dict(sections())
    if name in classes:
        docs = [doc for doc in known.values() if doc.name.startswith(f"{name}.")]
        width = max(len(doc.name) for doc in docs)
        lines = [f"[{name}]", _wrap(_class_doc(classes[name])), ""]
        lines += [f"  {doc.name:<{width}}  {doc.type} = {doc.default}" for doc in docs]
        lines += ["", f"one field's description: python -m pretrain explain {docs[0].name}; "
                  "every field: docs/config.md"]
        return "\n".join(lines)
    if name in RETIRED_KEYS:
        raise ConfigError(f"{name} is no longer a setting: {RETIRED_KEYS[name]}")
    lines = []
    if name in MOVED_KEYS:
        lines.append(f"{name} moved to {MOVED_KEYS[name]} (old configs still load into it)")
        name = MOVED_KEYS[name]
    if name not in known:
        hint = _closest(name, known) or f"; sections: {', '.join(classes)}"
        raise ConfigError(f"unknown config field {name!r}{hint}")
    doc = known[name]
    section, _, key = name.partition(".")
    lines += [doc.name, _wrap(doc.description), f"  type:    {doc.type}"]
    if doc.choices:
        lines.append(f"  allowed: {', '.join(doc.choices)}")
    lines += [f"  default: {doc.default}",
              textwrap.fill(f"set:     --{name}=VALUE on the command line, or {key} = VALUE "
                            f"under [{section}] in a config file", WIDTH, initial_indent="  ",
                            subsequent_indent=" " * 11),
              "every field: docs/config.md"]
    return "\n".join(lines)


def _closest(name: str, known: dict[str, FieldDoc]) -> str:
    """`` (did you mean optim.lr?)`` for a key under the wrong section (``run.lr``) or without
    one (``lr``), or a misspelt field (``optim.lrr``); "" when nothing is close."""
    key = name.rpartition(".")[2]
    keys: dict[str, list[str]] = {}
    for doc in known.values():
        keys.setdefault(doc.name.partition(".")[2], []).append(doc.name)
    close = keys.get(key) or \
        difflib.get_close_matches(name, list(known), n=1, cutoff=0.6) or \
        [keys[k][0] for k in difflib.get_close_matches(key, list(keys), n=1, cutoff=0.75)]
    return f" (did you mean {' or '.join(close)}?)" if close else ""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--write", action="store_true", help="rewrite docs/config.md's reference")
    args = p.parse_args(argv)
    missing = undocumented()
    if missing:
        print(f"{TAG}: fields without a docstring (write what each does in the string literal "
              f"after it): {', '.join(missing)}")
        return 1
    return refresh_docs([PAGE], TAG, {"fields": reference()},
                        "the config classes' docstrings (rewrite: python -m "
                        "pretrain.report.config_reference --write)", args.write)


if __name__ == "__main__":
    sys.exit(main())
