"""Every command in README.md and docs/*.md runs as written: checked statically, in seconds.

Which text is a command:

- fenced blocks labelled ``bash``, ``sh``, ``shell`` or ``console`` (in ``console`` blocks only
  the lines starting with ``$ ``), and unlabelled blocks whose first line starts with a program
  this module knows; ``python`` blocks are compiled and their imports resolved; blocks in any
  other language (``text``, ``toml``...) are listings or output;
- inline code spans in prose that start with a program this module knows (``make``,
  ``python``, ``torchrun``, ``sbatch``, ``bash``, ``pytest``, the launchers), after any
  ``NAME=value`` prefixes.

What is checked, for real but without running anything:

- ``make X``: X is a target of the Makefile;
- ``python -m M`` (also ``.venv/bin/python``, ``$PY``, ``srun ... python``, ``FOO=1 python``):
  M is a module of this repository (``M.py`` or ``M/__main__.py``) or an installed one (pytest);
  ``python -m pretrain ...`` (and the arguments of ``launch.finished``, ``launch/torchrun.sh``,
  the slurm batch scripts) parse with
  ``pretrain.arguments.parser()``, every argument it does not know being a
  ``--section.key=value`` override of a real config field, and ``explain X`` names a real field
  or section; the ``--long`` options given to the repository's other modules and scripts are
  ones their argparse parsers define;
- ``bash P``, ``sbatch P``, ``torchrun P``, ``python P.py``: the script exists;
- ``torchrun -m pretrain`` is not shown: the pages show ``launch/torchrun.sh`` instead, whose
  Ctrl-C and user's mistakes end with the ranks' own lines, where plain torchrun adds its
  traceback or failure report (docs/parallelism.md, Launchers);
- every ``--config`` file and every path under the source folders (``configs/``, ``scripts/``,
  ``launch/``, ``tests/``...) exists, globs match something, and ``for`` loops are expanded so
  each file a loop names is checked;
- pytest marker expressions (``-m "not slow"``) name markers registered in pyproject.toml.

What is skipped is recorded, with one of the reasons in ``SKIP_REASONS`` (see
``test_skips_are_documented``): comments, output, listings, shell syntax around commands, other
programs (pip, wandb, slurm's own tools), paths a command writes (``runs/...``), and
placeholders: ``<...>``, ALL_CAPS names (``X.toml``, ``RUN/config.toml``, ``ARGS``) and
``$variables`` that stand where a real value goes.

Beyond commands: every relative link (and its ``#anchor``) in those files points at something
that exists, every path written in inline code exists, and the README stays within a page.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import glob
import importlib.util
import itertools
import re
import shlex
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 320

# Folders of this repository: a path under one of them must exist.
SOURCE_ROOTS = ("configs", "scripts", "launch", "tests", "bench", "lab", "model", "kernels",
                "runtime", "pretrain", "docs", ".ci")
SHELL_LANGUAGES = {"bash", "sh", "shell", "console"}
SKIP_REASONS = {
    "comment": "a comment line (# ...)",
    "output": "output printed by a command, or a listing, not a command",
    "not-shell": "a block in a language that is not a shell (text, toml, ...)",
    "shell-syntax": "shell syntax around commands (for/do/done, NAME=$(...)); the commands "
                    "inside are checked",
    "external": "a program that is not part of this repository (pip, wandb, slurm's tools, "
                "lm_eval, ...)",
    "placeholder": "a placeholder (<...>, an ALL_CAPS name such as X.toml, RUN or ARGS, a "
                   "$variable) stands where the reader puts a real value",
    "output-path": "a path that a command writes (runs/...), not one the repository holds",
    "name": "a program named in the text (`srun`, `launch/torchrun.sh`), not a command to run",
}
# Programs that are not this repository's: skipped (with the reason "external").
EXTERNAL = {"pip", "wandb", "squeue", "scancel", "scontrol", "tail", "lm_eval", "git", "ls",
            "cat", "nvidia-smi", "cd", "export", "mkdir"}
PYTHONS = re.compile(r"^(?:\S*/)?python3?$|^\$\{?PY(?:THON)?\}?$")
LAUNCHER = "launch/torchrun.sh"
LAUNCHER_OPTIONS = {"--nnodes", "--nproc-per-node", "--master-addr", "--master-port",
                    "--node-rank", "--local-addr"}
TORCHRUN_FLAGS = {"--standalone", "--no-python", "--no_python", "--run-path", "--run_path"}
# Modules whose unknown arguments are --section.key=value config overrides.
OVERRIDE_MODULES = {"pretrain", "launch.finished", "lab.lr_sweep"}
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)\s*$")
HEREDOC = re.compile(r"<<-?\s*(['\"]?)(\w+)\1")
LOOP = re.compile(r"^for\s+(\w+)\s+in\s+(.+?);\s*do$")
CAPS = re.compile(r"^[A-Z][A-Z0-9_]*$")


# ---------------------------------------------------------------------------------------------
# Reading the Markdown


@dataclass
class Block:
    language: str
    line: int  # 1-based line of the first content line
    lines: list[str]


@dataclass
class Markdown:
    blocks: list[Block]
    prose: list[tuple[int, str]]  # (line number, text) outside fenced blocks


def read_markdown(text: str) -> Markdown:
    blocks, prose, open_block, indent, fence = [], [], None, 0, ""
    for number, line in enumerate(text.splitlines(), 1):
        match = FENCE.match(line)
        if open_block is None:
            if match:
                indent, fence = len(match.group(1)), match.group(2)
                open_block = Block(match.group(3).lower(), number + 1, [])
            else:
                prose.append((number, line))
        elif match and match.group(2).startswith(fence) and not match.group(3):
            blocks.append(open_block)
            open_block = None
        else:
            body = line[indent:] if line[:indent].strip() == "" else line.lstrip()
            open_block.lines.append(body)
    assert open_block is None, f"a fenced block opened at line {open_block.line - 1} never closes"
    return Markdown(blocks, prose)


def inline_spans(prose: list[tuple[int, str]]):
    for number, line in prose:
        for match in re.finditer(r"(`+)(.+?)\1", line):
            yield number, match.group(2).strip()


# ---------------------------------------------------------------------------------------------
# What the repository holds


@functools.cache
def make_targets(makefile: Path = ROOT / "Makefile") -> frozenset[str]:
    targets = set()
    for line in makefile.read_text().splitlines():
        match = re.match(r"^([^\s#:=$][^:=]*?)\s*:(?![=])", line)
        if match and not line.startswith("\t"):
            targets.update(match.group(1).split())
    return frozenset(targets - {".PHONY"})


@functools.cache
def registered_markers() -> frozenset[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    markers = config["tool"]["pytest"]["ini_options"].get("markers", [])
    return frozenset(m.split(":")[0].split("(")[0].strip() for m in markers)


@functools.cache
def config_fields() -> dict[str, frozenset[str]]:
    """Every config section and its fields: what --section.key=value may name."""
    from pretrain.config import Config

    sections = typing.get_type_hints(Config)
    return {name: frozenset(f.name for f in dataclasses.fields(cls))
            for name, cls in sections.items()}


@functools.cache
def pretrain_parser():
    from pretrain.arguments import parser

    return parser()


def module_file(module: str) -> Path | None:
    """The file ``python -m module`` runs from this repository, if it holds the module."""
    base = ROOT.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__main__.py"):
        if candidate.is_file():
            return candidate
    return None


@functools.cache
def declared_options(source: Path) -> frozenset[str] | None:
    """The --options a script's argparse parsers define (None: it defines none)."""
    options = set()
    for node in ast.walk(ast.parse(source.read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "add_argument"):
            options.update(a.value for a in node.args
                           if isinstance(a, ast.Constant) and str(a.value).startswith("-"))
    return frozenset(options) or None


def top_level_names(source: Path) -> set[str]:
    names = set()
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # a parent package that does not exist
        return False


def is_placeholder(text: str) -> bool:
    if any(c in text for c in "<>$") or "..." in text:
        return True
    parts = [p for p in re.split(r"[/=,]", text) if p]
    return any(CAPS.match(p.split(".")[0]) for p in parts)


# ---------------------------------------------------------------------------------------------
# The checker


@dataclass
class Report:
    problems: list[str] = field(default_factory=list)
    checked: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str, str]] = field(default_factory=list)  # (where, reason, text)

    def skip(self, where: str, reason: str, text: str) -> None:
        assert reason in SKIP_REASONS, reason
        self.skipped.append((where, reason, text))


class Checker:
    def __init__(self, report: Report, where: str):
        self.report, self.where = report, where

    def problem(self, message: str) -> None:
        self.report.problems.append(f"{self.where}: {message}")

    # -- paths ---------------------------------------------------------------------------------
    def path(self, token: str, *, kind: str = "path") -> None:
        """A token that names a file or folder of the repository must exist."""
        value = token.split("=", 1)[1] if token.startswith("-") and "=" in token else token
        value = value.split("::")[0]
        if not value.startswith(tuple(f"{r}/" for r in SOURCE_ROOTS)):
            return
        if is_placeholder(value):
            self.report.skip(self.where, "placeholder", value)
        elif any(c in value for c in "*?["):
            if not glob.glob(value, root_dir=ROOT):
                self.problem(f"{kind} {value} matches no file")
        elif not (ROOT / value).exists():
            self.problem(f"{kind} {value} does not exist")

    def paths(self, tokens: list[str]) -> None:
        for token in tokens:
            self.path(token)

    def config_file(self, value: str | None) -> None:
        if value is None:
            return
        if is_placeholder(value):
            self.report.skip(self.where, "placeholder", f"--config {value}")
        elif value.startswith("runs/"):
            self.report.skip(self.where, "output-path", f"--config {value}")
        elif not (ROOT / value).is_file():
            self.problem(f"--config {value} does not exist")

    def override(self, token: str) -> bool:
        """Check a --section.key=value override; False if the token is not one."""
        match = re.match(r"^--(\w+)\.(\w+)=", token)
        if not match:
            return False
        section, key = match.groups()
        fields = config_fields()
        if section not in fields:
            self.problem(f"{token}: no config section [{section}]")
        elif key not in fields[section]:
            self.problem(f"{token}: [{section}] has no field {key}")
        return True

    # -- commands ------------------------------------------------------------------------------
    def command(self, text: str, heredoc: str | None = None, inline: bool = False) -> None:
        try:
            tokens = shlex.split(text, comments=True)
        except ValueError as err:
            self.problem(f"{text!r} is not valid shell: {err}")
            return
        tokens = [t for t in tokens if not t.startswith("<<")]
        while tokens and ASSIGNMENT.match(tokens[0]):
            tokens = tokens[1:]
        if not tokens:
            self.report.skip(self.where, "shell-syntax", text)
            return
        if inline and len(tokens) == 1:
            self.report.skip(self.where, "name", text)
            return
        self.report.checked.append(f"{self.where}: {text}")
        self.run(tokens, heredoc)

    def run(self, tokens: list[str], heredoc: str | None = None) -> None:
        program, args = tokens[0], tokens[1:]
        name = program.rsplit("/", 1)[-1]
        if program == "make":
            self.make(args)
        elif PYTHONS.match(program):
            self.python(args, heredoc)
        elif program == "torchrun":
            self.torchrun(args)
        elif program in ("bash", "sh"):
            self.script(args)
        elif program == "sbatch":
            self.sbatch(args)
        elif program == "srun":  # srun [-N1 -c64 ...] COMMAND: the command is checked
            rest = list(itertools.dropwhile(lambda t: t.startswith("-"), args))
            if rest:
                self.run(rest, heredoc)
            else:
                self.problem("srun runs nothing")
        elif program == "pytest":
            self.pytest(args)
        elif program.startswith(tuple(f"{r}/" for r in SOURCE_ROOTS)):
            self.script(tokens)
        elif name in EXTERNAL:
            self.report.skip(self.where, "external", " ".join(tokens))
        else:
            self.problem(f"unknown program {program!r} (not this repository's, and not in "
                         "EXTERNAL with a reason)")

    def make(self, args: list[str]) -> None:
        for target in args:
            if target.startswith("-") or ASSIGNMENT.match(target):
                continue
            if target not in make_targets():
                self.problem(f"make {target}: no such target in the Makefile")

    def python(self, args: list[str], heredoc: str | None) -> None:
        if args[:1] == ["-m"] and len(args) >= 2:
            self.module(args[1], args[2:])
        elif args[:1] == ["-"]:
            if heredoc is None:
                self.problem("python - reads a script from stdin, but no here-document follows")
            else:
                self.source(heredoc)
        elif args[:1] == ["-c"] and len(args) >= 2:
            self.source(args[1])
        elif args and args[0].endswith(".py"):
            self.script(args)
        else:
            self.problem(f"python {' '.join(args)}: neither -m MODULE nor a script")

    def module(self, module: str, args: list[str]) -> None:
        if is_placeholder(module):
            self.report.skip(self.where, "placeholder", f"python -m {module}")
            return
        if module == "pytest":
            if not installed("pytest"):
                self.problem("python -m pytest: pytest is not installed")
            self.pytest(args)
            return
        source = module_file(module)
        if source is None:
            if module.split(".")[0] in SOURCE_ROOTS or not installed(module):
                self.problem(f"python -m {module}: no such module")
            return
        if module in ("pretrain", "launch.finished"):
            self.pretrain(args, module)
        else:
            self.options(source, args, overrides=module in OVERRIDE_MODULES)

    def options(self, source: Path, args: list[str], overrides: bool = False) -> None:
        """The --options a repository script is given are ones its parsers define."""
        known = declared_options(source)
        for token in args:
            if overrides and self.override(token):
                continue
            option = token.split("=", 1)[0]
            if known is not None and option.startswith("--") and option not in known:
                self.problem(f"{source.relative_to(ROOT)}: no option {option}")
        self.paths(args)

    def pretrain(self, args: list[str], module: str = "pretrain") -> None:
        """Arguments of ``python -m pretrain``, parsed by its own parser."""
        if not args:
            return  # the CLI named in prose, not run
        holes = [a for a in args if CAPS.match(a)]
        if holes:
            self.report.skip(self.where, "placeholder", f"{module} {' '.join(args)}")
            return
        args = [a for a in args if a not in ("-h", "--help")]
        parser = pretrain_parser()
        try:
            parsed, extra = parser.parse_known_args(args)
        except (Exception, SystemExit) as err:  # the parser raises ConfigError (exit 2)
            self.problem(f"python -m {module} {' '.join(args)}: {err}")
            return
        subparser = parser._subparsers._group_actions[0].choices[parsed.command]
        takes_overrides = "--config" in subparser._option_string_actions
        for token in extra:
            if not takes_overrides:
                self.problem(f"{parsed.command} takes no config overrides: {token}")
            elif not self.override(token):
                self.problem(f"{token!r} is neither an argument of {parsed.command} nor a "
                             "--section.key=value override")
        if parsed.command == "explain":  # the field or section a page explains exists
            from pretrain.report.config_reference import explain
            from runtime.errors import ConfigError

            try:
                explain(parsed.field)
            except ConfigError as err:
                self.problem(f"python -m {module} {' '.join(args)}: {err}")
        self.config_file(getattr(parsed, "config", None))
        self.paths(args)

    def script(self, args: list[str]) -> None:
        if not args:
            self.problem("no script given")
            return
        path, rest = args[0], args[1:]
        if is_placeholder(path):
            self.report.skip(self.where, "placeholder", path)
        elif not (ROOT / path).is_file():
            self.problem(f"script {path} does not exist")
        elif path == LAUNCHER:
            self.launcher(rest)
        elif path.endswith(".py"):
            self.options(ROOT / path, rest)
        else:
            self.paths(rest)

    def launcher(self, args: list[str]) -> None:
        """launch/torchrun.sh [OPTIONS] [--] PRETRAIN_ARGS."""
        rest = list(args)
        while rest and rest[0].startswith("-"):
            if rest[0] == "--":
                rest = rest[1:]
                break
            if rest[0] not in LAUNCHER_OPTIONS or len(rest) < 2:
                self.problem(f"{LAUNCHER}: option {rest[0]} unknown or without a value")
                return
            rest = rest[2:]
        if not rest:
            self.problem(f"{LAUNCHER}: no arguments for python -m pretrain")
        self.pretrain(rest, LAUNCHER)

    def sbatch(self, args: list[str]) -> None:
        """sbatch [--option=value ...] SCRIPT ARGS; the launch/slurm scripts take pretrain's."""
        rest = list(itertools.dropwhile(lambda t: t.startswith("-"), args))
        if not rest:
            self.problem("sbatch: no batch script")
            return
        script, script_args = rest[0], rest[1:]
        if not (ROOT / script).is_file():
            self.problem(f"sbatch script {script} does not exist")
        elif script.startswith("launch/slurm/"):
            self.pretrain(script_args, script)

    def torchrun(self, args: list[str]) -> None:
        rest = list(args)
        while rest and rest[0].startswith("-") and rest[0] != "-m":
            option = rest.pop(0)
            if "=" not in option and option not in TORCHRUN_FLAGS and rest:
                rest.pop(0)  # the option's value
        if rest[:2] == ["-m", "pretrain"]:  # its Ctrl-C and config errors end in its traceback
            self.problem(f"plain torchrun -m pretrain: show {LAUNCHER} instead, which ends a "
                         "Ctrl-C or a user's mistake with the ranks' own lines")
        elif rest[:1] == ["-m"] and len(rest) >= 2:
            self.module(rest[1], rest[2:])
        else:
            self.script(rest)

    def pytest(self, args: list[str]) -> None:
        tokens = iter(args)
        for token in tokens:
            if token == "-m":
                expression = next(tokens, "")
                names = set(re.findall(r"[A-Za-z_]\w*", expression)) - {"and", "or", "not"}
                for marker in sorted(names - registered_markers()):
                    self.problem(f"pytest -m {expression!r}: marker {marker!r} is not "
                                 "registered in pyproject.toml")
            else:
                self.path(token, kind="test path")

    def source(self, code: str, imports: bool = False) -> None:
        """Python that a page shows: it compiles, and imports of this repository resolve."""
        try:
            tree = ast.parse(code)
        except SyntaxError as err:
            self.problem(f"python does not compile: {err}")
            return
        if not imports:
            return
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                self.import_from(node.module, [a.name for a in node.names])
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    self.import_from(alias.name, [])

    def import_from(self, module: str, names: list[str]) -> None:
        if module.split(".")[0] not in SOURCE_ROOTS:
            return
        base = ROOT.joinpath(*module.split("."))
        source = base.with_suffix(".py") if base.with_suffix(".py").is_file() else (
            base / "__init__.py")
        if not source.is_file():
            self.problem(f"import {module}: no such module")
            return
        defined = top_level_names(source)
        for name in names:
            submodule = base / name
            if name not in defined and not (submodule.with_suffix(".py").is_file()
                                            or (submodule / "__init__.py").is_file()):
                self.problem(f"from {module} import {name}: {module} defines no {name}")


def shell_block(block: Block, where: str, report: Report) -> None:
    """The commands of one shell block: continuation lines joined, here-documents attached,
    ``for`` loops expanded."""
    lines, i = block.lines, 0
    loops: list[tuple[str, list[str]]] = []
    while i < len(lines):
        number = block.line + i
        line = lines[i].rstrip()
        i += 1
        if block.language == "console":
            if not line.startswith("$ "):
                if line.strip():
                    report.skip(f"{where}:{number}", "output", line)
                continue
            line = line[2:]
        stripped = line.strip()
        if not stripped:
            continue
        if stripped.startswith("#"):
            report.skip(f"{where}:{number}", "comment", stripped)
            continue
        while stripped.endswith("\\") and i < len(lines):
            stripped = stripped[:-1] + " " + lines[i].strip()
            i += 1
        heredoc = None
        if match := HEREDOC.search(stripped):
            body = []
            while i < len(lines) and lines[i].strip() != match.group(2):
                body.append(lines[i])
                i += 1
            i += 1  # the delimiter
            heredoc = "\n".join(body)
        checker = Checker(report, f"{where}:{number}")
        if match := LOOP.match(stripped):
            values = []
            for word in shlex.split(match.group(2)):
                if any(c in word for c in "*?["):
                    found = sorted(glob.glob(word, root_dir=ROOT))
                    if not found:
                        checker.problem(f"for {match.group(1)} in {word}: matches no file")
                    values += found
                else:
                    values.append(word)
            loops.append((match.group(1), values))
            report.skip(checker.where, "shell-syntax", stripped)
            continue
        if stripped in ("done", "fi", "esac"):
            if stripped == "done" and loops:
                loops.pop()
            report.skip(checker.where, "shell-syntax", stripped)
            continue
        if re.match(r"^[A-Za-z_]\w*=\$\(", stripped):
            report.skip(checker.where, "shell-syntax", stripped)
            continue
        names = [name for name, _ in loops]
        for combination in itertools.product(*(values for _, values in loops)):
            text = stripped
            for name, value in zip(names, combination, strict=True):
                text = re.sub(rf"\$\{{{name}\}}|\${name}(?!\w)", value, text)
            checker.command(text, heredoc)


def starts_with_program(text: str) -> bool:
    words = text.split()
    while words and ASSIGNMENT.match(words[0]):
        words = words[1:]
    if not words:
        return False
    program = words[0]
    return (program in ("make", "torchrun", "sbatch", "bash", "pytest", "srun", LAUNCHER)
            or bool(PYTHONS.match(program)))


def check_markdown(text: str, where: str, report: Report) -> None:
    page = read_markdown(text)
    for block in page.blocks:
        location = f"{where}:{block.line}"
        first = next((line for line in block.lines if line.strip()), "")
        if block.language in SHELL_LANGUAGES or (
                not block.language and starts_with_program(first)):
            shell_block(block, where, report)
        elif block.language == "python":
            report.checked.append(f"{location}: python block")
            Checker(report, location).source("\n".join(block.lines), imports=True)
        elif block.language:
            report.skip(location, "not-shell", f"```{block.language} block")
        else:
            report.skip(location, "output", first)
    for number, span in inline_spans(page.prose):
        checker = Checker(report, f"{where}:{number}")
        if starts_with_program(span):
            checker.command(span, inline=True)
        elif re.fullmatch(r"test_\w+\.py", span):
            if not any(ROOT.glob(f"tests/**/{span}")):
                checker.problem(f"{span}: no such test file under tests/")
        elif re.fullmatch(r"[\w.-]+/[\w./<>*-]*", span):
            checker.path(span, kind="path in the text")


def check_links(text: str, source: Path) -> list[str]:
    """Relative links (and their #anchors) of a page that point at nothing."""
    problems = []
    prose = "\n".join(line for _, line in read_markdown(text).prose)
    for target in re.findall(r"\]\(([^)\s]+)\)", prose):
        if re.match(r"^[a-z]+:", target):
            continue  # http:, https:, mailto:
        path, _, anchor = target.partition("#")
        file = (source.parent / path).resolve() if path else source
        if not file.exists():
            problems.append(f"{source.name}: link {target} points at nothing")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text()):
            problems.append(f"{source.name}: link {target}: {file.name} has no such heading")
    return problems


def anchors(text: str) -> set[str]:
    """GitHub's anchors of a page's headings."""
    found = set()
    for _, line in read_markdown(text).prose:
        if match := re.match(r"^#{1,6}\s+(.*?)\s*#*$", line):
            slug = re.sub(r"[^\w\- ]", "", match.group(1).lower()).replace(" ", "-")
            found.add(slug)
    return found


def check_file(path: Path) -> Report:
    report = Report()
    check_markdown(path.read_text(), str(path.relative_to(ROOT)), report)
    report.problems += check_links(path.read_text(), path)
    return report


# ---------------------------------------------------------------------------------------------
# The tests


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_commands_run_as_written(doc: Path):
    report = check_file(doc)
    assert not report.problems, "\n".join(report.problems)


def test_every_page_has_commands_checked():
    """The extraction finds what the pages hold (a broken parser would check nothing)."""
    reports = {doc.name: check_file(doc) for doc in DOCS}
    assert sum(len(r.checked) for r in reports.values()) >= 80
    for name in ("README.md", "training.md", "parallelism.md", "hf-and-eval.md", "lab.md"):
        assert reports[name].checked, f"{name}: no command found"


def test_skips_are_documented():
    """Nothing is skipped silently: every skip has one of the documented reasons."""
    for doc in DOCS:
        for where, reason, text in check_file(doc).skipped:
            assert reason in SKIP_REASONS, f"{where}: {text!r} skipped without a reason"


def test_readme_fits_on_a_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines"


def test_pages_start_with_their_question():
    for doc in DOCS[1:]:
        lines = [line for line in doc.read_text().splitlines() if line.strip()]
        assert lines[0].startswith("# "), f"{doc.name}: no title"
        assert lines[1].startswith("*") and lines[1].rstrip().endswith("?*"), (
            f"{doc.name}: the line after the title is not the question it answers")


def test_checker_reports_broken_commands():
    """The checker can fail: each made-up mistake below is reported, a good command is not."""
    bad = {
        "make no-such-target": "no such target",
        "python -m pretrain.no_such_module": "no such module",
        "python -m no_such_module_anywhere --flag": "no such module",
        "python -m pretrain trian --config configs/demo-cpu.toml": "trian",
        "python -m pretrain train --config configs/demo-cpu.toml --optim.lrr=1e-3": "lrr",
        "python -m pretrain train --config configs/missing.toml": "configs/missing.toml",
        "python -m pretrain train --config configs/demo-cpu.toml stray": "stray",
        "python -m pretrain prepare-data a --output x --tokenizer t --run.seed=1": "overrides",
        "python -m bench.schemes --no-such-option 3": "--no-such-option",
        "bash scripts/missing.sh": "scripts/missing.sh",
        "sbatch --nodes=2 launch/slurm/multi-node.sbatch trian": "trian",
        "launch/torchrun.sh --bogus 1 train": "--bogus",
        "torchrun --nproc-per-node 2 -m pretrain.nothing train": "no such module",
        "torchrun --nproc-per-node 2 -m pretrain train --config configs/demo-cpu.toml":
            LAUNCHER,
        'python -m pytest -m "not slow and not nonexistent_marker"': "nonexistent_marker",
        "frobnicate --now": "unknown program",
    }
    for command, expected in bad.items():
        report = Report()
        check_markdown(f"```bash\n{command}\n```\n", "self-test", report)
        assert any(expected in p for p in report.problems), (command, report.problems)

    good = Report()
    check_markdown("```bash\nmake test\n"
                   "python -m pretrain train --config configs/demo-cpu.toml --optim.lr=1e-3\n"
                   "for s in pre siamese; do\n"
                   "  python -m pretrain train --config X.toml --model.residual_scheme=$s\n"
                   "done\n```\n", "self-test", good)
    assert not good.problems, good.problems
    assert len(good.checked) == 4 and any(r == "placeholder" for _, r, _ in good.skipped)

    loop = Report()
    check_markdown("```bash\nfor p in configs/no-such-folder/*.toml; do\n  bash $p\ndone\n```\n",
                   "self-test", loop)
    assert any("matches no file" in p for p in loop.problems), loop.problems

    page = ROOT / "docs" / "self-test.md"
    links = check_links("[a](missing.md) [b](training.md#no-such-heading) [c](training.md)",
                        page)
    assert len(links) == 2 and "missing.md" in links[0] and "no such heading" in links[1]
    prose = Report()
    check_markdown("See `pretrain/no_such_file.py` and `test_no_such_thing.py`.\n",
                   "self-test", prose)
    assert len(prose.problems) == 2, prose.problems
