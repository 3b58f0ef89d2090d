"""Exported Hugging Face folders as ``transformers`` alone sees them.

:func:`transformers_side` loads each folder in a fresh interpreter, outside the repository and
with no PYTHONPATH, so only ``transformers`` and the folder's own files can be used, and
reports the logits of a batch, the greedy continuation of its first row and which modules of
this project got imported (there must be none).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = """
import json, sys, torch
from transformers import AutoModelForCausalLM
out = {}
for name, folder in json.loads(sys.argv[1]).items():
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True,
                                                 dtype=torch.float32).eval()
    tokens = torch.tensor(json.loads(sys.argv[2]))
    model.generation_config.eos_token_id = None  # as many tokens as ours: no stop at EOD
    with torch.no_grad():
        logits = model(tokens).logits
        greedy = model.generate(tokens[:1], max_new_tokens=int(sys.argv[3]),
                                do_sample=False)
    out[name] = {"class": type(model).__name__, "logits": logits.tolist(),
                 "greedy": greedy[0, tokens.shape[1]:].tolist()}
out["modules"] = sorted(m for m in sys.modules
                        if m.split(".")[0] in ("model", "pretrain", "kernels", "runtime"))
print(json.dumps(out))
"""


def transformers_side(folders: dict[str, Path], tokens: list, greedy: int,
                      workdir: Path) -> dict:
    """{name: {"class", "logits", "greedy"}} per folder, and "modules"."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["HF_MODULES_CACHE"] = str(workdir / "hf_modules")
    done = subprocess.run([sys.executable, "-c", SCRIPT,
                           json.dumps({k: str(v) for k, v in folders.items()}),
                           json.dumps(tokens), str(greedy)],
                          cwd=workdir, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])
