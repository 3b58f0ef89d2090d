"""What a tokenizer ``train-tokenizer`` just trained does with its own input: the summary it
prints, so that a vocabulary too small for the corpus, or a script the corpus has but the
vocabulary lacks, shows before any data is prepared with it.

- **pieces**: the vocabulary's size, split into what was learnt from the input and what every
  tokenizer here holds (256 byte pieces, the special ids, the newline);
- **coverage**: the share of the input's characters that have a piece of their own; the rest
  are written as UTF-8 byte pieces (byte fallback: nothing is lost, but one character costs
  up to 4 tokens). A character is either in the vocabulary as a piece, and then never falls
  back, or it is not, and then always does: the share is counted per character, exactly;
- **bytes per token**: the input's UTF-8 bytes over the tokens it encodes to, one document at
  a time as ``prepare-data`` encodes them, without the end-of-document token each document
  gets; and characters per token.

Measured on the first :data:`SAMPLE_CHARS` characters of the inputs (an equal share of each),
which is the whole input of a small corpus; the line says which.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from pretrain.data.documents import Reading, iter_documents
from pretrain.data.tokenizer import NEWLINE_PIECES, SentencePieceTokenizer

SAMPLE_CHARS = 2_000_000
"""Characters measured at most (a few seconds of encoding)."""
MISSING_SHOWN = 5
"""Characters without a piece named in the summary, the most frequent first."""
SPACE = "\u2581"  # sentencepiece's piece for a space


@dataclass(frozen=True)
class TokenizerSummary:
    path: str
    pieces: int
    bytes_pieces: int
    special: int
    fixed: int
    """User-defined pieces (the newline)."""
    characters: int
    whole: bool
    """Whether the characters measured are the whole input."""
    covered: int
    missing: tuple[str, ...]
    utf8_bytes: int
    tokens: int

    @property
    def learnt(self) -> int:
        return self.pieces - self.bytes_pieces - self.special - self.fixed

    def lines(self) -> list[str]:
        """The summary, two lines."""
        coverage = self.covered / self.characters if self.characters else float("nan")
        sample = (f"all of it, {self.characters:,} characters" if self.whole else
                  f"a sample: its first {self.characters:,} characters")
        rest = (f"; the rest fall back to UTF-8 byte pieces (most frequent: "
                f"{', '.join(repr(c) for c in self.missing)})" if self.missing else "")
        per_token = (f"{self.utf8_bytes / self.tokens:.2f} bytes "
                     f"({self.characters / self.tokens:.2f} characters) per token"
                     if self.tokens else "no token")
        return [f"tokenizer {self.path}: {self.pieces:,} pieces: {self.learnt:,} learnt from the "
                f"input, {self.bytes_pieces} byte pieces, {self.special} special, "
                f"{self.fixed} newline",
                f"on the input ({sample}): {per_token}; {coverage:.2%} of the characters have "
                f"a piece of their own{rest}"]


def _sample(inputs: list[str], reading: Reading) -> tuple[list[str], bool]:
    """The first documents of each input, up to an equal share of :data:`SAMPLE_CHARS` (the
    last one cut to fit); whether that is all of them."""
    share = SAMPLE_CHARS // max(len(inputs), 1)
    documents, whole = [], True
    for path in inputs:
        left = share
        for document in iter_documents(path, reading):
            if left <= 0:  # a document beyond the share
                whole = False
                break
            documents.append(document[:left])
            left -= len(documents[-1])
            if len(documents[-1]) < len(document):
                whole = False
                break
    return documents, whole


def summarize(model_path: str, inputs: list[str], reading: Reading) -> TokenizerSummary:
    """The summary of the tokenizer at ``model_path`` on the documents of ``inputs``."""
    processor = SentencePieceTokenizer(model_path).processor
    size = processor.get_piece_size()
    kinds = Counter("byte" if processor.is_byte(i) else
                    "special" if processor.is_control(i) or processor.is_unknown(i) else
                    "fixed" if processor.id_to_piece(i) in NEWLINE_PIECES else "learnt"
                    for i in range(size))
    documents, whole = _sample(inputs, reading)
    counts = Counter()
    for document in documents:
        counts.update(document)
    unknown = processor.unk_id()
    missing = Counter({c: n for c, n in counts.items()
                       if processor.piece_to_id(SPACE if c == " " else c) == unknown})
    tokens = sum(len(ids) for ids in processor.encode(documents)) if documents else 0
    return TokenizerSummary(
        path=model_path, pieces=size, bytes_pieces=kinds["byte"], special=kinds["special"],
        fixed=kinds["fixed"], characters=sum(counts.values()), whole=whole,
        covered=sum(counts.values()) - sum(missing.values()),
        missing=tuple(c for c, _ in missing.most_common(MISSING_SHOWN)),
        utf8_bytes=sum(len(d.encode("utf-8")) for d in documents), tokens=tokens)
