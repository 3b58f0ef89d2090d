"""The tokenizer files of an exported Hugging Face folder.

A Hugging Face tokenizer is copied as it is. A sentencepiece model is copied as
``tokenizer.model`` and, when it is a BPE model, also converted into a ``tokenizer.json``
that ``tokenizers`` (and ``AutoTokenizer``) read without sentencepiece: pieces and settings
are read from the model file and rebuilt as the same algorithm (:func:`convert`), a
``tokenizers`` BPE whose merges are every split of every piece into two pieces, ranked by the
merged piece's id: sentencepiece's rule (merge the adjacent pair whose union scores highest).
The conversion is checked on :data:`PROBE` text (ids and decoded text must equal
sentencepiece's). A model it cannot reproduce (unigram: its Viterbi ties on runs of repeated
characters are broken differently by the two libraries) gets no ``tokenizer.json`` and a
warning, never a tokenizer that silently tokenises differently.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from pretrain.data.hf_tokenizer import is_hf_tokenizer
from pretrain.data.tokenizer import Tokenizer

log = logging.getLogger("pretrain")

PROBE = (
    "The quick brown fox jumps over the lazy dog.  Two  spaces,\ttabs\tand\n\nnewlines.\n"
    "Numbers 1234567890 and 3.14159; mixed: abc123def, 1,000,000.\n"
    "Ünïcödé: café, naïve, Straße, Ελληνικά, русский, 中文字符, 日本語, 한국어, emoji 🙂🚀.\n"
    "   leading spaces, trailing spaces   \n"
    "Punctuation!? (brackets) [square] {curly} <angle> \"quotes\" 'single' -- dashes -- ...\n"
    "In the beginning God created the heaven and the earth.\n"
    "Special pieces' spellings are text: <s> </s> <unk> <pad> <s></s>.\n"
)
_HF_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# sentencepiece's ModelProto piece types
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _BYTE = 1, 2, 3, 4, 6
_BPE = 2


def write_tokenizer(path: str, tokenizer: Tokenizer, output: Path) -> None:
    """Put the tokenizer of ``path`` into the exported folder ``output``."""
    source = Path(path)
    if is_hf_tokenizer(path):
        folder = source if source.is_dir() else source.parent
        for name in _HF_FILES:
            if (folder / name).is_file():
                shutil.copy(folder / name, output / name)
        if not source.is_dir():
            shutil.copy(source, output / "tokenizer.json")
        return
    shutil.copy(source, output / "tokenizer.model")
    converted, why = convert(path)
    if converted is None:
        log.warning("export-hf: %s not converted to tokenizer.json (%s); the folder has "
                    "tokenizer.model only", path, why)
        return
    converted.save(str(output / "tokenizer.json"))
    (output / "tokenizer_config.json").write_text(json.dumps(
        tokenizer_config(tokenizer), indent=2))


def _piece(tokenizer: Tokenizer, token_id: int) -> str | None:
    return tokenizer.processor.id_to_piece(token_id) if token_id >= 0 else None


def tokenizer_config(tokenizer: Tokenizer) -> dict:
    """tokenizer_config.json: the fast tokenizer class and the special tokens; no BOS/EOS
    added on encode (as in training, where EOD is appended per document)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": _piece(tokenizer, tokenizer.processor.unk_id()),
        "bos_token": _piece(tokenizer, tokenizer.bos),
        "eos_token": _piece(tokenizer, tokenizer.eos),
        "pad_token": _piece(tokenizer, tokenizer.pad),
        "add_bos_token": False, "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        # the special tokens' spellings in text are text, as sentencepiece reads them
        "split_special_tokens": True,
    }


def _proto(path: str):
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(Path(path).read_bytes())
    return proto


def _bpe_merges(vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every (left, right) whose union is a piece, in the order sentencepiece merges them:
    the union's id (its score rank) first, then the left part's id."""
    merges = []
    for piece, piece_id in vocab.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                merges.append((piece_id, vocab[left], vocab[right], left, right))
    merges.sort()
    return [(left, right) for *_, left, right in merges]


def convert(path: str):
    """(``tokenizers.Tokenizer`` equal to the sentencepiece model at ``path``, None), or
    (None, why not)."""
    import sentencepiece as spm
    from tokenizers import Regex, decoders, models, normalizers
    from tokenizers import Tokenizer as Backend

    proto = _proto(path)
    trainer, spec = proto.trainer_spec, proto.normalizer_spec
    pieces = [(p.piece, p.score, p.type) for p in proto.pieces]
    unk = next((i for i, (_, _, kind) in enumerate(pieces) if kind == _UNKNOWN), 0)
    if trainer.model_type != _BPE:
        # Unigram's Viterbi has exact ties on runs of repeated characters, which tokenizers and
        # sentencepiece break differently (seen on real text): no faithful conversion.
        return None, "only BPE models convert faithfully (unigram breaks ties differently)"
    vocab = {piece: i for i, (piece, _, _) in enumerate(pieces)}
    mergeable = {piece: i for piece, i in vocab.items() if pieces[i][2] == _NORMAL}
    model = models.BPE(vocab, _bpe_merges(mergeable), unk_token=pieces[unk][0],
                       fuse_unk=True, byte_fallback=trainer.byte_fallback)
    backend = Backend(model)
    steps = []
    if spec.precompiled_charsmap:
        steps.append(normalizers.Precompiled(spec.precompiled_charsmap))
    if spec.remove_extra_whitespaces:
        steps += [normalizers.Strip(left=True, right=True),
                  normalizers.Replace(Regex(" {2,}"), " ")]
    if spec.add_dummy_prefix:  # always, even before a leading space (unlike Metaspace)
        steps.append(normalizers.Prepend("▁"))
    backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(" ", 1, 0)] if spec.add_dummy_prefix else []))
    # sentencepiece never reads a control piece's spelling ("<s>") in text as that piece;
    # an added token would be matched in text before the model sees it, so none is added
    # (the special tokens are named in tokenizer_config.json, with split_special_tokens).
    processor = spm.SentencePieceProcessor(model_file=path)
    for line in PROBE.splitlines(keepends=True) + [PROBE]:
        want, got = processor.encode(line), backend.encode(line, add_special_tokens=False).ids
        if want != got:
            return None, f"ids differ on {line[:40]!r}"
        if backend.decode(got, skip_special_tokens=False) != processor.decode(want):
            return None, f"decoding differs on {line[:40]!r}"
    return backend, None
