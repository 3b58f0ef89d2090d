"""Tokenizers: sentencepiece (trained here from text/JSONL) and Hugging Face ``tokenizer.json``
files (``pretrain.data.hf_tokenizer``); :func:`open_tokenizer` gives the object megatron's datasets
use for either.

Special ids are fixed: unk 0, bos 1, eos 2, pad 3. ``eos`` is the end-of-document token (EOD)
written after every document; pad gets its own id because megatron masks the loss wherever a
label equals ``tokenizer.pad`` and would otherwise fall back to a sentinel.

Training keeps text exactly as it is (identity normalisation, no whitespace folding, whitespace
runs may become pieces) and falls back to UTF-8 bytes for unseen characters, so
``decode(encode(text)) == text`` for any text. sentencepiece reads one line per training
sentence, so a newline can never be learnt from data; it is a user-defined piece instead of
being left to byte fallback, which gives it a readable piece of its own. sentencepiece's
dummy prefix stays on (a document's first word is tokenised like any other, as "▁word"), so
``decode`` of a slice that starts mid-document drops that slice's first space.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from collections.abc import Iterator
from enum import StrEnum
from pathlib import Path

import sentencepiece as spm

from pretrain.data.documents import BY_DEFAULT, Reading, check_input, iter_documents
from pretrain.data.hf_tokenizer import HFTokenizer, is_hf_tokenizer
from pretrain.paths import require_creatable, require_file
from runtime.errors import ConfigError, DataError

UNK, BOS, EOS, PAD = 0, 1, 2, 3
NEWLINE_PIECES = ["\n"]
# 256 byte-fallback pieces, the 4 special ids and the newline must fit before any learnt piece.
MIN_VOCAB_SIZE = 256 + 4 + len(NEWLINE_PIECES)
class ModelType(StrEnum):
    """sentencepiece's model types this framework trains (``train-tokenizer --model-type``)."""

    BPE = "bpe"
    UNIGRAM = "unigram"
# sentencepiece holds its training sentences in memory; above this it samples (its own advice).
MAX_TRAINING_SENTENCES = 5_000_000
# sentencepiece silently skips training sentences longer than max_sentence_length bytes, which
# would drop most of a corpus of long unbroken lines; lines are cut to fit instead (4 bytes is
# the longest UTF-8 character).
SENTENCE_CHARS = 1024

log = logging.getLogger(__name__)


def _training_sentences(document: str) -> Iterator[str]:
    """The document's lines, long ones cut at a space (kept with the next piece, where it
    belongs as "▁word") or, with no space, at the limit."""
    for line in document.split("\n"):
        while len(line) > SENTENCE_CHARS:
            cut = line.rfind(" ", 1, SENTENCE_CHARS + 1)
            cut = cut if cut > 0 else SENTENCE_CHARS
            yield line[:cut]
            line = line[cut:]
        if line:
            yield line


def _training_error(err: RuntimeError, inputs: list[str], vocab_size: int) -> str:
    """sentencepiece's message on one line, without its source location. Too small a vocabulary
    is reworded: its advice (lower character_coverage) is not an option here."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    text = text.rsplit("] ", 1)[-1]
    needed = re.search(r"smaller than required_chars\. \d+ vs (\d+)", text)
    if needed:
        return (f"tokenizer vocab_size ({vocab_size}) must be >= {needed.group(1)} for {inputs} "
                "(byte pieces, special ids and every distinct character)")
    return f"tokenizer training on {inputs} failed: {text}"


def _require_new(*paths: Path) -> None:
    for path in paths:
        if path.exists():
            raise ConfigError(f"tokenizer file '{path}' already exists; choose another --output")


def train_tokenizer(inputs: list[str], output_prefix: str, vocab_size: int,
                    model_type: str = "bpe", reading: Reading = BY_DEFAULT) -> str:
    """Train a BPE or unigram model on the documents of ``inputs``; returns the .model path.

    Writes ``<output_prefix>.model`` and ``.vocab`` under temporary names first and refuses to
    replace existing ones, so an earlier tokenizer (and data tokenised with it) stays valid.
    ``vocab_size`` is a ceiling: unigram on a small corpus may stop below it.
    """
    if model_type not in tuple(ModelType):
        raise ConfigError(f"tokenizer model_type ({model_type!r}) must be one of: "
                          f"{', '.join(ModelType)}")
    if vocab_size < MIN_VOCAB_SIZE:
        raise ConfigError(f"tokenizer vocab_size ({vocab_size}) must be >= {MIN_VOCAB_SIZE} "
                          "(256 byte pieces, 4 special ids, newline)")
    require_creatable(output_prefix, "train-tokenizer --output", folder=False)
    model_path, vocab_path = Path(f"{output_prefix}.model"), Path(f"{output_prefix}.vocab")
    _require_new(model_path, vocab_path)
    if not inputs:
        raise ConfigError("train-tokenizer needs at least one data file")
    for path in inputs:
        check_input(path, reading)
    failures: list[BaseException] = []

    def sentences() -> Iterator[str]:
        # sentencepiece turns an exception raised here into a bare RuntimeError; keep the
        # original (e.g. a DataError naming a bad JSONL line) to re-raise it unchanged.
        try:
            for path in inputs:
                for document in iter_documents(path, reading):
                    yield from _training_sentences(document)
        except BaseException as err:
            failures.append(err)
            raise

    model_path.parent.mkdir(parents=True, exist_ok=True)
    tmp_prefix = f"{output_prefix}.tmp{os.getpid()}"
    tmp_model, tmp_vocab = Path(f"{tmp_prefix}.model"), Path(f"{tmp_prefix}.vocab")
    spm.set_random_generator_seed(0)  # sampling of large corpora: same inputs, same tokenizer
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=sentences(), model_prefix=tmp_prefix, vocab_size=vocab_size,
            model_type=model_type, normalization_rule_name="identity",
            remove_extra_whitespaces=False, allow_whitespace_only_pieces=True,
            byte_fallback=True, split_digits=True, character_coverage=1.0,
            user_defined_symbols=NEWLINE_PIECES, unk_id=UNK, bos_id=BOS, eos_id=EOS,
            pad_id=PAD, hard_vocab_limit=False, input_sentence_size=MAX_TRAINING_SENTENCES,
            shuffle_input_sentence=True, max_sentence_length=4 * SENTENCE_CHARS, minloglevel=2,
        )
        _require_new(model_path, vocab_path)
        os.replace(tmp_vocab, vocab_path)
        os.replace(tmp_model, model_path)
    except RuntimeError as err:
        if failures:
            raise failures[0] from None
        raise DataError(_training_error(err, inputs, vocab_size)) from None
    finally:
        tmp_model.unlink(missing_ok=True)
        tmp_vocab.unlink(missing_ok=True)
    size = SentencePieceTokenizer(str(model_path)).vocab_size
    if size != vocab_size:
        log.warning("tokenizer %s has %d pieces (asked for %d): the corpus supports no more",
                    model_path, size, vocab_size)
    return str(model_path)


class SentencePieceTokenizer:
    """A sentencepiece model with the attributes megatron's GPTDataset reads: ``eod`` (document
    boundaries), ``pad`` (loss masking of padded labels), ``vocab_size`` (token dtype code) and
    ``unique_identifiers`` (part of the hash naming megatron's index cache). The identifier is
    the model's content hash, so moving the file keeps the cache and replacing it does not."""

    def __init__(self, model_file: str):
        path = require_file(model_file, "tokenizer", DataError)
        try:
            proto = path.read_bytes()
            self.processor = spm.SentencePieceProcessor(model_proto=proto)
        except (OSError, RuntimeError):
            raise DataError(f"tokenizer '{model_file}' is not a sentencepiece model") from None
        if self.processor.eos_id() < 0:
            raise DataError(f"tokenizer '{model_file}' has no eos piece (the end-of-document "
                              "token)")
        self.path = str(path)
        self.unique_identifiers = {"class": f"{type(self).__module__}.{type(self).__qualname__}",
                                   "model_sha256": hashlib.sha256(proto).hexdigest()}

    @property
    def vocab_size(self) -> int:
        return self.processor.get_piece_size()

    @property
    def eod(self) -> int:
        return self.processor.eos_id()

    @property
    def eos(self) -> int:
        return self.processor.eos_id()

    @property
    def bos(self) -> int:
        return self.processor.bos_id()

    @property
    def pad(self) -> int:
        """-1 for models trained elsewhere without a pad piece: megatron's own "no pad" value."""
        return self.processor.pad_id()

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, without bos/eos (EOD is appended by data preparation)."""
        return self.processor.encode(text)

    def decode(self, ids) -> str:
        """Text of ``ids`` (a list, numpy array or tensor of ints)."""
        return self.processor.decode([int(i) for i in ids])


Tokenizer = SentencePieceTokenizer | HFTokenizer


def open_tokenizer(path: str) -> Tokenizer:
    """``data.tokenizer`` / ``--tokenizer``: a sentencepiece ``.model`` file, or a Hugging Face
    ``tokenizer.json`` (or a folder holding one)."""
    return HFTokenizer(path) if is_hf_tokenizer(path) else SentencePieceTokenizer(path)
