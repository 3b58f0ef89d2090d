"""Hugging Face tokenizers (a ``tokenizer.json``, or a folder holding one), offline.

The official SiameseNorm runs tokenise with GPT-NeoX-20B's tokenizer, a ``tokenizers`` BPE
file; this reads such a file with the ``tokenizers`` library (no network, no ``transformers``)
and gives it the attributes megatron's datasets and this framework use, like the
sentencepiece tokenizer beside it: ``eod``, ``pad``, ``vocab_size``, ``unique_identifiers``,
``encode`` and ``decode``.

The end-of-document token is the folder's ``tokenizer_config.json`` ``eos_token`` when there is
one, else the first of the usual names that the vocabulary holds (``<|endoftext|>`` for GPT-2
and GPT-NeoX, ``</s>``, ``<|end_of_text|>``, ``<eos>``); a tokenizer with none is refused.
``encode`` adds no special tokens (data preparation appends EOD itself).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from pretrain.paths import require_file
from runtime.errors import DataError

EOD_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")
PAD_NAMES = ("<pad>", "<|padding|>", "[PAD]")


def is_hf_tokenizer(path: str) -> bool:
    """Whether ``path`` names a HF tokenizer (a .json file or a folder) rather than a
    sentencepiece model."""
    return Path(path).is_dir() or path.endswith(".json")


def _special(value) -> str | None:
    """A tokenizer_config.json special token: a string or {"content": ...}."""
    return value.get("content") if isinstance(value, dict) else value


class HFTokenizer:
    def __init__(self, path: str):
        from tokenizers import Tokenizer as Backend

        given = Path(path)
        file = given / "tokenizer.json" if given.is_dir() else given
        if given.is_dir() and not file.is_file():
            raise DataError(f"tokenizer '{path}' is a folder without a tokenizer.json (a "
                            "tokenizer is a sentencepiece .model file, a Hugging Face "
                            "tokenizer.json, or a folder holding one)")
        if not file.is_file():
            require_file(file, "tokenizer", DataError)
        blob = file.read_bytes()
        try:
            self.backend = Backend.from_str(blob.decode())
        except Exception:  # the library raises its own exception type for any bad file
            raise DataError(f"tokenizer '{path}' is not a Hugging Face tokenizer.json") from None
        config_file = file.parent / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        self.eod = self._find(path, _special(config.get("eos_token")), EOD_NAMES,
                              "end-of-document token (eos_token)")
        pad = self._find(path, _special(config.get("pad_token")), PAD_NAMES, None)
        self.pad = -1 if pad is None else pad  # megatron's own "no pad" value
        self.path = str(file)
        self.unique_identifiers = {"class": f"{type(self).__module__}.{type(self).__qualname__}",
                                   "model_sha256": hashlib.sha256(blob).hexdigest()}

    def _find(self, path: str, named: str | None, usual: tuple[str, ...],
              required: str | None) -> int | None:
        for token in ([named] if named else []) + list(usual):
            found = self.backend.token_to_id(token)
            if found is not None:
                return found
        if required:
            raise DataError(f"tokenizer '{path}' has no {required}: none of "
                            f"{', '.join(([named] if named else []) + list(usual))}")
        return None

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def eos(self) -> int:
        return self.eod

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, without special tokens."""
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=False)
