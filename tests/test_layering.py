"""The tree's architecture, held: imports flow one way, between packages and inside pretrain/.

Read from the source (every import statement, including those inside functions, which are real
dependencies too; only ``if TYPE_CHECKING:`` blocks are left out, since they never run):

- packages: runtime < kernels < model < pretrain < launch, bench, lab (a package imports only
  itself and those below it);
- inside pretrain: the layers of ``PRETRAIN_LAYERS``, each importing only its own layer and the
  ones below it;
- no import cycle between modules;
- no module imports another's private name, or an entry point (a ``__main__``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.pretrain_fixtures import REPO

PACKAGES = {"runtime": 0, "kernels": 1, "model": 2, "pretrain": 3, "launch": 4, "bench": 4,
            "lab": 4}
# pretrain's units, lowest first; a unit is a module or a subpackage of pretrain.
PRETRAIN_LAYERS = [
    {"paths", "arguments"},
    {"config"},
    {"optim", "muon"},
    {"report"},
    {"data"},
    {"run"},
    {"build"},
    {"unsharded"},
    {"hf"},
    {"train"},
    {"__main__"},
]
PRETRAIN_LEVEL = {unit: level for level, units in enumerate(PRETRAIN_LAYERS) for unit in units}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports(path: Path) -> list[tuple[str, str | None, int]]:
    """(module, imported name or None, line) for every executed import of a project module."""
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _type_checking_only(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend((a.name, None, node.lineno) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            found.extend((base, a.name, node.lineno) for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return [(m, n, line) for m, n, line in found if m.split(".")[0] in PACKAGES]


def source_files() -> list[Path]:
    return sorted(p for top in PACKAGES for p in (REPO / top).rglob("*.py"))


def all_modules() -> set[str]:
    return {module_name(p) for p in source_files()}


def target(module: str, name: str | None, known: set[str]) -> str:
    """The module an import reaches: ``from pkg import mod`` reaches ``pkg.mod``."""
    if name is not None and f"{module}.{name}" in known:
        return f"{module}.{name}"
    return module


def edges() -> list[tuple[str, str, str]]:
    """(importer, imported module, where) over the whole tree."""
    known = all_modules()
    out = []
    for path in source_files():
        importer = module_name(path)
        for module, name, line in imports(path):
            out.append((importer, target(module, name, known),
                        f"{path.relative_to(REPO)}:{line}"))
    return out


def pretrain_unit(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "pretrain" and len(parts) > 1 else None


def layering_violations(graph: list[tuple[str, str, str]]) -> list[str]:
    bad = []
    for importer, imported, where in graph:
        top_from, top_to = importer.split("."), imported.split(".")
        if PACKAGES[top_to[0]] > PACKAGES[top_from[0]] or (
                PACKAGES[top_to[0]] == PACKAGES[top_from[0]] and top_to[0] != top_from[0]):
            bad.append(f"{where}: {importer} imports {imported} (package order)")
            continue
        unit_from, unit_to = pretrain_unit(importer), pretrain_unit(imported)
        if unit_from and unit_to and unit_from != unit_to:
            if PRETRAIN_LEVEL[unit_to] > PRETRAIN_LEVEL[unit_from]:
                bad.append(f"{where}: {importer} imports {imported} (pretrain layers)")
        if imported.endswith("__main__"):
            bad.append(f"{where}: {importer} imports the entry point {imported}")
    return bad


def cycles(graph: list[tuple[str, str, str]]) -> list[list[str]]:
    """Every module cycle found by a depth-first search (each reported once)."""
    following: dict[str, set[str]] = {}
    for importer, imported, _ in graph:
        if importer != imported and not importer.startswith(imported + "."):
            following.setdefault(importer, set()).add(imported)
    found, state = [], {}

    def walk(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(following.get(node, ())):
            if state.get(nxt) == "open":
                found.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                walk(nxt, [*stack, nxt])
        state[node] = "done"

    for node in sorted(following):
        if node not in state:
            walk(node, [node])
    return found


def test_every_pretrain_unit_has_a_layer():
    units = {pretrain_unit(m) for m in all_modules()} - {None}
    assert units - set(PRETRAIN_LEVEL) == set()


def test_imports_flow_one_way():
    assert layering_violations(edges()) == []


def test_no_import_cycles():
    assert cycles(edges()) == []


def test_no_private_names_across_modules():
    bad = []
    for path in source_files():
        tree = ast.parse(path.read_text())
        modules = set()
        for module, name, line in imports(path):
            if name is not None and name.startswith("_"):
                bad.append(f"{path.relative_to(REPO)}:{line}: imports {module}.{name}")
            modules.add(name or module.split(".")[0])
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                    and not node.attr.startswith("__") and isinstance(node.value, ast.Name)
                    and node.value.id in modules):
                bad.append(f"{path.relative_to(REPO)}:{node.lineno}: uses "
                           f"{node.value.id}.{node.attr}")
    assert bad == []


def test_every_subpackage_says_what_it_owns():
    missing = [str(p.relative_to(REPO)) for top in PACKAGES
               for p in (REPO / top).rglob("__init__.py")
               if not ast.get_docstring(ast.parse(p.read_text()))]
    assert missing == []


@pytest.mark.parametrize("graph, expected", [
    ([("runtime.parallel", "model.config", "x:1")], "package order"),
    ([("pretrain.data.batches", "pretrain.train.loop", "x:1")], "pretrain layers"),
    ([("launch.finished", "pretrain.__main__", "x:1")], "entry point"),
])
def test_checker_catches_violations(graph, expected):
    """The checks above can fail: a made-up upward import is reported."""
    assert any(expected in line for line in layering_violations(graph))


def test_cycle_finder_finds_a_cycle():
    graph = [("model.config", "model.schemes", ""), ("model.schemes", "model.layers.pre", ""),
             ("model.layers.pre", "model.config", "")]
    assert cycles(graph) == [["model.config", "model.schemes", "model.layers.pre",
                              "model.config"]]
