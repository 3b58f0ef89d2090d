"""python -m lab.docs_tables [--write]
python -m lab.docs_tables --publish RUN_DIR [--seeds DIR ...] [--date YYYY-MM-DD] [--kind cpu-moe]

The CPU sweep's tables in README.md and docs/lab.md, generated from the newest dated results
file ``docs/sweep/cpu-YYYY-MM-DD.csv`` and its seed check ``cpu-seeds-YYYY-MM-DD.csv``, so no
sweep figure in the docs stands without the file (and the commit) it came from. Each table sits
between ``<!-- sweep-results: NAME -->`` and ``<!-- /sweep-results -->``; ``--write`` replaces
them, without it the script exits 1 if a page is out of date (tests/lab/test_docs_tables.py
holds them equal).

``--publish`` makes those dated files from finished sweeps: RUN_DIR's ``results.csv`` as
``cpu-DATE.csv`` (every row carries its cell's seed and commit), the cells of the ``--seeds``
sweeps (the same preset cells run with other seeds) together with the same-named cells of
RUN_DIR as ``cpu-seeds-DATE.csv``, and RUN_DIR's two plots, then rewrites the tables.
``--kind cpu-moe`` publishes the mixture-of-experts sweep (configs/sweep/cpu-moe.toml) the same
way, as ``cpu-moe-DATE.csv`` and ``cpu-moe-seeds-DATE.csv`` with its plots prefixed
``cpu-moe-``; its table (main grid and seeds in one) is generated from those files.
``--kind cpu-muon`` and ``--kind cpu-dyt`` publish the Muon and the Dynamic Tanh sweeps
(configs/sweep/cpu-muon.toml, cpu-dyt.toml) alike; each table sets their cells beside the dense
sweep's AdamW and RMSNorm cells of the same schemes.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import shutil
import statistics
import sys
from pathlib import Path

from lab.report import COLUMNS, best_row, cell_text, scheme_key, slice_table, slices
from model.schemes import ResidualScheme
from runtime.markdown import markdown_table, refresh_docs

REPO = Path(__file__).resolve().parent.parent
SWEEP_DOCS = REPO / "docs" / "sweep"
DOCS = [REPO / "README.md", REPO / "docs" / "lab.md"]
PLOTS = ("val_loss_vs_lr.png", "loss_curves.png")
NUMBERS = {"layers": int, "warmup": int, "lr": float, "final_val_loss": float, "seed": int}


KINDS = ("cpu", "cpu-moe", "cpu-muon", "cpu-dyt")
"""The published sweeps: the dense CPU sweep, the mixture-of-experts one, the Muon one and the
Dynamic Tanh one."""


def newest(kind: str, required: bool = True) -> Path | None:
    files = sorted(SWEEP_DOCS.glob(f"{kind}-????-??-??.csv"))
    if not files:
        if not required:
            return None
        raise SystemExit(f"lab.docs_tables: no {kind}-YYYY-MM-DD.csv in {SWEEP_DOCS}")
    return files[-1]


def read_rows(path: Path) -> list[dict]:
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        for key, kind in NUMBERS.items():
            if row.get(key) not in (None, ""):
                row[key] = kind(float(row[key])) if kind is int else kind(row[key])
    return rows


def main_slice(rows: list[dict]) -> tuple[dict, list[dict]]:
    """The LR slice with the most cells: the sweep's main grid."""
    return max(slices(rows, "lr", 1), key=lambda fixed_rows: len(fixed_rows[1]))


def depth_table(rows: list[dict]) -> str:
    parts = []
    for fixed, subset in slices(rows, "layers"):
        table = slice_table(subset, "layers")
        losses = {(r["scheme"], r["layers"]): r["final_val_loss"] for r in subset
                  if r["status"] == "ok"}
        depths = sorted({r["layers"] for r in subset})
        if all(("pre", d) in losses and ("siamese", d) in losses for d in depths):
            gaps = [f"{losses['pre', d] - losses['siamese', d]:.3f}" for d in depths]
            table += "\n| gap (pre - siamese) | " + " | ".join(gaps) + " |"
        parts.append(f"lr {fixed['lr']:g}, warm-up {fixed['warmup']}:\n\n{table}")
    return "\n\n".join(parts) or "(no depth grid)"


def warmup_table(rows: list[dict]) -> str:
    parts = [f"lr {fixed['lr']:g}, {fixed['layers']} blocks:\n\n"
             + slice_table(subset, "warmup", bold_best=True)
             for fixed, subset in slices(rows, "warmup")]
    return "\n\n".join(parts) or "(no warm-up grid)"


def seeds_table(rows: list[dict]) -> str:
    """Final validation loss per seed of every cell run with more than one seed."""
    cells: dict[tuple, dict[int, dict]] = {}
    for row in rows:
        cells.setdefault((row["scheme"], row["layers"], row["lr"], row["warmup"]), {})[
            row["seed"]] = row
    seeds = sorted({row["seed"] for row in rows})
    table = []
    for (scheme, _layers, lr, _warmup), by_seed in sorted(
            cells.items(), key=lambda kv: (kv[0][2], scheme_key(kv[0][0]), kv[0][1])):
        losses = [r["final_val_loss"] for r in by_seed.values() if r["status"] == "ok"]
        spread = f"{max(losses) - min(losses):.3f}" if len(losses) > 1 else ""
        mean = f"{statistics.fmean(losses):.3f}" if losses else ""
        table.append([scheme, f"{lr:g}", *(cell_text(by_seed.get(s)) for s in seeds), mean,
                      spread])
    return markdown_table(["scheme", "lr", *(f"seed {s}" for s in seeds), "mean", "spread"],
                          table, right_from=1)


def _commits(rows: list[dict]) -> str:
    """"commit `abc1234`", or "commits ..." when cells started from different ones."""
    commits = sorted({r.get("commit", "")[:7] for r in rows} - {""})
    if not commits:
        return "commit not recorded"
    return ("commit " if len(commits) == 1 else "commits ") + ", ".join(f"`{c}`" for c in commits)


def blocks(rows: list[dict], name: str, seed_rows: list[dict], seeds_name: str) -> dict:
    """NAME -> generated text; README links are from the root, docs/ links one up."""
    fixed, subset = main_slice(rows)
    source = (f"From [{name}](docs/sweep/{name}) ({len(rows)} cells, {_commits(rows)}); "
              f"{fixed['layers']} blocks, warm-up {fixed['warmup']}:\n\n")
    lr = source + slice_table(subset, "lr", bold_best=True,
                              every=tuple(s.value for s in ResidualScheme))
    return {"readme-lr": lr, "lab-lr": lr.replace("](docs/sweep/", "](sweep/"),
            "lab-warmup": warmup_table(rows), "lab-depth": depth_table(rows),
            "lab-seeds": f"From [{seeds_name}](sweep/{seeds_name}) ({_commits(seed_rows)}):"
                         f"\n\n{seeds_table(seed_rows)}"}


def moe_block(rows: list[dict], name: str, seed_rows: list[dict], seeds_name: str) -> str:
    """The MoE sweep's main grid and its seed check, as lab.md shows them."""
    fixed, subset = main_slice(rows)
    return (f"From [{name}](sweep/{name}) ({len(rows)} cells, {_commits(rows)}); "
            f"{fixed['layers']} blocks, warm-up {fixed['warmup']}:\n\n"
            f"{slice_table(subset, 'lr', bold_best=True)}\n\n"
            f"Seeds, from [{seeds_name}](sweep/{seeds_name}) ({_commits(seed_rows)}):\n\n"
            f"{seeds_table(seed_rows)}")


def beside_block(rows: list[dict], name: str, seed_rows: list[dict], seeds_name: str,
                 base_rows: list[dict], base_name: str, labels: tuple[str, str],
                 column: str) -> str:
    """A sweep's main grid (``labels[1]``) beside the dense sweep's cells of the same schemes,
    depth and warm-up (``labels[0]``), each one's best in bold, in a table whose second column
    is ``column``; then the sweep's seed check, where it has one."""
    fixed, cells = main_slice(rows)
    schemes = sorted({r["scheme"] for r in cells}, key=scheme_key)
    base = [r for r in base_rows if r["scheme"] in schemes and r["layers"] == fixed["layers"]
            and r["warmup"] == fixed["warmup"]]
    lrs = sorted({r["lr"] for r in cells + base})
    table = []
    for scheme in schemes:
        for label, source in zip(labels, (base, cells), strict=True):
            lookup = {r["lr"]: r for r in source if r["scheme"] == scheme}
            best = best_row(source)
            table.append([scheme, label, *(
                f"**{cell_text(lookup.get(lr))}**" if lookup.get(lr) is best and best
                else cell_text(lookup.get(lr)) for lr in lrs)])
    text = (f"{labels[1]} from [{name}](sweep/{name}) ({len(rows)} cells, {_commits(rows)}), "
            f"{labels[0]} from [{base_name}](sweep/{base_name}); {fixed['layers']} blocks, "
            f"warm-up {fixed['warmup']}, each one's best in bold:\n\n"
            + markdown_table(["scheme", column, *(f"lr {lr:g}" for lr in lrs)], table,
                             right_from=2))
    if seed_rows:
        text += (f"\n\n{labels[1]}'s seeds, from [{seeds_name}](sweep/{seeds_name}) "
                 f"({_commits(seed_rows)}):\n\n{seeds_table(seed_rows)}")
    return text


BESIDE = {"cpu-muon": ("lab-muon", ("AdamW", "Muon"), "optimizer"),
          "cpu-dyt": ("lab-dyt", ("RMSNorm", "DyT"), "normalization")}
"""The sweeps shown beside the dense CPU sweep: their table's name, the two rows' labels (the
dense sweep's, theirs) and the column that tells them apart."""


def publish(run_dir: Path, seed_dirs: list[Path], date: str, kind: str = "cpu") -> None:
    rows = read_rows(run_dir / "results.csv")
    seed_rows = [r for d in seed_dirs for r in read_rows(d / "results.csv")]
    names = {r["name"] for r in seed_rows}
    seed_rows = [r for r in rows if r["name"] in names] + seed_rows
    for name, found in ((kind, rows), (f"{kind}-seeds", seed_rows)):
        with (SWEEP_DOCS / f"{name}-{date}.csv").open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(found)
    prefix = "" if kind == "cpu" else f"{kind}-"
    for plot in PLOTS:
        if (run_dir / plot).is_file():
            shutil.copyfile(run_dir / plot, SWEEP_DOCS / f"{prefix}{plot}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--write", action="store_true", help="rewrite the docs' tables")
    p.add_argument("--publish", type=Path, help="a finished sweep's folder (--out)")
    p.add_argument("--seeds", type=Path, nargs="*", default=[],
                   help="finished seed-check sweeps' folders")
    p.add_argument("--date", default=datetime.date.today().isoformat())
    p.add_argument("--kind", choices=KINDS, default="cpu",
                   help="which sweep --publish publishes (default: the dense CPU sweep)")
    args = p.parse_args(argv)
    if args.publish:
        for folder in (args.publish, *args.seeds):
            if not (folder / "results.csv").is_file():
                p.error(f"'{folder / 'results.csv'}' does not exist: not a finished sweep")
        publish(args.publish, args.seeds, args.date, args.kind)
    path, seeds = newest("cpu"), newest("cpu-seeds")
    generated = blocks(read_rows(path), path.name, read_rows(seeds), seeds.name)
    moe, moe_seeds = newest("cpu-moe", required=False), newest("cpu-moe-seeds", required=False)
    if moe is not None and moe_seeds is not None:
        generated["lab-moe"] = moe_block(read_rows(moe), moe.name, read_rows(moe_seeds),
                                         moe_seeds.name)
    for kind, (block, labels, column) in BESIDE.items():
        found, seeds_found = newest(kind, required=False), newest(f"{kind}-seeds",
                                                                   required=False)
        if found is not None and seeds_found is not None:
            generated[block] = beside_block(read_rows(found), found.name,
                                            read_rows(seeds_found), seeds_found.name,
                                            read_rows(path), path.name, labels, column)
    return refresh_docs(DOCS, "sweep-results", generated, path.name,
                        args.write or bool(args.publish))


if __name__ == "__main__":
    sys.exit(main())
