"""Impossible model/layout configs fail at build time with one line: field, rule, values."""

import pytest

from model.backends import te_available
from model.builder import build_model, wrap_ddp
from model.config import ModelConfig, ParallelConfig
from pretrain.config import fit_layout, load_config, validate
from runtime.errors import ConfigError

CASES = [
    # (model overrides, parallel overrides, fragments the message must contain)
    (dict(residual_scheme="prenorm"), {}, ["model.residual_scheme", "'prenorm'", "siamese"]),
    (dict(normalization="batchnorm"), {}, ["model.normalization", "'batchnorm'"]),
    (dict(num_attention_heads=3, hidden_size=96), dict(tp=2),
     ["parallel.tp (2)", "model.num_attention_heads (3)"]),
    (dict(num_layers=6), dict(pp=2, vp=2), ["model.num_layers (6)", "parallel.pp", "2 x 2 = 4"]),
    (dict(num_layers=3), dict(pp=2), ["model.num_layers (3)", "1 = 2"]),
    (dict(hidden_size=100, num_attention_heads=3), {},
     ["model.num_attention_heads (3)", "model.hidden_size (100)"]),
    ({}, dict(vp=2), ["parallel.vp (2)", "parallel.pp > 1", "got 1"]),
    ({}, dict(sequence_parallel=True), ["parallel.sequence_parallel", "parallel.tp > 1"]),
    (dict(num_query_groups=3), {}, ["model.num_query_groups (3)", "(4)"]),
    (dict(num_attention_heads=4, num_query_groups=1), dict(tp=2),
     ["parallel.tp (2)", "model.num_query_groups (1)"]),
    (dict(ffn_hidden_size=63), dict(tp=2), ["model.ffn_hidden_size (63)"]),
    (dict(seq_length=15), dict(tp=2, sequence_parallel=True), ["model.seq_length (15)"]),
    (dict(num_layers=0), {}, ["model.num_layers (0)", "positive integer"]),
    (dict(hidden_dropout=1.5), {}, ["model.hidden_dropout (1.5)", "[0, 1)"]),
    (dict(hybrid_first_block="prenorm"), {}, ["model.hybrid_first_block",
                                              "siamese_hybrid"]),
    (dict(residual_scheme="hybridnorm", hybrid_first_block="prenorm_literal"), {},
     ["model.hybrid_first_block (prenorm_literal)", "hybridnorm takes hybrid or prenorm"]),
    (dict(hybrid_first_block="star"), {}, ["model.hybrid_first_block ('star')",
                                           "hybrid, prenorm, prenorm_literal"]),
    (dict(norm_bias=True), {}, ["model.norm_bias (true)", "layernorm (got rmsnorm)"]),
    (dict(init="xavier"), {}, ["model.init ('xavier')", "normal, full_megatron"]),
    ({}, dict(recompute="sometimes"), ["parallel.recompute", "'sometimes'"]),
    (dict(num_layers=4), dict(recompute="full", recompute_num_layers=3, pp=2),
     ["parallel.recompute_num_layers (3)", "(2)"]),
    ({}, dict(tp=0), ["parallel.tp (0)"]),
    (dict(vocab_size=101, make_vocab_size_divisible_by=1), dict(tp=2),
     ["parallel.tp (2)", "padded vocabulary (101)"]),
    (dict(hidden_size=36, num_attention_heads=4), {}, ["(9) must be even for rope"]),
    (dict(residual_scheme="mixln", mixln_post_ratio=1.5), {},
     ["model.mixln_post_ratio (1.5)", "[0, 1]"]),
    (dict(residual_scheme="mixln", mixln_post_ratio=-0.25), {}, ["(-0.25) must be in [0, 1]"]),
    (dict(mixln_post_ratio=0.5), {}, ["model.mixln_post_ratio (0.5)", "mixln (got siamese)"]),
    (dict(residual_scheme="pre", siamese_input_norm=False), {},
     ["model.siamese_input_norm (false)", "siamese or siamese_hybrid (got pre)"]),
    (dict(residual_scheme="hybridnorm", siamese_depth_constant=False), {},
     ["model.siamese_depth_constant (false)", "(got hybridnorm)"]),
    (dict(residual_scheme="mixln", hybrid_first_block="prenorm"), {},
     ["model.hybrid_first_block (\"prenorm\")", "hybridnorm or siamese_hybrid (got mixln)"]),
    (dict(attention_backend="flash"), {}, ["model.attention_backend ('flash')", "sdpa"]),
    (dict(transformer_impl="apex"), {}, ["model.transformer_impl ('apex')", "local, te"]),
    # context parallelism: 2 x cp equal chunks, each rank's share over TP under SP, an
    # attention that takes it
    (dict(seq_length=18), dict(cp=2), ["model.seq_length (18)", "2 x parallel.cp (4)"]),
    (dict(seq_length=24), dict(cp=4, tp=4, sequence_parallel=True),
     ["parallel.tp (4)", "model.seq_length (24 / parallel.cp 4 = 6)"]),
    (dict(attention_backend="local"), dict(cp=2),
     ["parallel.cp (2) needs model.attention_backend sdpa", "--model.attention_backend=sdpa"]),
    ({}, dict(cp=0), ["parallel.cp (0)", "positive integer"]),
    # mixture of experts
    (dict(num_experts=6), dict(ep=4), ["parallel.ep (4)", "model.num_experts (6)"]),
    (dict(num_experts=4, moe_router_topk=5), {},
     ["model.moe_router_topk (5)", "[1, model.num_experts (4)]"]),
    (dict(moe_router_topk=4), {}, ["model.moe_router_topk (4)", "model.num_experts > 0",
                                   "got 0"]),
    (dict(moe_ffn_hidden_size=32), {}, ["model.moe_ffn_hidden_size (32)", "num_experts > 0"]),
    ({}, dict(ep=2), ["parallel.ep (2)", "model.num_experts > 0"]),
    (dict(num_experts=4, moe_layer_freq=[1, 0, 1]), {},
     ["model.moe_layer_freq ([1, 0, 1])", "per block (4 blocks)"]),
    (dict(num_experts=4, moe_layer_freq=[0, 0, 0, 0]), {},
     ["model.moe_layer_freq ([0, 0, 0, 0]) makes no block MoE"]),
    (dict(num_experts=4, moe_layer_freq=[0, 0, 1, 1]), dict(pp=2),
     ["model.moe_layer_freq ([0, 0, 1, 1]) leaves the first pipeline stage of parallel.pp 2 "
      "(blocks [0, 1], 0-based) without an MoE block", "or use parallel.pp 1"]),
    (dict(num_experts=4, moe_layer_freq=[0, 1, 0, 1]), dict(pp=2, vp=2),
     ["model.moe_layer_freq ([0, 1, 0, 1]) leaves the first pipeline stage of parallel.pp 2 "
      "(blocks [0, 2], 0-based)"]),
    (dict(num_experts=4, moe_router_topk=1), {},
     ["model.moe_router_topk (1)", "needs model.moe_router_pre_softmax true"]),
    (dict(num_experts=4, moe_router_pre_softmax=True, moe_router_score_function="sigmoid"), {},
     ["model.moe_router_pre_softmax (true) applies to", "softmax (got sigmoid)"]),
    # megatron's shared expert asserts add_bias_linear false deep inside the build
    (dict(num_experts=4, moe_shared_expert_intermediate_size=64, add_bias_linear=True), {},
     ["model.moe_shared_expert_intermediate_size (64) needs model.add_bias_linear false",
      "shared expert has no linear biases; got true"]),
    *[pytest.param({name: "te"}, {}, [f"model.{name} (te)", "Transformer Engine"],
                   marks=pytest.mark.skipif(te_available(), reason="TE is usable here"))
      for name in ("attention_backend", "transformer_impl")],
]


@pytest.mark.parametrize("model_kw,parallel_kw,fragments", CASES)
def test_bad_config_is_one_clear_line(model_kw, parallel_kw, fragments):
    base = dict(num_layers=4, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                seq_length=16)
    with pytest.raises(ConfigError) as info:
        build_model(ModelConfig(**{**base, **model_kw}), ParallelConfig(**parallel_kw))
    message = str(info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, (fragment, message)


MOE = ["--model.num_layers=4", "--model.hidden_size=32", "--model.num_attention_heads=4",
       "--model.seq_length=16", "--model.num_experts=8", "--data.micro_batch_size=1",
       "--data.global_batch_size=24", "--data.valid_samples=0"]


@pytest.mark.parametrize("parallel,world,product", [
    (["--parallel.ep=4"], 6, "1 x 4 x 1 = 4"),
    (["--parallel.ep=2", "--parallel.pp=2"], 6, "1 x 2 x 2 = 4"),
    (["--parallel.ep=4", "--parallel.tp=2", "--parallel.etp=1",
      "--parallel.sequence_parallel=true"], 6, "1 x 4 x 1 = 4"),
])
def test_expert_groups_must_tile_the_world(parallel, world, product):
    """megatron's expert groups (etp x ep x pp, the rest expert data parallel) cover the same
    ranks as the dense ones: a world they do not divide is one line, before any rank starts
    (the dense rule, tp x pp, holds in each case: 6 is divisible by 1, 2 and 2)."""
    config = load_config(None, MOE + parallel)
    with pytest.raises(ConfigError) as info:
        validate(config, world_size=world)
    message = str(info.value)
    assert "\n" not in message
    assert f"world size ({world}) must be divisible by parallel.etp x parallel.ep x " \
           f"parallel.pp ({product})" in message
    validate(config, world_size=8)  # 8 tiles every one of them


def test_context_parallelism_takes_the_advised_attention_and_its_world():
    """What the refusals above advise works: the SDPA attention under parallel.cp 2; a
    world of tp x cp x pp ranks (and data.seq_length split the same way); eval of a CP
    checkpoint on one process runs without context parallelism and says so."""
    base = ["--model.num_layers=4", "--model.hidden_size=32", "--model.num_attention_heads=4",
            "--model.seq_length=32", "--data.micro_batch_size=1", "--data.global_batch_size=4",
            "--data.valid_samples=0", "--parallel.cp=2"]
    config = load_config(None, [*base, "--model.attention_backend=sdpa"])
    validate(config, world_size=2)
    validate(config, world_size=8)  # dp 4
    with pytest.raises(ConfigError, match=r"^world size \(3\) must be divisible by "
                       r"parallel.tp x parallel.cp x parallel.pp \(2\)$"):
        validate(config, world_size=3)
    with pytest.raises(ConfigError, match=r"^data.seq_length \(30\) must be divisible by "
                       r"2 x parallel.cp \(4\)"):
        validate(load_config(None, [*base, "--data.seq_length=30"]), world_size=2)
    validate(load_config(None, [*base, "--data.seq_length=28"]), world_size=2)
    fitted, note = fit_layout(config, 1)
    assert fitted.parallel.cp == 1 and "parallel.cp 2" in note and "parallel.cp 1" in note


def test_eval_of_an_expert_layout_on_too_few_processes_drops_it():
    """A checkpoint reshards on load, so eval on fewer processes than its expert layout needs
    runs with one model per process and says so."""
    config = load_config(None, MOE + ["--parallel.ep=4"])
    fitted, note = fit_layout(config, 2)
    assert (fitted.parallel.ep, fitted.parallel.etp, fitted.parallel.tp) == (1, None, 1)
    assert "parallel.ep 4" in note and "parallel.ep 1" in note
    assert fit_layout(config, 4) == (config, None)


def test_valid_layout_builds_config():
    from model.megatron_config import transformer_config

    config = transformer_config(ModelConfig(num_layers=4), ParallelConfig(tp=2, pp=2, vp=2))
    assert config.virtual_pipeline_model_parallel_size == 2
    assert config.variable_seq_lengths  # two streams cross pipeline stages packed


def test_user_errors_come_by_kind(tmp_path):
    """One base class for every user mistake (the CLI's one-line exit 2), one subclass per kind
    of input: a bad field, a missing data file, a missing checkpoint."""
    from pretrain.data.tokenizer import open_tokenizer
    from pretrain.run import checkpoint
    from runtime.errors import CheckpointError, DataError, UserError

    with pytest.raises(ConfigError):
        ModelConfig(activation="tanh")
    with pytest.raises(DataError, match="does not exist"):
        open_tokenizer(str(tmp_path / "missing.model"))
    with pytest.raises(CheckpointError, match="does not exist"):
        checkpoint.find(tmp_path / "no-run" / "checkpoints")
    for kind in (ConfigError, DataError, CheckpointError):
        assert issubclass(kind, UserError) and not issubclass(kind, tuple(
            k for k in (ConfigError, DataError, CheckpointError) if k is not kind))


def test_top1_routing_trains_with_the_advised_pre_softmax(single_rank):
    """The top-1 refusal's advice, taken: megatron's router builds and a step's gradient
    reaches the router (a softmax over one chosen logit would give it none)."""
    import torch

    from runtime.schedule import forward_backward
    from tests.helpers import MBS, SEQ, batches, tiny_model

    model = tiny_model("siamese", num_experts=4, moe_router_topk=1,
                       moe_router_pre_softmax=True, moe_aux_loss_coeff=0.0)
    par = ParallelConfig(distributed_optimizer=False)
    [ddp] = wrap_ddp(build_model(model, par), par)
    forward_backward([ddp], batches(1), 1, SEQ, MBS)
    router = ddp.module.decoder.layers[0].mlp.router.weight
    assert torch.count_nonzero(router.main_grad) > 0
