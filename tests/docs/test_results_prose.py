"""The docs say what was measured, on which device, date and commit, and what is not measured
yet; not how the project's own development comes by GPU time, which a reader cannot use and
which goes stale (README's GPU section once explained that instead of its numbers)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
         *sorted((ROOT / "docs" / "results").glob("*.md"))]
# How GPU time reached the developers: lent machines, loans, sessions, their minutes.
DEVELOPMENT = re.compile(r"\blent\b|\bloans?\b|\bby chance\b|\b15 minutes\b|"
                         r"this project's machines|\bsome sessions\b", re.IGNORECASE)


def test_no_page_explains_how_gpus_reach_the_project():
    found = [f"{page.relative_to(ROOT)}:{number}: {line.strip()}"
             for page in PAGES
             for number, line in enumerate(page.read_text().splitlines(), 1)
             if DEVELOPMENT.search(line)]
    assert not found, "\n".join(found)


def test_the_gpu_section_names_device_date_and_commit():
    """README's GPU table is introduced by what it holds, and its generated block states the
    device, date, versions and commit of the measurement (bench.gpu_check.docs_tables)."""
    readme = (ROOT / "README.md").read_text()
    block = readme[readme.index("<!-- gpu-results: readme-targets -->"):]
    first = block.splitlines()[1]
    assert re.match(r"Newest GPU results: \d{4}-\d{2}-\d{2}, .+, torch .+, commit ", first), first
    section = readme[readme.index("**Speed and memory targets on one H100**"):]
    assert "not yet measured on a GPU" in section[:section.index("<!-- gpu-results")]
