"""Whether a tokenizer gives back the text it encodes: ``decode(encode(text)) == text``.

A model trained on a lossy tokenizer's ids can never write what the tokenizer dropped: a
Hugging Face BPE with a whitespace pre-tokenizer turns ``def f(n):`` into ``def f ( n ):``,
lowercasing or Unicode normalisation rewrite text, and none of it shows as an error, only as a
model that cannot reproduce its own corpus. So ``prepare-data`` decodes back a sample of the
documents it reads (the first :data:`SAMPLE`) and refuses a tokenizer that loses any of
them, unless ``--allow-lossy-tokenizer`` says the loss is wanted; the dataset's record keeps
that choice (``lossy_tokenizer``). A training start checks the tokenizer on :data:`PROBE`
(code, indentation, Unicode) and refuses a lossy one unless every dataset it reads was
prepared with that allowance. sentencepiece models from ``train-tokenizer`` (identity
normalisation, byte fallback) and byte-level BPEs are lossless and pass both.
"""

from __future__ import annotations

SAMPLE = 64
"""Documents decoded back at preparation (their tokenisation is done anyway)."""

PROBE = (
    "def walk(top, *, follow=False):\n"
    "    \"\"\"Every file under top.\"\"\"\n"
    "\tfor folder, _, names in os.walk(top):  # two  spaces\n"
    "        yield from (os.path.join(folder, n) for n in names)\n"
    "\n"
    "Prose, too: café, naïve, Straße, Ελληνικά, русский, 中文, emoji 🙂; x = [1, 2]; a->b.\n"
)
"""What a training start checks a tokenizer on: code, tabs, runs of spaces, Unicode."""

CONTEXT = 24


def loss(tokenizer, text: str) -> str | None:
    """Where ``decode(encode(text))`` first differs from ``text``, shown in context (None:
    it gives the text back)."""
    back = tokenizer.decode(tokenizer.encode(text))
    if back == text:
        return None
    at = next((i for i, (a, b) in enumerate(zip(text, back, strict=False)) if a != b),
              min(len(text), len(back)))
    start = max(0, at - CONTEXT // 2)
    return (f"{text[start:at + CONTEXT]!r} decodes as {back[start:at + CONTEXT]!r} "
            f"(character {at})")
