"""Exported Hugging Face folders as ``transformers`` alone sees them.

:func:`transformers_side` runs this file in a fresh interpreter, outside the repository and
with no PYTHONPATH, so only ``transformers`` and each folder's own files can be used. Per
folder it reports the logits of a batch and what ``generate`` makes of it, greedily, with the
KV cache and without (the model re-reading the whole prefix every step):

- ``greedy``: 20 tokens continuing the batch's first row with the cache; ``greedy_nocache``
  the same without; ``step_rel``: the largest relative difference between the two paths'
  logits at any step;
- ``padded``: a left-padded batch (a long prompt and a short one) generated together, with
  and without the cache, and the short prompt alone: ``padded_rows`` / ``padded_nocache_rows``
  / ``alone`` tokens and ``padded_step_rel``;
- ``bf16``: each weight's dtype when the folder is loaded in bf16, and ``bf16_kept``: the
  modules its model keeps in fp32 then (``_keep_in_fp32_modules_strict``);
- ``tokenizer``: where the folder has a tokenizer.json, the ids of :data:`TEXT` by
  ``AutoTokenizer`` (with ``trust_remote_code=True``, as the folder's README says) and by
  ``PreTrainedTokenizerFast`` (no remote code at all), and their classes; the ids of
  :data:`PROMPT` + :data:`CONTINUATION`, and the continuation decoded by the line of the
  folder's README.md that says how (run as written) and as a slice alone;

which modules of this project got imported (there must be none), and every warning
transformers logged (``warnings``).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

PAD = 3
TEXT = ("In the beginning God created the heaven and the earth.\n  Two spaces. The special "
        "pieces' spellings are text: <s> </s> <unk> <pad>.")
# A prompt and the continuation a model would add, which starts with spaces (an indented line):
# decoded as the folder's README says (the whole, less the decoded prompt) and, for contrast,
# as the slice alone, which loses the space its first piece starts with.
PROMPT, CONTINUATION = "def f(n):\n", "    return n + 1\n"


def isolated(python: str, args: list[str], workdir: Path, **env) -> subprocess.CompletedProcess:
    """``python -I ARGS`` in ``workdir``: neither PYTHONPATH nor the script's folder reaches
    its sys.path, so it imports only what its venv holds; remote code is cached in
    ``workdir``."""
    return subprocess.run([python, "-I", *args], cwd=workdir, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=900, env={**os.environ,
                                            "HF_MODULES_CACHE": str(workdir / "hf_modules"),
                                            **env})


def transformers_side(folders: dict[str, Path], tokens: list, greedy: int,
                      workdir: Path) -> dict:
    """{name: {...}} per folder (see the module docstring), "modules" and "transformers"
    (its version). The interpreter is ``$HF_SIDE_PYTHON`` when set (a venv holding another
    transformers release: ``make test-hf-versions``), else this one."""
    python = os.environ.get("HF_SIDE_PYTHON") or sys.executable
    done = isolated(python, [str(Path(__file__).resolve()),
                             json.dumps({k: str(v) for k, v in folders.items()}),
                             json.dumps(tokens), str(greedy)], workdir)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def _generate(model, tokens, mask, steps: int, use_cache: bool):
    """(new tokens [b, steps], logits [steps, b, vocab]) of greedy decoding."""
    out = model.generate(tokens, attention_mask=mask, max_new_tokens=steps, do_sample=False,
                         use_cache=use_cache, output_logits=True, return_dict_in_generate=True,
                         pad_token_id=PAD)
    return out.sequences[:, tokens.shape[1]:], torch.stack(out.logits)


def _rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _check(folder: str, tokens, steps: int) -> dict:
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True,
                                                 dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # as many tokens as ours: no stop at EOD
    first = tokens[:1]
    long, short = tokens[0, :8], tokens[1, :3]
    pads = len(long) - len(short)
    padded = torch.stack([long, torch.cat([torch.full((pads,), PAD), short])])
    mask = torch.ones_like(padded)
    mask[1, :pads] = 0
    with torch.no_grad():
        logits = model(tokens).logits
        cached, cached_logits = _generate(model, first, torch.ones_like(first), steps, True)
        plain, plain_logits = _generate(model, first, torch.ones_like(first), steps, False)
        rows, rows_logits = _generate(model, padded, mask, steps, True)
        rows_plain, rows_plain_logits = _generate(model, padded, mask, steps, False)
        alone, _ = _generate(model, short[None], torch.ones_like(short[None]), steps, True)
    half = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True,
                                                dtype=torch.bfloat16)
    return {"class": type(model).__name__, "logits": logits.tolist(),
            "bf16": {name: str(p.dtype) for name, p in half.named_parameters()},
            "bf16_kept": list(getattr(half, "_keep_in_fp32_modules_strict", None) or []),
            "greedy": cached[0].tolist(), "greedy_nocache": plain[0].tolist(),
            "step_rel": _rel(cached_logits, plain_logits),
            "padded_rows": rows.tolist(), "padded_nocache_rows": rows_plain.tolist(),
            "padded_step_rel": _rel(rows_logits, rows_plain_logits),
            "alone": alone[0].tolist(), "tokenizer": _tokenizer(folder)}


def _tokenizer(folder: str) -> dict | None:
    if not (Path(folder) / "tokenizer.json").is_file():
        return None
    auto = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    fast = PreTrainedTokenizerFast.from_pretrained(folder)
    ids = fast(PROMPT + CONTINUATION)["input_ids"]
    cut = len(fast(PROMPT)["input_ids"])
    # the folder's README's own line for the text a model added after n prompt tokens
    advice = next(line for line in (Path(folder) / "README.md").read_text().splitlines()
                  if line.startswith("added = "))
    scope = {"tokenizer": fast, "out": torch.tensor([ids]), "n": cut}
    exec(advice, scope)
    return {"auto": auto(TEXT)["input_ids"], "fast": fast(TEXT)["input_ids"],
            "classes": [type(auto).__name__, type(fast).__name__],
            "continuation": scope["added"], "slice": fast.decode(ids[cut:]), "cut": cut,
            "ids": ids}


class _Collected(logging.Handler):
    """Every record of transformers' loggers at WARNING and above."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def main(folders: str, tokens: str, steps: str):
    import transformers

    collected = _Collected()
    logging.getLogger("transformers").addHandler(collected)
    batch = torch.tensor(json.loads(tokens))
    out = {name: _check(folder, batch, int(steps))
           for name, folder in json.loads(folders).items()}
    out["warnings"] = collected.messages
    out["modules"] = sorted(m for m in sys.modules
                            if m.split(".")[0] in ("model", "pretrain", "kernels", "runtime"))
    out["transformers"] = transformers.__version__
    print(json.dumps(out))


if __name__ == "__main__":
    main(*sys.argv[1:])
