"""``export-hf``: a ``pre`` checkpoint (written at PP=2) becomes a Hugging Face Llama
folder that ``transformers`` loads in a fresh process with no code of this project, with the
same logits (fp32, 1e-5) and the same 20 greedy tokens as this framework's model."""

import json
import os
import subprocess
import sys

import torch

from model.builder import build_model
from pretrain.config import load_config
from pretrain.generate import Sampling, continue_tokens
from runtime import weights
from tests.pretrain_fixtures import cli, train_args

TOKENS = [[5, 17, 300, 2, 99, 41, 7, 250], [1, 1, 8, 64, 128, 400, 3, 9]]
GREEDY = 20
# Runs in a fresh interpreter, outside the repository, with no PYTHONPATH: only
# transformers and the exported folder.
HF_SIDE = """
import json, sys, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
tokens = torch.tensor(json.loads(sys.argv[2]))
model.generation_config.eos_token_id = None  # 20 tokens, as ours: no stop at EOD
with torch.no_grad():
    logits = model(tokens).logits
    greedy = model.generate(tokens[:1], max_new_tokens=int(sys.argv[3]),
                            do_sample=False)
print(json.dumps({"logits": logits.tolist(), "greedy": greedy[0, tokens.shape[1]:].tolist(),
                  "modules": sorted(m for m in sys.modules if m.split(".")[0] in
                                    ("model", "pretrain", "kernels", "runtime"))}))
"""


def transformers_side(folder, tmp_path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", HF_SIDE, str(folder), json.dumps(TOKENS),
                           str(GREEDY)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def our_side(run) -> tuple[torch.Tensor, list[int]]:
    config = load_config(str(run / "config.toml"), [], training=False)
    [model] = build_model(config.model, type(config.parallel)(), seed=1)
    weights.load([model], str(sorted((run / "checkpoints").glob("step_*"))[-1]))
    model.eval()
    tokens = torch.tensor(TOKENS)
    with torch.no_grad():
        logits = model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None)
    greedy = continue_tokens(model, TOKENS[0], Sampling(max_tokens=GREEDY),
                             config.model.vocab_size, config.model.seq_length, None)
    return logits[..., :config.model.vocab_size], greedy


def test_export_loads_in_transformers_with_the_same_logits(single_rank, data, tmp_path):
    """The checkpoint is written by two pipeline stages, so the export also reassembles it."""
    run = tmp_path / "run"
    cli(*train_args(data, run, "--model.residual_scheme=pre", "--run.steps=3",
                    "--run.eval_interval=100", "--parallel.pp=2"), nproc=2)
    out = tmp_path / "hf"
    result = json.loads(cli("export-hf", "--checkpoint", str(run / "checkpoints"),
                            "--output", str(out)).stdout.splitlines()[-1])
    assert result["output"] == str(out) and (out / "model.safetensors").is_file()
    assert (out / "tokenizer.model").is_file()
    theirs = transformers_side(out, tmp_path)
    assert theirs["modules"] == []  # nothing of this project was imported
    ours, greedy = our_side(run)
    want = torch.tensor(theirs["logits"])
    assert ((ours - want).abs().max() / want.abs().max()).item() <= 1e-5
    assert greedy == theirs["greedy"]


def test_other_schemes_are_refused_in_one_line(trained_run, tmp_path):
    run = trained_run  # siamese
    done = cli("export-hf", "--checkpoint", str(run / "checkpoints"), "--output",
               str(tmp_path / "hf"), check=False)
    assert done.returncode == 2, done.stderr
    assert "model.residual_scheme (siamese)" in done.stderr and done.stderr.count("\n") == 1
    assert not (tmp_path / "hf").exists()


def test_an_output_that_is_a_file_is_one_line(trained_run, tmp_path):
    taken = tmp_path / "taken"
    taken.write_text("x")
    done = cli("export-hf", "--checkpoint", str(trained_run / "checkpoints"), "--output",
               str(taken), check=False)
    assert done.returncode == 2 and "is not an empty folder" in done.stderr, done.stderr
    assert taken.read_text() == "x"
