"""``export-hf`` from trained checkpoints: a ``pre`` one written at PP=2 becomes a Hugging Face
Llama folder, a ``siamese_hybrid`` (HybridNorm* block 0) one written at TP=2 a remote-code
folder; each loads in a fresh process with no code of this project and gives the same logits
(fp32, 1e-5) and the same 20 greedy tokens as this framework's model, with the KV cache and
without; so does a ``siamese`` one with experts written at EP=2. The exported tokenizer
reproduces the sentencepiece one. (Every scheme's mapping, with and without experts:
tests/pretrain/hf/test_hf_remote.py.)"""

import json
import re

import pytest
import sentencepiece as spm
import torch

from model.builder import build_model
from pretrain.config import load_config
from pretrain.hf.tokenizer_export import convert
from pretrain.unsharded.generate import Sampling, continue_tokens
from runtime import weights
from tests.hf_side import transformers_side
from tests.pretrain_fixtures import cli, train_args

TOKENS = [[5, 17, 300, 2, 99, 41, 7, 250], [1, 1, 8, 64, 128, 400, 3, 9]]
GREEDY = 20
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


@pytest.mark.parametrize("scheme,layout,model_class", [
    ("pre", ["--parallel.pp=2"], "LlamaForCausalLM"),
    ("siamese_hybrid", ["--parallel.tp=2", "--model.hybrid_first_block=prenorm"],
     "SiameseNormForCausalLM"),
])
def test_export_loads_in_transformers_with_the_same_logits(single_rank, data, tmp_path, scheme,
                                                          layout, model_class):
    """The checkpoint is written by two ranks, so the export also reassembles it."""
    run = tmp_path / "run"
    trained = cli(*train_args(data, run, f"--model.residual_scheme={scheme}", "--run.steps=3",
                              "--run.eval_interval=100", *layout), nproc=2)
    # two CPU ranks: none of megatron's CUDA advice (or any other warning) reaches the console
    assert not re.findall(r".*Warning.*", trained.stderr), trained.stderr[-3000:]
    out = tmp_path / "hf"
    result = json.loads(cli("export-hf", "--checkpoint", str(run / "checkpoints"),
                            "--output", str(out)).stdout.splitlines()[-1])
    assert result["output"] == str(out) and (out / "model.safetensors").is_file()
    assert (out / "tokenizer.model").is_file() and (out / "tokenizer.json").is_file()
    assert "expert" not in (out / "README.md").read_text()  # a dense model's says none
    seen = transformers_side({"export": out}, TOKENS, GREEDY, tmp_path)
    assert seen["modules"] == []  # nothing of this project was imported
    theirs = seen["export"]
    assert theirs["class"] == model_class
    ours, greedy = our_side(run)
    want = torch.tensor(theirs["logits"])
    assert ((ours - want).abs().max() / want.abs().max()).item() <= 1e-5
    assert greedy == theirs["greedy"] == theirs["greedy_nocache"]  # with and without KV cache
    assert theirs["step_rel"] <= 1e-5 and theirs["padded_step_rel"] <= 1e-5
    assert theirs["padded_rows"][1] == theirs["alone"]


def test_an_expert_parallel_moe_checkpoint_exports(single_rank, moe_run, tmp_path):
    """A siamese checkpoint with experts written by two expert-parallel ranks (each holding
    two of the four experts of every block) exports whole, trained expert bias and shared
    expert included, and gives this framework's logits and greedy tokens."""
    from safetensors.torch import load_file

    out = tmp_path / "hf"
    cli("export-hf", "--checkpoint", str(moe_run / "checkpoints"), "--output", str(out))
    tensors = load_file(str(out / "model.safetensors"))
    experts = {name.split(".mlp.experts.local_experts.")[1].split(".")[0] for name in tensors
               if ".mlp.experts.local_experts." in name}
    assert experts == {"0", "1", "2", "3"}
    # the folder's README says the experts and what a token uses (top-2 of 4: half the routed)
    total = sum(t.numel() for t in tensors.values())
    routed = sum(t.numel() for name, t in tensors.items() if ".mlp.experts.local_experts." in name)
    text = (out / "README.md").read_text()
    for words in ("a router sends each token to 2 of 4 routed experts (top-2), each an MLP of "
                  "width 64, and every token also passes through a shared expert of width 64",
                  f"Parameters: {total:,} in all, of which {routed:,} in the routed experts; "
                  f"{total - routed // 2:,} active per token"):
        assert words in text, (words, text)
    biases = [t for name, t in tensors.items() if name.endswith("router.expert_bias")]
    assert len(biases) == 2 and all(b.abs().max() > 0 for b in biases)  # moved by training
    seen = transformers_side({"export": out}, TOKENS, GREEDY, tmp_path)
    theirs = seen["export"]
    assert theirs["class"] == "SiameseNormForCausalLM"
    ours, greedy = our_side(moe_run)
    want = torch.tensor(theirs["logits"])
    assert ((ours - want).abs().max() / want.abs().max()).item() <= 1e-5
    assert greedy == theirs["greedy"] == theirs["greedy_nocache"]
    assert theirs["step_rel"] <= 1e-5 and theirs["padded_step_rel"] <= 1e-5
    assert theirs["padded_rows"][1] == theirs["alone"]


def test_the_exported_tokenizer_reproduces_sentencepiece(trained_run, data, tmp_path):
    """tokenizer.json, read by the tokenizers library alone, gives the sentencepiece ids of the
    whole training corpus, and of the special pieces' spellings written in text, and decodes
    back to the same text."""
    from tokenizers import Tokenizer as Backend

    out = tmp_path / "hf"
    cli("export-hf", "--checkpoint", str(trained_run / "checkpoints"), "--output", str(out))
    exported = Backend.from_file(str(out / "tokenizer.json"))
    processor = spm.SentencePieceProcessor(model_file=data["tokenizer"])
    documents = [json.loads(line)["text"] for line in open(data["corpus"], encoding="utf-8")]
    # every special piece's spelling, which sentencepiece reads as text
    text = "\n".join(documents) + "\n<s> </s> <unk> <pad><s></s>"
    ids = processor.encode(text)
    assert exported.encode(text, add_special_tokens=False).ids == ids
    assert exported.decode(ids, skip_special_tokens=False) == processor.decode(ids) == text
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert (config["eos_token"], config["pad_token"]) == ("</s>", "<pad>")


def test_a_unigram_tokenizer_is_not_converted(data, tmp_path):
    """Unigram's tie-breaking differs between the libraries: no tokenizer.json, a reason."""
    from pretrain.data.tokenizer import train_tokenizer

    model = train_tokenizer([data["corpus"]], str(tmp_path / "uni"), 600, "unigram")
    converted, why = convert(model)
    assert converted is None and "unigram" in why


def test_an_unknown_scheme_is_one_line(trained_run, tmp_path):
    done = cli("export-hf", "--checkpoint", str(trained_run / "checkpoints"), "--output",
               str(tmp_path / "hf"), "--model.residual_scheme=resi_dual", check=False)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "model.residual_scheme ('resi_dual') must be one of" in done.stderr
    assert not (tmp_path / "hf").exists()


def test_an_output_that_is_a_file_is_one_line(trained_run, tmp_path):
    taken = tmp_path / "taken"
    taken.write_text("x")
    done = cli("export-hf", "--checkpoint", str(trained_run / "checkpoints"), "--output",
               str(taken), check=False)
    assert done.returncode == 2 and "is not an empty folder" in done.stderr, done.stderr
    assert taken.read_text() == "x"
