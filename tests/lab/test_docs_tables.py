"""The sweep's tables in README.md and docs/lab.md: generated from the newest dated results
files, held equal to them, and built right from a small hand-written results file."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from lab import docs_tables
from lab.report import COLUMNS
from model.schemes import ResidualScheme
from runtime.markdown import fill_blocks


def test_docs_match_the_newest_results_files(capsys):
    assert docs_tables.main([]) == 0, capsys.readouterr().out


def _row(scheme, lr, loss, status="ok", layers=12, warmup=15, seed=1234, commit="abcdef0123"):
    return {"name": f"{scheme}-L{layers}-lr{lr:g}-wu{warmup}", "grid": "g", "scheme": scheme,
            "layers": layers, "lr": lr, "warmup": warmup, "status": status,
            "final_val_loss": loss, "seed": seed, "commit": commit}


ROWS = [_row("pre", 2e-3, 5.1), _row("pre", 6e-3, 4.9), _row("post", 2e-3, 4.8),
        _row("post", 6e-3, 5.99, "collapsed"), _row("siamese", 2e-3, 4.85),
        _row("siamese", 6e-3, 4.5),
        _row("pre", 6e-3, 4.8, layers=4), _row("siamese", 6e-3, 4.4, layers=4),
        _row("pre", 6e-3, 5.0, warmup=0), _row("siamese", 6e-3, 4.6, warmup=0)]


def _write(path: Path, rows: list[dict]) -> Path:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    return path


def test_tables_from_a_hand_written_file(tmp_path):
    rows = docs_tables.read_rows(_write(tmp_path / "cpu-2026-01-01.csv", ROWS))
    seeds = [_row("pre", 6e-3, 4.9), _row("pre", 6e-3, 4.7, seed=2),
             _row("siamese", 6e-3, 4.5), _row("siamese", 6e-3, 4.4, seed=2, commit="fedcba9")]
    made = docs_tables.blocks(rows, "cpu-2026-01-01.csv", docs_tables.read_rows(
        _write(tmp_path / "s.csv", seeds)), "s.csv")
    lines = made["readme-lr"].splitlines()
    assert lines[0] == ("From [cpu-2026-01-01.csv](docs/sweep/cpu-2026-01-01.csv) (10 cells, "
                        "commit `abcdef0`); 12 blocks, warm-up 15:")
    ran = {"pre": "| pre | 5.100 | 4.900 |", "post": "| post | 4.800 | collapsed (5.990) |",
           "siamese": "| siamese | 4.850 | **4.500** |"}
    # every registered scheme has its row: one registered after the sweep ran says so, and
    # needs no sweep run to pass the tests that hold the README's table to the registry
    assert lines[2:] == ["| scheme | lr 0.002 | lr 0.006 |", "| --- | ---: | ---: |", *(
        ran.get(s.value, f"| {s.value} | not run | not run |") for s in ResidualScheme)]
    assert "](sweep/cpu-2026-01-01.csv)" in made["lab-lr"]
    assert made["lab-depth"].splitlines()[-1] == "| gap (pre - siamese) | 0.400 | 0.400 |"
    assert "| pre | 5.000 | 4.900 |" in made["lab-warmup"]  # warm-up 0, then 15
    assert "| siamese | **4.500** |" not in made["lab-warmup"]
    assert "| siamese | **4.600** | 4.500 |" not in made["lab-warmup"]
    assert "| siamese | 4.600 | **4.500** |" in made["lab-warmup"]
    seed_lines = made["lab-seeds"].splitlines()
    assert "(commits `abcdef0`, `fedcba9`)" in seed_lines[0]
    assert seed_lines[2] == "| scheme | lr | seed 2 | seed 1234 | mean | spread |"
    assert seed_lines[4:] == ["| pre | 0.006 | 4.700 | 4.900 | 4.800 | 0.200 |",
                              "| siamese | 0.006 | 4.400 | 4.500 | 4.450 | 0.100 |"]


def test_publish_writes_dated_files_and_fills_the_pages(tmp_path, monkeypatch):
    run, seed2 = tmp_path / "run", tmp_path / "seed2"
    run.mkdir(), seed2.mkdir()
    _write(run / "results.csv", ROWS)
    _write(seed2 / "results.csv", [_row("pre", 6e-3, 4.7, seed=2)])
    (run / "val_loss_vs_lr.png").write_bytes(b"png")
    docs = tmp_path / "docs"
    docs.mkdir()
    page = docs / "page.md"
    page.write_text("a\n<!-- sweep-results: lab-seeds -->\nold\n<!-- /sweep-results -->\nb\n")
    monkeypatch.setattr(docs_tables, "SWEEP_DOCS", docs)
    monkeypatch.setattr(docs_tables, "DOCS", [page])
    assert docs_tables.main(["--publish", str(run), "--seeds", str(seed2),
                             "--date", "2026-01-02"]) == 0
    published = list(csv.DictReader((docs / "cpu-2026-01-02.csv").open()))
    assert len(published) == len(ROWS) and published[0]["commit"] == "abcdef0123"
    seeds = list(csv.DictReader((docs / "cpu-seeds-2026-01-02.csv").open()))
    assert [(r["scheme"], r["seed"]) for r in seeds] == [("pre", "1234"), ("pre", "2")]
    assert (docs / "val_loss_vs_lr.png").read_bytes() == b"png"
    text = page.read_text()
    assert "old" not in text and "| pre | 0.006 | 4.700 | 4.900 | 4.800 | 0.200 |" in text
    assert docs_tables.main([]) == 0  # now up to date
    page.write_text(text.replace("4.800 | 0.200", "4.801 | 0.200"))
    assert docs_tables.main([]) == 1  # a hand edit is caught


def test_a_block_no_generator_knows_is_an_error():
    with pytest.raises(SystemExit, match="unknown block 'lab-nothing'"):
        fill_blocks("<!-- sweep-results: lab-nothing -->\nx\n<!-- /sweep-results -->",
                    "sweep-results", {})
