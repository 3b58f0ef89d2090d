"""python -m bench.gpu_check.bundle [--out gpu-bundle] [--check-only]

Builds, on a CPU machine with PyPI, the folder a GPU run carries: exactly the wheels the GPU
machine lacks (``gpu_machine.txt``, the machine's package list): the project's requirements,
megatron-core's and wandb's, followed through every carried wheel's own requirements, each at
its requirements.lock version, for CPython 3.12 on manylinux x86_64. Then checks it (every
wheel installs on CPython 3.12 / x86_64 Linux; every requirement of every carried wheel is
carried or on the machine; the tree and the bundle fit what a run carries), writes its
manifest (the commit, since a copied tree has no .git) and prints what to carry and the
command to run. Transformer Engine is never carried: its CUDA wheel alone (276 MB) is over
the 64 MiB a run carries.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tomllib
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.tags import compatible_tags, cpython_tags
from packaging.utils import canonicalize_name, parse_wheel_filename

REPO = Path(__file__).resolve().parents[2]
MACHINE = Path(__file__).with_name("gpu_machine.txt")
CARRY_LIMIT = 64 * 2**20  # working tree + carried paths, per run
ROOTS = ("megatron-core", "wandb")  # beside the project's own requirements
# The GPU machine's interpreter and platform (Ubuntu 24.04: glibc 2.39).
MARKERS = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
           "implementation_name": "cpython", "platform_python_implementation": "CPython",
           "extra": ""}
PLATFORMS = [f"manylinux_2_{minor}_x86_64" for minor in range(39, 4, -1)] + [
    "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]
SUPPORTED = {*cpython_tags((3, 12), ["cp312"], PLATFORMS),
             *compatible_tags((3, 12), "cp312", PLATFORMS)}
SITE = "site"  # the wheels are installed into <bundle>/site on the GPU machine
COMMAND = ("python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir "
           "--upgrade --target {bundle}/" + SITE + " {bundle}/*.whl && export "
           "PYTHONPATH=$PWD/{bundle}/" + SITE + ":$PWD && timeout {limit} python3 -m "
           "bench.gpu_check --bundle {bundle}")


class BundleError(Exception):
    """A bundle that cannot be built or would not work: one line."""


def machine_packages(path: Path = MACHINE) -> dict[str, str | None]:
    """{canonical name: version or None} of the GPU machine's list."""
    found = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.strip().partition("==")
            found[canonicalize_name(name)] = version or None
    return found


def lock_versions(path: Path = REPO / "requirements.lock") -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, _, version = line.split(";")[0].strip().partition("==")
            pins[canonicalize_name(name)] = version
    return pins


def roots() -> list[Requirement]:
    """The project's requirements (pyproject.toml) and ``ROOTS``."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return [Requirement(r) for r in project["dependencies"]] + [Requirement(r) for r in ROOTS]


def wheel_requirements(wheel: Path) -> list[Requirement]:
    """The Requires-Dist of a wheel's METADATA."""
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist()
                    if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        metadata = Parser().parsestr(archive.read(name).decode())
    return [Requirement(r) for r in metadata.get_all("Requires-Dist") or []]


def needed(requirement: Requirement) -> bool:
    return requirement.marker is None or requirement.marker.evaluate(MARKERS)


def download(name: str, version: str, folder: Path) -> Path:
    """The wheel of ``name==version`` for CPython 3.12 on manylinux x86_64, from PyPI."""
    command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
               "--python-version", "3.12", "--implementation", "cp",
               "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
               "--platform", "manylinux2014_x86_64", "-d", str(folder), f"{name}=={version}"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["?"])[-1]
        raise BundleError(f"pip download {name}=={version} failed: {last}")
    return wheel_of(folder, name)


def wheel_of(folder: Path, name: str) -> Path:
    for wheel in folder.glob("*.whl"):
        if canonicalize_name(parse_wheel_filename(wheel.name)[0]) == canonicalize_name(name):
            return wheel
    raise BundleError(f"{folder}: no wheel of {name}")


def build(folder: Path) -> list[Path]:
    """Download every wheel the machine lacks, following requirements to closure."""
    machine, pins = machine_packages(), lock_versions()
    folder.mkdir(parents=True, exist_ok=True)
    queue, carried = list(roots()), {}
    while queue:
        requirement = queue.pop(0)
        name = canonicalize_name(requirement.name)
        if not needed(requirement) or name in machine or name in carried:
            continue
        if name not in pins:
            raise BundleError(f"requirements.lock: no pin for {name}, which the GPU machine "
                              f"lacks ({requirement})")
        carried[name] = download(name, pins[name], folder)
        queue += wheel_requirements(carried[name])
    return sorted(carried.values())


def check(folder: Path, tree: int) -> list[str]:
    """What is wrong with the bundle in ``folder`` (empty: nothing), carried with a working
    tree of ``tree`` bytes."""
    machine, problems, names = machine_packages(), [], {}
    wheels = sorted(folder.glob("*.whl"))
    for wheel in wheels:
        name, _, _, tags = parse_wheel_filename(wheel.name)
        if not tags & SUPPORTED:
            problems.append(f"{wheel.name}: not installable on CPython 3.12, x86_64 Linux")
        if name in names:
            problems.append(f"{wheel.name}: a second wheel of {name} ({names[name]})")
        if name in machine:
            problems.append(f"{wheel.name}: {name} is already on the GPU machine")
        names[name] = wheel.name
    for wheel in wheels:
        for requirement in filter(needed, wheel_requirements(wheel)):
            name = canonicalize_name(requirement.name)
            if name not in names and name not in machine:
                problems.append(f"{wheel.name} requires {requirement}: neither carried nor on "
                                "the GPU machine")
    carried = tree + sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    if carried > CARRY_LIMIT:
        problems.append(f"tree + bundle {carried / 2**20:.1f} MiB, over the "
                        f"{CARRY_LIMIT / 2**20:.0f} MiB a run carries")
    return problems


def tree_bytes() -> int:
    """Bytes of the working tree a run copies: tracked files and untracked, unignored ones."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=REPO, capture_output=True, text=True, check=True).stdout
    paths = (REPO / p for p in listed.split("\0") if p)
    return sum(p.stat().st_size for p in paths if p.is_file())


def manifest(folder: Path) -> dict:
    """What the bundle holds, and the commit of the tree it was built for."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                          text=True).stdout.strip() or None
    changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                             capture_output=True, text=True).stdout.strip()
    wheels = [{"file": w.name, "name": parse_wheel_filename(w.name)[0],
               "version": str(parse_wheel_filename(w.name)[1]), "bytes": w.stat().st_size}
              for w in sorted(folder.glob("*.whl"))]
    dated = re.search(r"date: (\S+)", MACHINE.read_text())
    return {"commit": head, "tree_changed": bool(changed), "wheels": wheels,
            "wheel_bytes": sum(w["bytes"] for w in wheels), "tree_bytes": tree_bytes(),
            "machine_list": dated.group(1) if dated else None}


def command(folder: Path, limit: int) -> str:
    return COMMAND.format(bundle=folder.as_posix(), limit=limit)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("gpu-bundle"),
                   help="the bundle folder, relative to the repository (git-ignored)")
    p.add_argument("--check-only", action="store_true", help="check an existing bundle")
    p.add_argument("--limit", type=int, default=540,
                   help="seconds the GPU command may run (its timeout)")
    args = p.parse_args(argv)
    folder = args.out if args.out.is_absolute() else REPO / args.out
    try:
        if not args.check_only:
            build(folder)
        problems = check(folder, tree_bytes())
    except BundleError as err:
        print(f"bench.gpu_check.bundle: {err}", file=sys.stderr)
        return 2
    if problems:
        print("\n".join(f"bench.gpu_check.bundle: {p}" for p in problems), file=sys.stderr)
        return 2
    built = manifest(folder)
    (folder / "manifest.json").write_text(json.dumps(built, indent=1) + "\n")
    relative = folder.relative_to(REPO) if folder.is_relative_to(REPO) else folder
    print(f"{len(built['wheels'])} wheels, {built['wheel_bytes'] / 2**20:.1f} MiB; tree "
          f"{built['tree_bytes'] / 2**20:.1f} MiB; commit {built['commit']}"
          + (" (tree changed)" if built["tree_changed"] else ""))
    for wheel in built["wheels"]:
        print(f"  {wheel['file']} ({wheel['bytes'] / 2**20:.2f} MiB)")
    print(f"carry: [\"{relative.as_posix()}\"]")
    print(f"command: {command(relative, args.limit)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
