"""Compiled blocks (kernels.compile): no graph break inside any scheme's block, no recompile
after the first step while packed documents change, and the same logits and gradients as
eager. Breaks and recompiles are Dynamo's own counters with its ``eager`` backend (capture
only, no code generation, so the whole registry fits in seconds); parity uses aot_eager
(AOTAutograd's traced forward and backward, as inductor receives them) and one small
inductor case."""

import json
import re

import pytest
import torch

from model import compiled
from model.schemes import ResidualScheme
from tests import compile_probe
from tests.helpers import spawn

SCHEMES = [s.value for s in ResidualScheme]


# Graphs a 3-block model compiles in its first step at most: one per block class (Mix-LN and
# HybridNorm* have two), and block 0 of a scheme whose first block reads the embedding is a
# graph of its own. SiameseNorm's c_l = sqrt(2 l) differs from block to block: it enters the
# graph as an input (``TwoStreamLayer.c_operand``), so its blocks share one graph too (a float
# c_l made each block of siamese and siamese_hybrid a graph of its own).
GRAPHS_IN_STEP_1 = 2


# The fast tier compiles these two (single- and two-stream); the rest of the registry, a few
# seconds each, runs in the full suite.
FAST = {"pre", "siamese"}


def _every_scheme(fast=FAST):
    return [pytest.param(s, marks=[] if s in fast else [pytest.mark.slow]) for s in SCHEMES]


@pytest.mark.parametrize("scheme", _every_scheme())
def test_no_graph_break_nor_recompile_after_first_step(single_rank, scheme):
    counts = compile_probe.step_counts(scheme, {})
    breaks = sum(b for _, b in counts)
    assert breaks == 0, f"{scheme}: graph breaks {compiled.break_reasons()}"
    assert [g for g, _ in counts[1:]] == [0, 0], f"{scheme}: recompiled after step 1: {counts}"
    assert 1 <= counts[0][0] <= GRAPHS_IN_STEP_1, counts


@pytest.mark.slow  # starts two processes
def test_tp2_with_sp_has_no_break_and_never_recompiles(tmp_path):
    out = tmp_path / "counts.json"
    # 2 blocks: block 0 (which reads the embedding) and one of the rest. Mix-LN's Post-Norm
    # blocks (none of 2 at its ratio 0.25) are post's layer class, counted under post.
    spawn(2, compile_probe.rank_counts, SCHEMES, {"tp": 2, "sequence_parallel": True},
          str(out), 2)
    for scheme, result in json.loads(out.read_text()).items():
        counts = result["counts"]
        assert sum(b for _, b in counts) == 0, (scheme, result["reasons"])
        assert [g for g, _ in counts[1:]] == [0, 0], (scheme, counts)


@pytest.mark.slow  # starts two processes
def test_tp2_compiled_matches_eager(tmp_path):
    """At TP=2 a compiled block's column-parallel linears are megatron's collectives and a
    matrix product whose gradients autograd computes (model/tp_linear.py), not megatron's
    linear: both layouts' losses and gradients within 1e-5 of eager's."""
    out = tmp_path / "parity.json"
    spawn(2, compile_probe.rank_parity, ["pre", "siamese"],
          {"sp": {"tp": 2, "sequence_parallel": True}, "no-sp": {"tp": 2}}, str(out))
    for case, worst in json.loads(out.read_text()).items():
        assert worst["loss"] <= 1e-5 and worst["grads"] <= 1e-5, (case, worst)


@pytest.mark.parametrize("scheme", _every_scheme(fast={"pre"}))  # siamese: ~10-16 s
def test_compiled_matches_eager(single_rank, scheme):
    losses, grads = compile_probe.loss_and_grads(scheme, {}, None)
    c_losses, c_grads = compile_probe.loss_and_grads(scheme, {}, "aot_eager")
    assert c_losses == pytest.approx(losses, rel=1e-5)
    assert compile_probe.worst_relative(c_grads, grads) <= 1e-5


# Experts in every other block (dense and MoE blocks mix), with a shared expert and the z-loss:
# every part of megatron's MoE layer a block can hold.
MOE = {"num_experts": 4, "moe_router_topk": 2, "moe_layer_freq": 2, "moe_z_loss_coeff": 1e-3,
       "moe_shared_expert_intermediate_size": 32}


@pytest.mark.parametrize("scheme", _every_scheme(fast={"siamese"}))
def test_moe_blocks_compile_around_eager_experts_and_never_recompile(single_rank, scheme):
    """How many tokens each expert receives changes every step: a compiled MoE layer would
    compile again at each (it did, until Dynamo's limit). It runs eager inside its compiled
    block, and those calls are the only breaks."""
    # 2 blocks (block 0 MoE, block 1 dense), 2 steps: the second shows any recompile.
    counts = compile_probe.step_counts(scheme, {}, model_fields=MOE, layers=2, steps=2)
    reasons = compiled.break_reasons()
    assert reasons and all("MoELayer.forward" in r for r in reasons), reasons
    assert counts[1][0] == 0, f"{scheme}: recompiled after step 1: {counts}"
    assert re.search(r"; (\d+) graph breaks \(all at the MoE layers, which run eager ",
                     compiled.first_step_text(1.0))


# Dynamo's reasons as break_reasons() gives them (compile id first; the MoE layer's call named).
AT_EXPERTS = "0/1: Attempted to call function marked as skipped: MoELayer.forward"
ITEM = "1/0: Unsupported Tensor.item() call with capture_scalar_outputs=False"


@pytest.mark.parametrize("reasons, text", [
    ({}, "0 graph breaks"),
    ({ITEM: 2}, "2 graph breaks (2 x Unsupported Tensor.item() call with "
                "capture_scalar_outputs=False)"),
    ({AT_EXPERTS: 6}, "6 graph breaks (all at the MoE layers, which run eager inside their "
                      "compiled blocks since the tokens each expert receives change every "
                      "step)"),
    ({AT_EXPERTS: 6, ITEM: 2}, "8 graph breaks (6 at the MoE layers, which run eager inside "
                               "their compiled blocks since the tokens each expert receives "
                               "change every step; 2 x Unsupported Tensor.item() call with "
                               "capture_scalar_outputs=False)"),
], ids=["dense", "dense-breaks", "moe", "moe-and-other"])
def test_the_first_step_counts_every_graph_break_once(reasons, text):
    """One count of all the breaks, the MoE layers' (expected) said apart: never '0 graph
    breaks' next to the MoE layers' own."""
    assert compiled.breaks_text(reasons) == text


@pytest.mark.parametrize("scheme", ["pre", "siamese"])
def test_compiled_moe_matches_eager(single_rank, scheme):
    losses, grads = compile_probe.loss_and_grads(scheme, {}, None, layers=2, model_fields=MOE)
    c_losses, c_grads = compile_probe.loss_and_grads(scheme, {}, "aot_eager", layers=2,
                                                     model_fields=MOE)
    assert c_losses == pytest.approx(losses, rel=1e-5)
    assert compile_probe.worst_relative(c_grads, grads) <= 1e-5


def test_compiled_matches_eager_where_eager_attends_one_document_at_a_time(single_rank):
    """From SPLIT_FROM tokens on the CPU's eager attention makes one call per document, from
    spans read on the host, which a compiled graph cannot hold (Dynamo stopped there); inside
    a compiled block the exact mask computes the same attention."""
    from model.sdpa_attention import SPLIT_FROM

    losses, grads = compile_probe.loss_and_grads("siamese", {}, None, layers=2, seq=SPLIT_FROM)
    c_losses, c_grads = compile_probe.loss_and_grads("siamese", {}, "aot_eager", layers=2,
                                                     seq=SPLIT_FROM)
    assert c_losses == pytest.approx(losses, rel=1e-5)
    assert compile_probe.worst_relative(c_grads, grads) <= 1e-5


def test_parity_check_catches_a_wrong_compiled_region(single_rank):
    losses, grads = compile_probe.loss_and_grads("siamese", {}, None)
    c_losses, c_grads = compile_probe.loss_and_grads("siamese", {}, _scaled_backend)
    assert c_losses != pytest.approx(losses, rel=1e-5) \
        or compile_probe.worst_relative(c_grads, grads) > 1e-5


def _scaled_backend(gm, example_inputs):
    """A wrong compiled region: every floating output of the block's graph times 1 + 1e-3."""
    def run(*args):
        outs = gm(*args)
        single = not isinstance(outs, (tuple, list))
        outs = [outs] if single else list(outs)
        outs = [o * (1 + 1e-3) if torch.is_tensor(o) and o.is_floating_point() else o
                for o in outs]
        return outs[0] if single else type(outs)(outs) if isinstance(outs, tuple) else outs
    return run


@pytest.mark.slow  # inductor generates and builds C++ for each graph (~tens of seconds)
def test_inductor_matches_eager(single_rank):
    losses, grads = compile_probe.loss_and_grads("siamese", {}, None, layers=2)
    c_losses, c_grads = compile_probe.loss_and_grads("siamese", {}, "inductor", layers=2)
    assert c_losses == pytest.approx(losses, rel=1e-5)
    assert compile_probe.worst_relative(c_grads, grads) <= 1e-5


def test_cli_run_compiled_matches_eager(data, tmp_path):
    """A whole short run through the CLI, compiled (aot_eager: the same capture inductor
    gets, without its code generation) and resumed half-way, against eager in one start, with
    validation in the loop: per-step losses within 1e-5 relative.
    The bound: fp32 and the same ops in the same order, so only a reassociation inside the
    captured graph differs (measured 8e-8 with inductor over 6 steps of pre, docs/compile.md);
    a wrong region (the negative control above: 1e-3) is 100 x over it."""
    from tests.pretrain_fixtures import cli, train_args, train_losses

    common = ["--run.eval_interval=2", "--model.residual_scheme=siamese"]
    compile_args = ["--kernels.compile=true", "--kernels.compile_backend=aot_eager"]
    cli(*train_args(data, tmp_path / "eager", "--run.steps=4", *common))
    # compiled in two starts: 3 steps and a save, then a resume to step 4
    cli(*train_args(data, tmp_path / "compiled", "--run.steps=3", *common, *compile_args))
    run = cli(*train_args(data, tmp_path / "compiled", "--run.steps=4", *common,
                          *compile_args, "--optim.override_schedule=true"))
    eager, compiled_losses = train_losses(tmp_path / "eager"), train_losses(tmp_path / "compiled")
    assert compiled_losses.keys() == eager.keys()
    for step, loss in eager.items():
        assert compiled_losses[step] == pytest.approx(loss, rel=1e-5), step
    assert "0 graph breaks" in run.stdout + run.stderr
    assert (tmp_path / "compiled" / "compile_cache").is_dir()


def test_cli_says_each_recompile_once_with_where_and_counts_it(data, tmp_path):
    """A resumed compiled run compiles its training graphs in its first step and its no-grad
    graphs at its first validation, after that step: one console line says so, where and
    why, and the metrics carry the count. A run whose validation came first says nothing."""
    import re

    from tests.pretrain_fixtures import cli, metrics, train_args

    run = tmp_path / "run"
    common = ["--run.eval_interval=2", "--kernels.compile=true",
              "--kernels.compile_backend=aot_eager"]
    first = cli(*train_args(data, run, "--run.steps=3", *common))
    assert "recompiled" not in first.stdout + first.stderr
    resumed = cli(*train_args(data, run, "--run.steps=6", *common,
                              "--optim.override_schedule=true"))
    said = [line for line in (resumed.stdout + resumed.stderr).splitlines()
            if "recompiled" in line]
    assert len(said) == 1, said
    assert re.fullmatch(r"\[pretrain\] compiled blocks recompiled \(validation at step 4\): "
                        r"\d+ graphs?, \d+\.\d s; Dynamo's reason: .*grad_mode.*", said[0]), said
    counted = {r["step"]: r["recompiles"] for r in metrics(run) if "recompiles" in r}
    assert counted == {1: 0, 2: 0, 3: 0, 4: 0, 5: 1, 6: 1}, counted


@pytest.mark.parametrize("kernels, message", [
    (dict(cuda_graphs=True), "kernels.cuda_graphs (true) needs kernels.compile true"),
    (dict(compile=True, cuda_graphs=True, compile_backend="aot_eager"),
     "kernels.cuda_graphs (true) needs kernels.compile_backend inductor, not aot_eager"),
])
def test_cuda_graphs_settings_are_refused_in_one_line(kernels, message):
    from pretrain.config import Config, KernelsConfig, validate
    from runtime.errors import ConfigError

    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate(Config(kernels=KernelsConfig(**kernels)))


def test_selective_recompute_is_refused_with_compile():
    from model.config import ParallelConfig
    from pretrain.config import Config, KernelsConfig, validate
    from runtime.errors import ConfigError

    with pytest.raises(ConfigError, match=r"kernels.compile \(true\) and parallel.recompute "
                                          r"\(selective\) do not compose"):
        validate(Config(kernels=KernelsConfig(compile=True),
                        parallel=ParallelConfig(recompute="selective")))


def test_local_attention_is_refused_with_compile():
    """megatron's DotProductAttention broke each compiled block several times, unsaid (its
    RNG-tracker fork around the dropout, a value read on the host): refused in one line that
    names both fields and the settings that work; each alone, or compile with sdpa, passes."""
    from model.config import ModelConfig
    from pretrain.config import Config, KernelsConfig, validate
    from runtime.errors import ConfigError

    with pytest.raises(ConfigError) as refused:
        validate(Config(kernels=KernelsConfig(compile=True),
                        model=ModelConfig(attention_backend="local")))
    line = str(refused.value)
    assert "\n" not in line and "kernels.compile (true) and model.attention_backend (local) do " \
        "not compose" in line and "use model.attention_backend sdpa" in line, line
    assert "kernels.compile false" in line, line
    for kernels, attention in [(False, "local"), (True, "sdpa"), (True, "auto")]:
        validate(Config(kernels=KernelsConfig(compile=kernels),
                        model=ModelConfig(attention_backend=attention)))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_cuda_graphs_are_refused_without_cuda_before_anything_starts(data, tmp_path):
    """On a machine without CUDA the run stops in one line before its process groups start
    (they would seed megatron's graph-safe RNG tracker, which is CUDA's) and writes nothing."""
    from tests.pretrain_fixtures import cli, train_args

    run = tmp_path / "run"
    done = cli(*train_args(data, run, "--kernels.compile=true", "--kernels.cuda_graphs=true"),
               check=False)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if "cuda_graphs" in line]
    assert len(lines) == 1 and "needs a CUDA device (none on this machine); set it false" \
        in lines[0] and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert not (run / "checkpoints").exists() and not (run / "compile_cache").exists()


@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_the_rng_tracker_is_graph_safe_exactly_with_cuda_graphs(monkeypatch, cuda_graphs):
    """kernels.cuda_graphs seeds megatron's model-parallel RNG tracker in its graph-safe form
    (``use_cudagraphable_rng``), made anew; the call is recorded here, since on the CPU
    megatron cannot build that tracker (its states are CUDA generators; the gpu test below
    builds it)."""
    from runtime import parallel

    calls = []
    monkeypatch.setattr(parallel, "model_parallel_cuda_manual_seed",
                        lambda seed, **kwargs: calls.append((seed, kwargs)))
    parallel.seed_everything(7, graph_safe_rng=cuda_graphs)
    assert calls == [(7, {"use_cudagraphable_rng": cuda_graphs, "force_reset_rng": True})]


@pytest.mark.gpu
def test_cuda_graphs_seed_a_graph_safe_rng_tracker(single_rank):
    from megatron.core.tensor_parallel.random import (
        get_cuda_rng_tracker,
        is_graph_safe_cuda_rng_tracker,
    )

    from runtime import parallel

    try:
        parallel.seed_everything(7, graph_safe_rng=True)
        assert is_graph_safe_cuda_rng_tracker(get_cuda_rng_tracker())
    finally:
        parallel.seed_everything(1234)  # the session's seed and tracker, for what follows
    assert not is_graph_safe_cuda_rng_tracker(get_cuda_rng_tracker())


RECOMPUTE = {"full-1": dict(recompute="full", recompute_num_layers=1),
             "full-2": dict(recompute="full", recompute_num_layers=2)}


@pytest.mark.slow  # four models compiled three times each: ~30 s together
@pytest.mark.parametrize("recompute", RECOMPUTE)
@pytest.mark.parametrize("scheme", ["pre", "siamese"])
def test_compiled_with_full_recompute(single_rank, scheme, recompute):
    """Full recompute runs the compiled blocks inside megatron's checkpoint: a no-grad graph,
    then the recomputation's with grad, both in the first step. (Selective recompute is
    refused with compile: megatron's checkpoint inside the block saves the RNG state.)"""
    counts = compile_probe.step_counts(scheme, RECOMPUTE[recompute], steps=2)
    assert sum(b for _, b in counts) == 0, compiled.break_reasons()
    assert counts[1][0] == 0, counts
    losses, grads = compile_probe.loss_and_grads(scheme, RECOMPUTE[recompute], None)
    c_losses, c_grads = compile_probe.loss_and_grads(scheme, RECOMPUTE[recompute], "aot_eager")
    assert c_losses == pytest.approx(losses, rel=1e-5)
    assert compile_probe.worst_relative(c_grads, grads) <= 1e-5


@pytest.mark.slow  # starts two processes
def test_compiled_under_context_parallelism(tmp_path):
    """CP=2: the attention's K/V all-gather (megatron's autograd collective) and its chunks'
    lower-right causal attention inside each block's graph: no break, no recompile after
    step 1."""
    out = tmp_path / "counts.json"
    spawn(2, compile_probe.rank_counts, ["pre", "siamese"], {"cp": 2}, str(out))
    for scheme, result in json.loads(out.read_text()).items():
        counts = result["counts"]
        assert sum(b for _, b in counts) == 0, (scheme, result["reasons"])
        assert [g for g, _ in counts[1:]] == [0, 0], (scheme, counts)


@pytest.mark.slow  # starts two processes
@pytest.mark.parametrize("layout", [{"pp": 2}, {"pp": 2, "vp": 2}], ids=["1f1b", "interleaved"])
def test_compiled_under_pipeline_parallelism(tmp_path, layout):
    """PP=2, blocks split over two ranks, with 1F1B and with interleaved 1F1B (two model
    chunks per rank): no break, no recompile after step 1."""
    out = tmp_path / "counts.json"
    spawn(2, compile_probe.rank_counts, ["pre", "siamese"], layout, str(out))
    for scheme, result in json.loads(out.read_text()).items():
        counts = result["counts"]
        assert sum(b for _, b in counts) == 0, (scheme, result["reasons"])
        assert [g for g, _ in counts[1:]] == [0, 0], (scheme, counts)
