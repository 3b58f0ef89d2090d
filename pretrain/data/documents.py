"""The documents of a data input, streamed: what ``train-tokenizer`` and ``prepare-data`` read.

An input is one of:

- a JSON-lines file (``.jsonl``, ``.json``, optionally ``.gz``): one document per line, the
  string field ``text_field`` (default "text");
- a Parquet file (``.parquet``) or an Arrow file (``.arrow``, IPC file or stream format, as
  Hugging Face ``datasets`` writes them): the string column ``text_field``, read a record batch
  at a time;
- a folder written by ``datasets``' ``save_to_disk`` (one split): its column ``text_field``,
  through ``datasets.load_from_disk``, which memory-maps the Arrow files;
- any other file (optionally ``.gz``): plain text. A ``.txt`` (or ``.text``) file is cut at
  blank lines, one document per paragraph (a book, a text dump); any other plain-text file
  (source code, markup) is one document, since a blank line inside a function or a section
  ends nothing. ``--plain-text file`` or ``paragraphs`` chooses for every plain-text input
  (:class:`Reading`), and the summary of ``prepare-data`` counts the files read each way.

An uncompressed JSON-lines file can also be read in part, a :class:`Span` of its bytes cut at
line starts: how ``prepare-data --shards`` divides one large file among its shards.

Nothing is loaded whole, so a corpus larger than memory streams through. Empty documents (a
blank line of a JSON-lines file, a line or row whose text is "") are skipped, since they would
only add a lone EOD token, and counted (:class:`Skipped`), so a summary can say how many there
were; an input that yields no document at all is an error, since it is almost always the wrong
file or field.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import NamedTuple

from pretrain.paths import require_file
from runtime.errors import DataError

BATCH_ROWS = 1024
JSON_SUFFIXES = (".jsonl", ".json")
TABLE_SUFFIXES = (".parquet", ".arrow")


class Span(NamedTuple):
    """Bytes [begin, end) of an uncompressed JSON-lines file, both line starts (or the file's
    end): one shard's part of a file too large to be a shard's whole input."""

    path: str
    begin: int
    end: int


class PlainText(StrEnum):
    """How a plain-text input becomes documents (``--plain-text``)."""

    AUTO = "auto"  # paragraphs for .txt/.text, the whole file otherwise
    FILE = "file"  # the whole file is one document
    PARAGRAPHS = "paragraphs"  # cut at blank lines


# Plain-text suffixes whose files are cut at blank lines by default (under a .gz too).
PARAGRAPH_SUFFIXES = (".txt", ".text")


@dataclass(frozen=True)
class Reading:
    """How the inputs are read: the text field or column of structured inputs, and how a
    plain-text file is cut (module docstring)."""

    text_field: str = "text"
    plain_text: PlainText = PlainText.AUTO

    def __post_init__(self) -> None:
        if self.plain_text not in tuple(PlainText):
            raise DataError(f"--plain-text ({self.plain_text!r}) must be one of: "
                            f"{', '.join(PlainText)}")
        object.__setattr__(self, "plain_text", PlainText(self.plain_text))

    def cut(self, file: Path) -> PlainText:
        """FILE or PARAGRAPHS for the plain-text ``file``."""
        if self.plain_text is not PlainText.AUTO:
            return self.plain_text
        return PlainText.PARAGRAPHS if _base_suffix(file) in PARAGRAPH_SUFFIXES \
            else PlainText.FILE


BY_DEFAULT = Reading()
"""The text field "text", plain text cut by suffix: what the commands read without options."""


def plain_text_counts(inputs: list, reading: Reading) -> dict[str, int]:
    """How many plain-text inputs were read whole and how many cut at blank lines, for the
    summary of ``prepare-data`` (empty when no input is plain text)."""
    counts = {"one_document_each": 0, "cut_at_blank_lines": 0}
    for path in inputs:
        file = Path(path.path if isinstance(path, Span) else path)
        if _is_plain_text(file):
            key = "cut_at_blank_lines" if reading.cut(file) is PlainText.PARAGRAPHS \
                else "one_document_each"
            counts[key] += 1
    return counts if any(counts.values()) else {}


def _is_plain_text(file: Path) -> bool:
    return not file.is_dir() and _base_suffix(file) not in JSON_SUFFIXES \
        and file.suffix.lower() not in TABLE_SUFFIXES


@dataclass
class Skipped:
    """The empty documents the readers passed over, counted as they go."""

    empty: int = 0


def can_cut(path: str) -> bool:
    """Whether ``path`` can be read in :class:`Span` s: a JSON-lines file, uncompressed (a
    gzip stream cannot be entered in the middle), where every line start begins a record."""
    file = Path(path)
    return (file.is_file() and file.suffix.lower() != ".gz"
            and _base_suffix(file) in JSON_SUFFIXES)


def require_data_input(path: str) -> Path:
    """Check an input early so a typo fails before minutes of work, naming it."""
    if Path(path).is_dir():
        return Path(path)
    file = require_file(path, "data file", DataError)
    if file.stat().st_size == 0:
        raise DataError(f"data file '{path}' is empty")
    return file


def _base_suffix(file: Path) -> str:
    """The format suffix, under a .gz if there is one."""
    suffixes = [s.lower() for s in file.suffixes]
    if suffixes[-1:] == [".gz"]:
        suffixes.pop()
    return suffixes[-1] if suffixes else ""


def _lines(path: str, file: Path, span: Span | None = None) -> Iterator[tuple[int, str]]:
    """(number, line) with line endings kept, of the whole file or of ``span`` (numbered from
    its first line: :func:`_line_number` makes it the file's). Read as bytes so a bad byte is
    reported with its exact line, and so "\\r" is never rewritten (the text must reach the
    tokenizer unchanged)."""
    opener = gzip.open if file.suffix.lower() == ".gz" else open
    begin, end = (span.begin, span.end) if span else (0, None)
    try:
        with opener(file, "rb") as f:
            f.seek(begin)
            at = begin
            for number, raw in enumerate(f, 1):
                if end is not None and at >= end:
                    return
                at += len(raw)
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError:
                    raise DataError(f"data file '{path}' line {_line_number(file, span, number)} "
                                    "is not UTF-8") from None
                yield number, line.removeprefix("\ufeff") if number == 1 and not begin else line
    except (gzip.BadGzipFile, EOFError):
        raise DataError(f"data file '{path}' is not a complete gzip file") from None


def _line_number(file: Path, span: Span | None, number: int) -> int:
    """Line ``number`` of ``span`` as a line of the whole file, for an error message only:
    counting the lines before the span reads them, which a shard's work never needs to."""
    if span is None or span.begin == 0:
        return number
    before = 0
    with open(file, "rb") as f:
        left = span.begin
        while left and (block := f.read(min(left, 1 << 20))):
            before += block.count(b"\n")
            left -= len(block)
    return before + number


def _json_documents(path: str, file: Path, field: str,
                    span: Span | None = None) -> Iterator[str]:
    """The text of every line; a blank line is an empty document ("", counted and skipped)."""
    for number, line in _lines(path, file, span):
        if not line.strip():
            yield ""
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        text = record.get(field) if isinstance(record, dict) else None
        if not isinstance(text, str):
            where = f"data file '{path}' line {_line_number(file, span, number)}"
            if isinstance(record, dict) and field not in record:
                keys = ", ".join(f'"{k}"' for k in list(record)[:8])
                raise DataError(f"{where} has no \"{field}\" field (its keys: {keys}); "
                                "--text-field names the field that holds the text")
            raise DataError(f"{where} is not a JSON object with a string \"{field}\" field")
        yield text


def _paragraphs(path: str, file: Path, _field: str) -> Iterator[str]:
    paragraph: list[str] = []
    for _, line in _lines(path, file):
        if line.strip():
            paragraph.append(line)
        elif paragraph:
            yield "".join(paragraph).rstrip("\r\n")
            paragraph = []
    if paragraph:
        yield "".join(paragraph).rstrip("\r\n")


def _whole_file(path: str, file: Path, _field: str) -> Iterator[str]:
    """The file's text, unchanged, as one document."""
    yield "".join(line for _, line in _lines(path, file))


def _text_column(path: str, schema, field: str) -> None:
    """Refuse a missing or non-text column (of an Arrow schema), naming what is there."""
    import pyarrow as pa

    if field not in schema.names:
        _no_column(path, field, schema.names)
    kind = schema.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)
            or pa.types.is_string_view(kind)):
        _not_text(path, field, kind)


def _no_column(path: str, field: str, names) -> None:
    raise DataError(f"data file '{path}' has no column '{field}' (--text-field); its "
                    f"columns: {', '.join(names)}")


def _not_text(path: str, field: str, kind) -> None:
    raise DataError(f"column '{field}' of data file '{path}' holds {kind}, not text "
                    "(--text-field names the text column)")


def _column_texts(path: str, columns: Iterator[list], field: str) -> Iterator[str]:
    """The texts of a column given as successive lists of values."""
    row = 0
    for values in columns:
        for text in values:
            if text is None:
                raise DataError(f"data file '{path}' row {row} has no '{field}' (null)")
            row += 1
            yield text


def _table_documents(path: str, file: Path, field: str) -> Iterator[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if file.suffix.lower() == ".parquet":
            reader = pq.ParquetFile(file)
            schema = reader.schema_arrow
            batches = reader.iter_batches(batch_size=BATCH_ROWS, columns=[field])
        else:
            source = pa.memory_map(str(file))
            try:
                reader = pa.ipc.open_file(source)
                schema = reader.schema
                batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
            except pa.ArrowInvalid:  # datasets writes the stream format
                source.seek(0)
                reader = pa.ipc.open_stream(source)
                schema, batches = reader.schema, reader
        _text_column(path, schema, field)
        yield from _column_texts(path, (b.column(field).to_pylist() for b in batches), field)
    except (pa.ArrowInvalid, OSError) as err:
        raise DataError(f"data file '{path}' is not a readable {file.suffix} file "
                        f"({str(err).splitlines()[0]})") from None


def _saved_dataset_documents(path: str, folder: Path, field: str) -> Iterator[str]:
    import datasets

    try:
        dataset = datasets.load_from_disk(str(folder))
    except FileNotFoundError:
        raise DataError(f"data folder '{path}' is not a dataset written by datasets' "
                        "save_to_disk") from None
    if isinstance(dataset, datasets.DatasetDict):
        raise DataError(f"data folder '{path}' holds the splits {', '.join(dataset)}; give "
                        f"the folder of one, e.g. '{folder / next(iter(dataset))}'")
    feature = dataset.features.get(field)
    if feature is None:
        _no_column(path, field, dataset.column_names)
    if not (isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")):
        _not_text(path, field, feature)
    # iter() follows the dataset's own row order (a shuffled or selected dataset keeps an
    # index mapping over its Arrow files)
    batches = dataset.select_columns([field]).iter(batch_size=BATCH_ROWS)
    yield from _column_texts(path, (batch[field] for batch in batches), field)


def check_input(path: str | Span, reading: Reading = BY_DEFAULT) -> None:
    """Read the first document of ``path``, so a missing file, a wrong format, field or column
    fails in one line before any work starts (and before a progress bar is drawn)."""
    documents = iter_documents(path, reading)
    next(documents)
    documents.close()


def iter_documents(path: str | Span, reading: Reading = BY_DEFAULT,
                   skipped: Skipped | None = None) -> Iterator[str]:
    """Documents of ``path`` (see the module docstring for the formats), or of a :class:`Span`
    of one, in order; the empty ones are left out and counted in ``skipped``."""
    span = path if isinstance(path, Span) else None
    path = span.path if span else path
    source = require_data_input(path)
    if source.is_dir():
        reader = _saved_dataset_documents
    elif _base_suffix(source) in JSON_SUFFIXES:
        reader = _json_documents
    elif source.suffix.lower() in TABLE_SUFFIXES:
        reader = _table_documents
    elif reading.cut(source) is PlainText.PARAGRAPHS:
        reader = _paragraphs
    else:
        reader = _whole_file
    documents = (_json_documents(path, source, reading.text_field, span) if span
                 else reader(path, source, reading.text_field))
    count = 0
    for document in documents:
        if document:
            count += 1
            yield document
        elif skipped is not None:
            skipped.empty += 1
    if count == 0:
        where = f" bytes {span.begin}-{span.end}" if span else ""
        raise DataError(f"data file '{path}'{where} has no documents")
