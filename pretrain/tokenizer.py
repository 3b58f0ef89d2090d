"""sentencepiece tokenizers: training from text/JSONL, and the object megatron's datasets use.

Special ids are fixed: unk 0, bos 1, eos 2, pad 3. ``eos`` is the end-of-document token (EOD)
written between documents. Training uses identity normalisation, keeps whitespace as is and
falls back to bytes, so ``decode(encode(text)) == text`` for any UTF-8 text.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import sentencepiece as spm

from model.config import ConfigError

UNK, BOS, EOS, PAD = 0, 1, 2, 3


def _existing_file(path: str) -> Path:
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"data file '{path}' does not exist")
    if file.stat().st_size == 0:
        raise ConfigError(f"data file '{path}' is empty")
    return file


def iter_documents(path: str) -> Iterator[str]:
    """Documents of a .jsonl/.json-lines file (the "text" field of each line) or of a text
    file (paragraphs separated by blank lines)."""
    file = _existing_file(path)
    if file.suffix in (".jsonl", ".json"):
        with file.open(encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    text = json.loads(line).get("text")
                except (json.JSONDecodeError, AttributeError):
                    text = None
                if not isinstance(text, str):
                    raise ConfigError(f"data file '{path}' line {number} is not a JSON object "
                                      "with a string \"text\" field")
                yield text
        return
    paragraph: list[str] = []
    with file.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                paragraph.append(line)
            elif paragraph:
                yield "".join(paragraph).rstrip("\n")
                paragraph = []
    if paragraph:
        yield "".join(paragraph).rstrip("\n")


def train_tokenizer(inputs: list[str], output_prefix: str, vocab_size: int,
                    model_type: str = "bpe") -> str:
    """Train a BPE or unigram model on the documents of ``inputs``; returns the .model path."""
    model_path = Path(f"{output_prefix}.model")
    if model_path.exists():
        raise ConfigError(f"tokenizer '{model_path}' already exists; choose another --output")
    if vocab_size < 32:
        raise ConfigError(f"tokenizer vocab_size ({vocab_size}) must be >= 32")
    if model_type not in ("bpe", "unigram"):
        raise ConfigError(f"tokenizer model_type ({model_type!r}) must be bpe or unigram")
    for path in inputs:
        _existing_file(path)

    def sentences() -> Iterator[str]:
        for path in inputs:
            for doc in iter_documents(path):
                yield from (line for line in doc.split("\n") if line)

    model_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=sentences(), model_prefix=output_prefix, vocab_size=vocab_size,
            model_type=model_type, normalization_rule_name="identity",
            remove_extra_whitespaces=False, byte_fallback=True, split_digits=True,
            character_coverage=1.0, allow_whitespace_only_pieces=True,
            user_defined_symbols=["\n", "\t"], unk_id=UNK, bos_id=BOS, eos_id=EOS,
            pad_id=PAD, hard_vocab_limit=False, minloglevel=2,
        )
    except RuntimeError as err:
        raise ConfigError(f"tokenizer training failed: {str(err).splitlines()[0]}") from None
    return str(model_path)


class Tokenizer:
    """A trained sentencepiece model, shaped as megatron's GPTDataset expects (``eod``,
    ``pad``, ``vocab_size``, ``unique_identifiers``)."""

    def __init__(self, model_file: str):
        path = Path(model_file)
        if not path.is_file():
            raise ConfigError(f"tokenizer '{model_file}' does not exist")
        self.processor = spm.SentencePieceProcessor()
        try:
            self.processor.Load(str(path))
        except (OSError, RuntimeError):
            raise ConfigError(f"tokenizer '{model_file}' is not a sentencepiece model") from None
        self.unique_identifiers = {"class": type(self).__name__, "model": str(path.resolve())}

    @property
    def vocab_size(self) -> int:
        return self.processor.GetPieceSize()

    @property
    def eod(self) -> int:
        return self.processor.eos_id()

    @property
    def pad(self) -> int:
        return self.processor.pad_id()

    def encode(self, text: str) -> list[int]:
        return self.processor.EncodeAsIds(text)

    def decode(self, ids: list[int]) -> str:
        return self.processor.DecodeIds(list(ids))
