"""A Hugging Face Llama checkpoint as run.init_from of a ``pre`` model.

The Llama model is built and saved by ``transformers`` itself (random weights, norms moved
off 1); loaded into this framework's ``pre`` model, the logits must equal transformers' own
forward, single-process and under TP=2 x PP=2 on gloo; a CLI run starts from it; a Llama of
another shape is refused in one line naming the differences.
"""

import json
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from model.builder import build_model
from model.config import ParallelConfig
from pretrain.hf import llama as hf_llama
from runtime.errors import CheckpointError
from tests.helpers import batches, spawn, tiny_model
from tests.parity_worker import MICROBATCHES, run_llama_import
from tests.pretrain_fixtures import cli, train_args

VOCAB = 100  # tests.helpers' batches: vocabulary 100, 16 tokens, micro-batches of 2


def llama_config(**changes) -> LlamaConfig:
    fields = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                  rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
                  attention_bias=False, mlp_bias=False, hidden_act="silu")
    fields.update(changes)
    return LlamaConfig(**fields)


def saved_llama(folder, **changes) -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config(**changes)).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.3 * torch.randn_like(param))
    model.save_pretrained(str(folder), safe_serialization=True)
    return model


def ours(**changes):
    """The matching pre model; no vocabulary padding (100 is a multiple of 4), so the loss is
    the Llama's exactly (padded ids would add zero logits to the softmax)."""
    fields = dict(vocab_size=VOCAB, num_layers=4, hidden_size=32, num_attention_heads=4,
                  num_query_groups=2, ffn_hidden_size=64, make_vocab_size_divisible_by=4)
    fields.update(changes)
    scheme = fields.pop("residual_scheme", "pre")
    return tiny_model(scheme, **fields)


TOKENS = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))


def test_logits_equal_transformers(single_rank, device, tmp_path):
    hf = saved_llama(tmp_path)
    [model] = build_model(ours(), ParallelConfig(), seed=9)
    hf_llama.load([model], str(tmp_path), ours())
    positions = torch.arange(16).expand_as(TOKENS)
    with torch.no_grad():
        got = model(TOKENS.to(device), positions.to(device), None).cpu()
        want = hf(TOKENS).logits
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-5


@pytest.mark.slow
def test_tp2_pp2_import_gives_transformers_loss(tmp_path):
    """Under TP=2 x PP=2 (gloo) every rank takes its slice: the mean loss of the parity
    batches equals transformers' on the same tokens."""
    hf = saved_llama(tmp_path / "llama")
    spawn(4, run_llama_import, str(tmp_path / "llama"), ours(), str(tmp_path))
    got = json.loads((tmp_path / "loss.json").read_text())
    with torch.no_grad():
        want = sum(torch.nn.functional.cross_entropy(
            hf(b["tokens"].cpu()).logits.flatten(0, 1), b["labels"].cpu().flatten()).item()
            for b in batches(MICROBATCHES)) / MICROBATCHES
    assert abs(got - want) <= 1e-5 * abs(want), (got, want)


def test_another_shape_is_refused_naming_every_difference(tmp_path):
    saved_llama(tmp_path, hidden_size=64, num_key_value_heads=4)
    with pytest.raises(CheckpointError) as err:
        hf_llama.check(str(tmp_path), ours())
    text = str(err.value)
    assert "model.hidden_size (32 here, 64 there)" in text
    assert "model.num_query_groups (2 here, 4 there)" in text
    with pytest.raises(CheckpointError, match="model.residual_scheme"):
        hf_llama.check(str(tmp_path), ours(residual_scheme="siamese", hidden_size=64,
                                           num_query_groups=4))


def test_a_model_with_experts_is_neither_a_llama_nor_filled_from_one(tmp_path):
    """A Llama's MLPs are dense: a ``pre`` model with experts exports with the remote code
    (tests/pretrain/hf/test_hf_remote.py), and takes no Llama as run.init_from (one line,
    before any tensor is read)."""
    saved_llama(tmp_path)
    assert hf_llama.is_llama(ours()) and not hf_llama.is_llama(ours(num_experts=4))
    hf_llama.check(str(tmp_path), ours())
    with pytest.raises(CheckpointError) as err:
        hf_llama.check(str(tmp_path), ours(num_experts=4))
    assert str(err.value).endswith("holds another model: model.num_experts (4 here, 0 there)")


def test_a_run_starts_from_a_llama_folder(data, tmp_path):
    """The CLI: train from a Llama saved by transformers with the test run's shape and a zero
    output layer, so its logits are all 0 and its first validation loss is ln(vocabulary)
    exactly, which a fresh model's is not."""
    folder = tmp_path / "llama"
    hf = saved_llama(folder, vocab_size=512, hidden_size=64, intermediate_size=128,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                     max_position_embeddings=32)
    with torch.no_grad():
        hf.lm_head.weight.zero_()
    hf.save_pretrained(str(folder), safe_serialization=True)
    run = tmp_path / "run"
    cli(*train_args(data, run, "--model.residual_scheme=pre", "--run.steps=3",
                    "--run.eval_interval=100", f"--run.init_from={folder}"))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    first = next(r["val_loss"] for r in rows if "val_loss" in r)
    assert first == pytest.approx(math.log(512), abs=1e-5)
