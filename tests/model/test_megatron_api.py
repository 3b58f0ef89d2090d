"""What the model takes from megatron-core's ``GPTModel``, held against the installed version.

megatron-core deprecates ``GPTModel`` in favour of ``HybridModel`` (docs/layout.md, "megatron-core's
GPTModel deprecation"). The day a megatron-core without it (or with another one) is installed,
these tests fail with what to do, instead of an ImportError at collection or, worse, a model
that silently stops rotating by position id (``HybridModel`` has no ``_preprocess``, so
``GPT``'s override of it would never run). They check megatron's classes and a built model,
never our own code against itself: the keywords ``build_model`` passes are read from its source.
"""

from __future__ import annotations

import ast
import inspect
from importlib.metadata import version
from pathlib import Path

import pytest
import torch

from tests.docs.test_commands import anchors
from tests.helpers import MBS, SEQ, VOCAB, tiny_model

ROOT = Path(__file__).resolve().parents[2]
SECTION = "docs/layout.md#megatron-cores-gptmodel-deprecation"


def advice(what: str) -> str:
    return (f"megatron-core {version('megatron-core')} no longer gives what model/gpt.py takes "
            f"from GPTModel: {what}. See {SECTION}: give GPT our own LanguageModule base with the "
            "same children and names (its first migration step), or keep megatron-core at the "
            "version pinned in pyproject.toml until then.")


def gpt_model():
    try:
        from megatron.core.models.gpt import GPTModel
    except ImportError as err:
        pytest.fail(advice(f"megatron.core.models.gpt.GPTModel does not import ({err})"))
    return GPTModel


def build(scheme: str, **kwargs):
    """The one chunk of a tiny model, built as training builds it."""
    gpt_model()
    try:
        from model.builder import build_model
        from model.config import ParallelConfig

        torch.manual_seed(0)
        [chunk] = build_model(tiny_model(scheme), ParallelConfig(), **kwargs)
    except Exception as err:  # any failure here is the API having moved
        pytest.fail(advice(f"building a {scheme} model failed: {type(err).__name__}: {err}"))
    return chunk


def builder_keywords() -> set[str]:
    """The keywords ``model/builder.py`` passes to ``GPT(...)``, but GPT's own."""
    tree = ast.parse((ROOT / "model" / "builder.py").read_text())
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call)
             and isinstance(node.func, ast.Name) and node.func.id == "GPT"]
    assert len(calls) == 1, "model/builder.py: expected one GPT(...) call"
    from model.gpt import GPT

    own = set(inspect.signature(GPT.__init__).parameters) - {"self", "args", "kwargs"}
    return {k.arg for k in calls[0].keywords} - own


def test_the_section_failures_name_exists():
    assert SECTION.partition("#")[2] in anchors((ROOT / "docs" / "layout.md").read_text())


def test_gpt_model_takes_every_keyword_the_builder_passes():
    parameters = inspect.signature(gpt_model().__init__).parameters
    passed = builder_keywords()
    assert {"config", "transformer_layer_spec", "vp_stage"} <= passed  # the parse found them
    missing = sorted(passed - set(parameters))
    if missing:
        pytest.fail(advice(f"GPTModel.__init__ takes no {', '.join(missing)}"))


def test_gpt_model_forward_rotates_through_preprocess(single_rank, device, monkeypatch):
    """``GPT`` overrides ``_preprocess``: forward must call it, and its second output must be
    the rotary table [s, 1, 1, d] that the override gathers per token into [s, b, 1, d]."""
    if not hasattr(gpt_model(), "_preprocess"):
        pytest.fail(advice("GPTModel has no _preprocess (rotary by position id hooks it)"))
    chunk = build("siamese", positions_per_token=True)
    outputs = []
    original = chunk._preprocess

    def recorded(*args, **kwargs):
        outputs.append(original(*args, **kwargs))
        return outputs[-1]

    monkeypatch.setattr(chunk, "_preprocess", recorded)
    tokens = torch.randint(0, VOCAB, (MBS, SEQ), device=device)
    positions = torch.stack([torch.arange(SEQ), torch.arange(SEQ) % (SEQ // 2)]).to(device)
    labels = torch.randint(0, VOCAB, (MBS, SEQ), device=device)
    with torch.no_grad():
        logits = chunk(tokens, positions, None)
        loss = chunk(tokens, positions, None, labels=labels)
    if not outputs:
        pytest.fail(advice("GPTModel.forward no longer calls self._preprocess"))
    rotary = outputs[0][1]
    if not (torch.is_tensor(rotary) and rotary.shape[:3] == (SEQ, MBS, 1)):
        pytest.fail(advice("_preprocess's second output is no longer the rotary table "
                           f"[s, 1, 1, d] (per token: {getattr(rotary, 'shape', rotary)})"))
    # Row 0 counts 0..s-1, so its angles are the table's; row 1 restarts halfway.
    assert torch.equal(rotary[:, 1], rotary[positions[1], 0])
    assert logits.shape[:2] == (MBS, SEQ), advice(f"logits are {tuple(logits.shape)}, not "
                                                  "[b, s, v]")
    assert loss.shape == (MBS, SEQ), advice(f"the loss is {tuple(loss.shape)}, not per token "
                                            "[b, s]")


def test_checkpoint_names_are_gpt_models(single_rank):
    """The names checkpoints, the Hugging Face export and the seeded init read: GPTModel's
    module tree, a TransformerBlock that stacks alike blocks, no output-layer extra state."""
    from megatron.core.transformer.transformer_block import TransformerBlock

    from model.init import local_tensors

    chunk = build("siamese")
    if not isinstance(chunk.decoder, TransformerBlock):
        pytest.fail(advice(f"the decoder is a {type(chunk.decoder).__name__}, not a "
                           "TransformerBlock"))
    keys = {(t.key, t.prepend_axis_num) for t in local_tensors(chunk)}
    expected = {("embedding.word_embeddings.weight", 0), ("output_layer.weight", 0),
                ("decoder.final_layernorm.x_norm.weight", 0),
                ("decoder.layers.attn_post_norm.weight", 1)}  # stacked: one block axis
    if not expected <= keys:
        pytest.fail(advice(f"checkpoint keys changed: {sorted(expected - keys)} are gone"))
    extra = [k for k in chunk.sharded_state_dict() if k.startswith("output_layer._extra_state")]
    if extra:
        pytest.fail(advice("GPTModel's sharded state dict keeps output_layer._extra_state"))
