"""Every scheme exports to a Hugging Face folder that computes what this framework computes.

Each case builds a tiny model with every weight moved off its initial value (norm weights,
gates and hyper-connection weights included, so a misplaced one shows), writes its folder
with ``export-hf``'s writer, and compares, in one fresh interpreter that imports only
``transformers`` (no PYTHONPATH, outside the repository): logits (fp32, max rel 1e-5) and 20
greedy tokens, generated with the KV cache and without it, against this framework's own
full-recompute greedy decoding (and each step's logits of the two transformers paths, 1e-5),
and a left-padded batch against its prompts alone. ``pre`` with RMSNorm/SwiGLU/RoPE is a
native Llama; the rest are remote code. Every scheme is checked again with experts in its
blocks (megatron's MoE layer; 6 greedy tokens each, :data:`MOE_CASES`). ``make
test-hf-versions`` runs the transformers side on the oldest and the newest supported release.
"""

import contextlib
import dataclasses
import importlib.util
import inspect
import json
import shutil
import sys
import tomllib
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from kernels import normalizations
from model import builder
from model.builder import build_model
from model.config import MOE_FIELDS, ModelConfig, ParallelConfig
from model.schemes import ResidualScheme
from pretrain.data.tokenizer import open_tokenizer
from pretrain.hf import export as hf_export
from pretrain.hf.export import write_folder
from pretrain.hf.remote.configuration_siamesenorm import NORMALIZATIONS as REMOTE_NORMALIZATIONS
from pretrain.hf.remote.configuration_siamesenorm import SCHEMES as REMOTE_SCHEMES
from pretrain.hf.remote.configuration_siamesenorm import SUPPORTED_TRANSFORMERS as SUPPORTED
from pretrain.hf.remote.configuration_siamesenorm import SiameseNormConfig
from pretrain.unsharded.generate import Sampling, continue_tokens
from runtime.errors import ConfigError
from tests.helpers import tiny_model
from tests.hf_side import isolated, transformers_side

ROOT = Path(__file__).resolve().parents[3]
GREEDY = 20
MOE_GREEDY = 6
"""Greedy tokens of the MoE cases: enough to decode through the cache, fewer to keep them
cheap."""
CASES = {
    "pre-llama": ("pre", {}),
    "pre-gelu-learned-layernorm-bias-tied": (
        "pre", {"activation": "gelu", "position_embedding": "learned_absolute",
                "normalization": "layernorm", "norm_bias": True, "add_bias_linear": True,
                "untie_embeddings_and_output_weights": False}),
    "post": ("post", {}),
    "siamese": ("siamese", {}),
    "siamese-ablations-layernorm": ("siamese", {"siamese_input_norm": False,
                                                "siamese_depth_constant": False,
                                                "normalization": "layernorm"}),
    "siamese_hybrid": ("siamese_hybrid", {}),
    "siamese_hybrid-prenorm": ("siamese_hybrid", {"hybrid_first_block": "prenorm"}),
    "siamese_hybrid-prenorm_literal": ("siamese_hybrid",
                                       {"hybrid_first_block": "prenorm_literal"}),
    "deepnorm": ("deepnorm", {}),
    "hybridnorm": ("hybridnorm", {}),
    "hybridnorm-prenorm": ("hybridnorm", {"hybrid_first_block": "prenorm"}),
    "mixln": ("mixln", {"mixln_post_ratio": 0.5}),
    "hc": ("hc", {}),
    "hc-static": ("hc", {"hc_dynamic": False, "hc_rate": 2}),
    "periln": ("periln", {}),
    "olmo2": ("olmo2", {}),
    "mhc": ("mhc", {"hc_rate": 3, "mhc_sinkhorn_iterations": 7}),
    # Dynamic Tanh in a plain block, and in the two-stream one with the gate, Q/K/V head norms
    # and the merge
    "pre-dyt": ("pre", {"normalization": "dyt", "dyt_alpha": 0.8}),
    "siamese_hybrid-dyt": ("siamese_hybrid", {"normalization": "dyt"}),
}
# Mixture of experts, one case per scheme and two more, together covering what routes a token
# (softmax and sigmoid scores, the softmax before the top k (pre-softmax) at k = 1 and 2, k = 1
# (softmax needs pre-softmax there) and more, the expert bias), what computes it (experts
# narrower than the dense MLP, GELU experts with biases, the shared expert and its gate) and
# which blocks are MoE (all of them, stacked in the checkpoint; every k-th; a 0/1 list)
SOFTMAX = {"num_experts": 4, "moe_router_topk": 2}
SIGMOID = {**SOFTMAX, "moe_router_score_function": "sigmoid"}
BIASED = {**SIGMOID, "moe_router_enable_expert_bias": True}
SHARED = {"moe_shared_expert_intermediate_size": 48}
GATE = "moe_shared_expert_gate"
"""Not a model field (megatron's shared-expert gate, which this framework's config does not
set): :func:`perturbed_model` turns it on in megatron's config, to check the export of
``gate_weight``."""
MOE_CASES = {
    "pre-moe": ("pre", {**SOFTMAX, **SHARED, "moe_ffn_hidden_size": 48}),
    "post-moe": ("post", {**SIGMOID, "moe_router_topk": 1, "moe_layer_freq": 2}),
    "siamese-moe": ("siamese", {**BIASED, **SHARED, GATE: True}),
    "siamese_hybrid-moe": ("siamese_hybrid", {**SOFTMAX, "moe_layer_freq": [0, 1, 1, 0]}),
    "deepnorm-moe": ("deepnorm", {**BIASED, "moe_router_topk": 1}),
    "hybridnorm-moe": ("hybridnorm", {**SOFTMAX, "num_experts": 8, "moe_router_topk": 3}),
    "mixln-moe": ("mixln", {**SOFTMAX, "mixln_post_ratio": 0.5}),
    "hc-moe": ("hc", {**BIASED, **SHARED, "moe_layer_freq": 2}),
    "periln-moe": ("periln", {**SOFTMAX, "activation": "gelu", "add_bias_linear": True,
                              "normalization": "layernorm", "norm_bias": True}),
    "olmo2-moe": ("olmo2", {**SIGMOID, "moe_ffn_hidden_size": 48,
                            "moe_layer_freq": [1, 0, 0, 1]}),
    "mhc-moe": ("mhc", {**SOFTMAX, **SHARED, "hc_rate": 3, "mhc_sinkhorn_iterations": 7}),
    "siamese-moe-pre_softmax-top1": ("siamese", {**SOFTMAX, "moe_router_topk": 1,
                                                 "moe_router_pre_softmax": True}),
    "pre-moe-pre_softmax-top2": ("pre", {**SOFTMAX, **SHARED, "moe_router_pre_softmax": True,
                                         "moe_layer_freq": 2}),
}
CASES.update(MOE_CASES)


def test_every_registered_scheme_is_exported_and_tested():
    """The remote code accepts exactly the registered schemes, and each has a case here: a
    new scheme fails this until its block is written and checked against its layer."""
    registered = {scheme.value for scheme in ResidualScheme}
    assert set(REMOTE_SCHEMES) == registered
    assert hf_export.remote_schemes() == REMOTE_SCHEMES  # what the export reads
    assert {scheme for scheme, _ in CASES.values()} == registered
    # and each with experts
    assert {scheme for scheme, fields in CASES.values() if fields.get("num_experts")} \
        == registered


def test_every_registered_normalization_is_exported_and_tested():
    """The remote code computes exactly the registered normalizations, and each has a case
    here (rmsnorm by default): a new kind fails this until its computation is written in
    modeling_siamesenorm.Norm and checked against the model's."""
    registered = set(normalizations.KINDS)
    assert set(REMOTE_NORMALIZATIONS) == registered
    assert {fields.get("normalization", "rmsnorm") for _, fields in CASES.values()} \
        == registered


def test_every_expert_field_is_carried_refused_or_training_only():
    """Each MoE field of the model has its treatment in the export (a new field fails here
    until it has one); each carried field is in config.json, read by the remote config and
    away from its default in some case above; each refused one has its refusal (token
    dropping's: the next test)."""
    assert set(hf_export.EXPERT_FIELDS) == set(MOE_FIELDS)
    carried = {name for name, use in hf_export.EXPERT_FIELDS.items()
               if use is hf_export.ExpertField.CARRIED}
    refused = {name for name, use in hf_export.EXPERT_FIELDS.items()
               if use is hf_export.ExpertField.REFUSED}
    assert carried <= set(hf_export.experts_config(tiny_model("siamese", num_experts=4), False))
    assert carried <= set(inspect.signature(SiameseNormConfig).parameters)
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    for name in carried:
        assert any(fields.get(name, defaults[name]) != defaults[name]
                   for _, fields in MOE_CASES.values()), name
    assert set(hf_export.REFUSALS) == refused


def test_export_refuses_a_scheme_without_remote_code(monkeypatch):
    monkeypatch.setattr(hf_export, "remote_schemes", lambda: ("pre", "siamese"))
    with pytest.raises(ConfigError, match=r"model.residual_scheme \(olmo2\) has no Hugging"):
        hf_export.require_exportable(tiny_model("olmo2"))
    hf_export.require_exportable(tiny_model("siamese"))
    hf_export.require_exportable(tiny_model("pre"))  # a Llama needs no remote code


def test_export_refuses_token_dropping_in_one_line():
    """A capacity factor makes a token's output depend on the tokens after it (megatron drops
    by the load of the whole forward, in evaluation too): no causal model computes that."""
    dropping = tiny_model("siamese", num_experts=4, moe_expert_capacity_factor=1.5)
    with pytest.raises(ConfigError) as err:
        hf_export.require_exportable(dropping)
    assert str(err.value).startswith("export-hf: model.moe_expert_capacity_factor (1.5) drops "
                                     "tokens by the load of the whole forward")
    assert "\n" not in str(err.value)
    hf_export.require_exportable(tiny_model("siamese", num_experts=4))


def test_remote_code_refuses_a_scheme_it_does_not_know():
    from pretrain.hf.remote import modeling_siamesenorm as remote

    config = SimpleNamespace(residual_scheme="throwaway", hybrid_first_block="hybrid")
    with pytest.raises(ValueError, match="throwaway"):
        remote.build_block(config, 0)
    with pytest.raises(ValueError, match="throwaway"):
        remote.build_final(config)


def gated(transformer_config):
    """megatron's config as the builder makes it, with the shared expert's gate on."""
    def make(*args, **kwargs):
        config = transformer_config(*args, **kwargs)
        config.moe_shared_expert_gate = True
        return config
    return make


def perturbed_model(scheme: str, fields: dict, vocab: int):
    """The case's model, every parameter moved off its start, and the expert bias (a buffer,
    moved by the load in training) too, by enough to change which experts some tokens get."""
    fields = dict(fields)
    gate = fields.pop(GATE, False)
    cfg = tiny_model(scheme, vocab_size=vocab, seq_length=32, **fields)
    with mock.patch.object(builder, "transformer_config",
                           gated(builder.transformer_config)) if gate else contextlib.nullcontext():
        [model] = build_model(cfg, ParallelConfig(), seed=3)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.add_((0.1 * torch.randn(param.shape, generator=generator)).to(param))
        for name, buffer in model.named_buffers():
            if name.endswith("router.expert_bias"):
                buffer.add_(0.3 * torch.randn(buffer.shape, generator=generator))
    return cfg, model.eval()


@pytest.fixture(scope="module")
def exported(single_rank, data, tmp_path_factory):
    """{case: (our logits, our greedy tokens, transformers' result)}, and the folders."""
    root = tmp_path_factory.mktemp("hf_remote")
    tokenizer = open_tokenizer(data["tokenizer"])
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, tokenizer.vocab_size, (2, 12), generator=generator)
    ours, folders = {}, {}
    for name, (scheme, fields) in CASES.items():
        cfg, model = perturbed_model(scheme, fields, tokenizer.vocab_size)
        device = next(model.parameters()).device
        positions = torch.arange(tokens.shape[1]).expand_as(tokens)
        with torch.no_grad():
            logits = model(tokens.to(device), positions.to(device), None)
        steps = MOE_GREEDY if name in MOE_CASES else GREEDY
        greedy = continue_tokens(model, tokens[0].tolist(), Sampling(max_tokens=steps),
                                 cfg.vocab_size, cfg.seq_length, None)
        ours[name] = (logits[..., :cfg.vocab_size].cpu(), greedy)
        folders[name] = root / name
        folders[name].mkdir()
        # hc's folder is written in 16 KiB shards, as a large model's would be in 5 GiB ones
        small = mock.patch.object(hf_export, "SHARD_BYTES", 16 * 2**10)
        with small if name == "hc" else contextlib.nullcontext():
            write_folder(cfg, model, data["tokenizer"], tokenizer, folders[name])
    # the control: siamese's folder with the depth constant switched off in config.json
    control = root / "control"
    shutil.copytree(folders["siamese"], control)
    config = json.loads((control / "config.json").read_text())
    (control / "config.json").write_text(json.dumps({**config,
                                                     "siamese_depth_constant": False}))
    dense = {name: folder for name, folder in folders.items() if name not in MOE_CASES}
    theirs = transformers_side({**dense, "control": control}, tokens.tolist(), GREEDY, root)
    # the MoE folders in a process of their own, each within the child's time limit
    moe = transformers_side({name: folders[name] for name in MOE_CASES}, tokens.tolist(),
                            MOE_GREEDY, root)
    theirs.update({name: moe[name] for name in MOE_CASES})
    theirs["warnings"] += moe["warnings"]
    theirs["modules"] = sorted({*theirs["modules"], *moe["modules"]})
    return ours, theirs, folders


def max_rel(ours: torch.Tensor, theirs: list) -> float:
    want = torch.tensor(theirs)
    return ((ours - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("case", list(CASES))
def test_transformers_computes_what_we_compute(exported, case):
    ours, theirs, _ = exported
    assert max_rel(ours[case][0], theirs[case]["logits"]) <= 1e-5
    native = case == "pre-llama"
    assert theirs[case]["class"] == ("LlamaForCausalLM" if native else "SiameseNormForCausalLM")


@pytest.mark.parametrize("case", list(CASES))
def test_cached_generation_is_full_recompute(exported, case):
    """transformers' greedy decoding with the KV cache, and without it, gives the tokens of
    our full-recompute decoding, and both paths' logits agree at every step."""
    ours, theirs, _ = exported
    seen = theirs[case]
    assert seen["greedy"] == ours[case][1]
    assert seen["greedy_nocache"] == ours[case][1]
    assert seen["step_rel"] <= 1e-5


@pytest.mark.parametrize("case", list(CASES))
def test_left_padded_batches_generate_as_single_prompts(exported, case):
    """A left-padded row generates what its prompt generates alone (padding mask and
    positions), with the cache and without, to 1e-5 in every step's logits."""
    _, theirs, _ = exported
    seen = theirs[case]
    assert seen["padded_rows"][1] == seen["alone"]
    assert seen["padded_nocache_rows"] == seen["padded_rows"]
    assert seen["padded_step_rel"] <= 1e-5


def test_the_fresh_process_imported_nothing_of_this_project(exported):
    assert exported[1]["modules"] == []


def test_transformers_logs_no_warning_on_any_folder(exported):
    """Loading, generating with and without the cache, and loading the tokenizer: nothing for
    a user to wonder about (a deprecated cache name, a config class it cannot match)."""
    assert exported[1]["warnings"] == []


def test_the_exported_tokenizer_loads_as_the_readme_says(exported, data):
    """``AutoTokenizer`` with ``trust_remote_code=True`` (without it transformers >= 5 reads
    the model's config first, which is remote code) and ``PreTrainedTokenizerFast`` with no
    remote code give sentencepiece's ids."""
    from tests.hf_side import TEXT

    want = open_tokenizer(data["tokenizer"]).encode(TEXT)
    seen = {name: result["tokenizer"] for name, result in exported[1].items()
            if isinstance(result, dict) and "tokenizer" in result}
    assert seen.keys() == {*CASES, "control"}
    for name, tokenizer in seen.items():
        assert tokenizer["auto"] == want and tokenizer["fast"] == want, name


def test_the_exported_tokenizer_decodes_a_continuation_as_generate_does(exported, data):
    """The README's way of decoding what a model added (the whole sequence decoded, less the
    decoded prompt) gives the continuation our ``generate`` prints, leading spaces and all;
    the slice decoded alone drops one space (the dummy-prefix rule of sentencepiece, which
    the converted tokenizer follows), which is why the README says it."""
    from pretrain.unsharded.generate import completion
    from tests.hf_side import CONTINUATION, PROMPT

    tokenizer = open_tokenizer(data["tokenizer"])
    for name, result in exported[1].items():
        if not isinstance(result, dict) or "tokenizer" not in result:
            continue
        seen = result["tokenizer"]
        ids, cut = seen["ids"], seen["cut"]
        assert ids == tokenizer.encode(PROMPT + CONTINUATION), name
        assert seen["continuation"] == completion(tokenizer, ids[:cut], ids[cut:]) \
            == CONTINUATION, name
        assert seen["slice"] == CONTINUATION[1:], name


def test_a_wrong_config_gives_other_logits(exported):
    """The comparison can fail: the same weights read with c_l = 1 differ."""
    ours, theirs, _ = exported
    assert max_rel(ours["siamese"][0], theirs["control"]["logits"]) > 1e-3


def test_folders_hold_the_files_transformers_reads(exported):
    _, _, folders = exported
    llama = sorted(p.name for p in folders["pre-llama"].iterdir())
    remote = sorted(p.name for p in folders["siamese_hybrid"].iterdir())
    common = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
              "tokenizer.model", "tokenizer_config.json"]
    assert llama == sorted([*common, "README.md"])
    assert remote == sorted([*common, "README.md", "configuration_siamesenorm.py",
                             "modeling_siamesenorm.py"])
    config = json.loads((folders["hc"] / "config.json").read_text())
    assert config["residual_scheme"] == "hc" and config["hc_rate"] == 4


def test_weights_get_the_mode_of_every_other_file(exported):
    """A group that can read config.json can read the weights (safetensors alone would make
    them owner-only)."""
    for folder in exported[2].values():
        mode = (folder / "config.json").stat().st_mode & 0o777
        for weights in folder.glob("*.safetensors"):
            assert weights.stat().st_mode & 0o777 == mode, (weights, oct(mode))


def test_large_models_are_written_in_shards_with_an_index(exported):
    """hc's folder (16 KiB shards) loaded above like the others; every tensor is in one shard
    and the index names each one's file."""
    from safetensors import safe_open

    folder = exported[2]["hc"]
    shards = sorted(folder.glob("model-*-of-*.safetensors"))
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(shards) > 2 and not (folder / "model.safetensors").exists()
    held = {}
    for shard in shards:
        with safe_open(str(shard), "pt") as f:
            held.update(dict.fromkeys(f.keys(), shard.name))
    assert held == index["weight_map"]


@pytest.mark.parametrize("case", list(CASES))
def test_bf16_keeps_the_schemes_fp32_modules_in_fp32(exported, case):
    """Every case, so every registered scheme: its exported folder loaded in bf16 by
    transformers alone (each supported release under ``make test-hf-versions``) keeps every
    module of the scheme's ``Traits.fp32`` in fp32, and exactly the weights under the modules
    its model keeps (the list itself is held to the registry in-process, for every scheme, by
    test_hf_precision.py) fp32, every other weight bf16."""
    _, theirs, _ = exported
    scheme = ResidualScheme(CASES[case][0])
    kept, dtypes = set(theirs[case]["bf16_kept"]), theirs[case]["bf16"]
    assert set(scheme.traits.fp32) <= kept, (case, sorted(kept))
    wrong = {name: dtype for name, dtype in dtypes.items()
             if dtype != ("torch.float32" if kept & set(name.split(".")) else "torch.bfloat16")}
    assert not wrong, f"{case}: loaded in bf16, these weights have the wrong dtype: {wrong}"
    held = {module for name in dtypes for module in kept & set(name.split("."))}
    assert held == kept, f"{case}: no weight under {sorted(kept - held)}"


LOAD_AS = """
import sys, transformers
transformers.__version__ = sys.argv[2]
from transformers import AutoModelForCausalLM
AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True)
print("loaded")
"""


def load_as(folder, version: str, tmp_path, **env):
    """Load a folder in a fresh transformers-only process that reports another version."""
    return isolated(sys.executable, ["-c", LOAD_AS, str(folder), version], tmp_path, **env)


@pytest.mark.parametrize("version", ["4.56.2", "5.25.0"])
def test_an_unsupported_transformers_is_refused_in_one_line(exported, tmp_path, version):
    """Outside the tested range the model refuses to load, naming the range, rather than
    risk generating wrong text."""
    done = load_as(exported[2]["siamese"], version, tmp_path)
    assert done.returncode != 0 and "loaded" not in done.stdout
    last = done.stderr.strip().splitlines()[-1]
    assert last.endswith(f"this SiameseNorm model supports transformers {SUPPORTED}, not "
                         f"{version}: install a release in that range (or set "
                         "SIAMESENORM_ANY_TRANSFORMERS=1 to try this one untested)"), last


def test_the_escape_hatch_loads_an_untested_transformers_with_a_warning(exported, tmp_path):
    forced = load_as(exported[2]["siamese"], "6.0.0", tmp_path, SIAMESENORM_ANY_TRANSFORMERS="1")
    assert forced.stdout.strip() == "loaded", forced.stderr[-2000:]
    assert "not 6.0.0; loading it untested" in forced.stderr


def test_the_supported_range_is_what_the_project_declares():
    """The remote code's range, pyproject's requirement and the locked release agree."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    [declared] = [r for r in project["optional-dependencies"]["dev"]
                  if r.startswith("transformers")]
    assert SpecifierSet(declared.removeprefix("transformers")) == SpecifierSet(SUPPORTED)
    locked = [line.split("==")[1] for line in (ROOT / "requirements.lock").read_text().split()
              if line.startswith("transformers==")]
    assert len(locked) == 1 and SpecifierSet(SUPPORTED).contains(locked[0])


def test_arguments_the_model_would_ignore_are_refused(exported):
    """Harmless arguments pass, embeddings may replace token ids, and anything else that
    would change the output is an error instead of being dropped."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(exported[2]["siamese"], trust_remote_code=True,
                                                 dtype=torch.float32)
    tokens = torch.tensor([[5, 17, 300]])
    with torch.no_grad():
        logits = model(tokens, output_attentions=False, cache_position=None).logits
        embedded = model.get_input_embeddings()(tokens)
        assert torch.equal(model(inputs_embeds=embedded).logits, logits)
        with pytest.raises(TypeError, match="does not support output_attentions=True"):
            model(tokens, output_attentions=True)
        with pytest.raises(TypeError, match="does not support kv_cache="):
            model(tokens, kv_cache=object())
        with pytest.raises(ValueError, match="must be the 2-D padding mask"):
            model(tokens, attention_mask=torch.ones(1, 1, 3, 3, dtype=torch.bool))


def test_the_version_matrix_takes_both_ends_of_the_range():
    spec = importlib.util.spec_from_file_location("matrix", ROOT / "scripts/test_hf_versions.py")
    matrix = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(matrix)
    releases = [Version(v) for v in ("4.56.2", "4.57.0", "4.57.6", "5.0.0", "5.24.0", "5.25.0")]
    assert matrix.range_ends(">=4.57,<5.25", releases) == ["4.57.0", "5.24.0"]
    assert matrix.range_ends(">=5.24,<5.25", releases) == ["5.24.0"]
