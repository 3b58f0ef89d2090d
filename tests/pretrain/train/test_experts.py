"""The routers watched (pretrain.train.experts), in process: megatron's balancing and z losses
and the expert counts against a computation of their own from each router's input, counted
once under recomputation, nothing left over from an earlier step or a validation pass, and the
collapse warning for a router that sends every token to the same experts and only for it, and
its recovery."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from model.builder import build_model, wrap_ddp
from model.config import ParallelConfig
from pretrain.config import load_config
from pretrain.report.expert_load import window_steps
from pretrain.train.experts import RouterWatch, build
from runtime.schedule import forward_backward
from tests.helpers import MBS, SEQ, VOCAB, batches

EXPERTS, TOPK, BLOCKS = 4, 2, 2


def _config(*extra: str):
    return load_config(None, [
        "--model.num_layers=2", "--model.hidden_size=32", "--model.num_attention_heads=4",
        "--model.ffn_hidden_size=64", f"--model.vocab_size={VOCAB}", f"--model.seq_length={SEQ}",
        f"--model.num_experts={EXPERTS}", f"--model.moe_router_topk={TOPK}",
        "--model.moe_z_loss_coeff=1e-3", f"--data.micro_batch_size={MBS}",
        f"--data.global_batch_size={2 * MBS}", "--run.steps=10", "--optim.warmup_steps=1",
        *extra])


def _model(config, **parallel):
    torch.manual_seed(5)
    par = ParallelConfig(distributed_optimizer=False, **parallel)
    return wrap_ddp(build_model(config.model, par), par)


def _step(watch: RouterWatch, chunks, seed: int = 0) -> None:
    watch.step_begins()
    forward_backward(chunks, batches(2, seed=seed), 2, SEQ, MBS)


def _routers(chunks) -> list:
    return [layer.mlp.router for layer in chunks[0].module.decoder.layers]


def _by_hand(chunks, seed: int = 0) -> dict:
    """Each router's input captured, then megatron's formulas written out from it: per block
    and micro-batch the top-k choice of the logits, the balancing loss E / (k T^2) x sum over
    experts of (router probability mass x tokens chosen), and the z-loss, the mean squared
    log-sum-exp of the logits; losses averaged over micro-batches, then blocks."""
    seen: list[tuple[int, torch.Tensor]] = []
    handles = [r.register_forward_pre_hook(
        lambda router, inputs: seen.append((router.layer_number, inputs[0].detach())))
        for r in _routers(chunks)]
    try:
        forward_backward(chunks, batches(2, seed=seed), 2, SEQ, MBS)
    finally:
        for handle in handles:
            handle.remove()
    weights = {r.layer_number: r.weight.detach().float() for r in _routers(chunks)}
    counts = {block: torch.zeros(EXPERTS, dtype=torch.long) for block in range(BLOCKS)}
    aux, z = [], []
    for number, hidden in seen:
        logits = hidden.reshape(-1, hidden.shape[-1]).float() @ weights[number].t()
        tokens = logits.shape[0]
        chosen = torch.zeros_like(logits).scatter(1, logits.topk(TOPK, dim=1).indices, 1)
        counts[number - 1] += chosen.sum(0).long().cpu()
        probs = logits.softmax(-1)
        aux.append(float((probs.sum(0) * chosen.sum(0)).sum() * EXPERTS / (TOPK * tokens ** 2)))
        z.append(float(logits.logsumexp(-1).square().mean()))
    assert len(seen) == 2 * BLOCKS  # two micro-batches through each block
    return {"moe_aux_loss": sum(aux) / len(aux), "moe_z_loss": sum(z) / len(z),
            "counts": counts, "tokens": 2 * MBS * SEQ}


def test_losses_and_loads_match_megatrons_formulas_by_hand(single_rank, tmp_path):
    config = _config()
    chunks = _model(config)
    watch = build(config, chunks, tmp_path, logs=True)
    _step(watch, chunks)
    logged = watch.measure(1)
    expected = _by_hand(chunks)
    assert logged["moe_aux_loss"] == pytest.approx(expected["moe_aux_loss"], rel=1e-5)
    assert logged["moe_z_loss"] == pytest.approx(expected["moe_z_loss"], rel=1e-5)
    loads = []
    for block, counts in expected["counts"].items():
        assert int(counts.sum()) == expected["tokens"] * TOPK
        load = counts.max().item() / counts.float().mean().item()
        assert logged[f"moe_load/block{block:02d}"] == pytest.approx(load, rel=1e-12)
        loads.append((load, counts.min().item() / counts.float().mean().item()))
    assert logged["moe_max_load"] == pytest.approx(max(m for m, _ in loads), rel=1e-12)
    assert logged["moe_min_load"] == pytest.approx(min(m for _, m in loads), rel=1e-12)
    assert "moe_dropped" not in logged  # no capacity factor: nothing can be dropped
    # every expert's load, for W&B alone: not in the record (metrics.jsonl, console)
    assert not [key for key in logged if key.startswith("moe_expert_load")]
    assert len(watch.expert_loads) == BLOCKS * EXPERTS
    for block, counts in expected["counts"].items():
        mean = counts.float().mean().item()
        for expert, count in enumerate(counts.tolist()):
            assert watch.expert_loads[f"moe_expert_load/block{block:02d}/e{expert:02d}"] == \
                pytest.approx(count / mean, rel=1e-12)
    (line,) = (tmp_path / "experts.jsonl").read_text().splitlines()
    assert line == ('{"step": 1, "topk": 2, "tokens": 64, "received": {'
                    + ", ".join(f'"{b}": {c.tolist()}' for b, c in expected["counts"].items())
                    + "}}")


def test_a_recomputed_block_is_counted_once(single_rank, tmp_path):
    """Full recomputation runs each block without gradients, then again in backward with
    them: the same numbers as without it, not twice the counts."""
    config = _config()
    plain, recomputed = _model(config), _model(config, recompute="full", recompute_num_layers=1)
    logged, lines = [], []
    for name, chunks in (("plain", plain), ("recomputed", recomputed)):
        (tmp_path / name).mkdir()
        watch = build(config, chunks, tmp_path / name, logs=True)
        _step(watch, chunks)
        logged.append(watch.measure(1))
        lines.append(json.loads((tmp_path / name / "experts.jsonl").read_text()))
    assert logged[1] == pytest.approx(logged[0], rel=1e-6)
    assert logged[0]["moe_aux_loss"] > 0 and logged[0]["moe_z_loss"] > 0
    assert lines[1] == lines[0] and lines[0]["tokens"] == 2 * MBS * SEQ


def test_each_step_starts_afresh_and_validation_adds_nothing(single_rank, tmp_path):
    """A step's numbers are its own: what the previous step left in megatron's tracker and
    in the counts is gone, and a validation pass in between adds neither losses nor tokens:
    eval mode is enough (the pass here even keeps gradients on; validation turns them off,
    which the recomputation test covers)."""
    config = _config()
    chunks = _model(config)
    watch = build(config, chunks, tmp_path, logs=True)
    _step(watch, chunks, seed=1)
    alone = watch.measure(1)
    _step(watch, chunks, seed=2)  # not logged
    _step(watch, chunks, seed=1)
    for chunk in chunks:
        chunk.eval()
    forward_backward(chunks, batches(2, seed=3), 2, SEQ, MBS, forward_only=True)
    for chunk in chunks:
        chunk.train()
    again = watch.measure(3)
    assert again == pytest.approx(alone, rel=1e-6)
    tokens = [line.split('"tokens": ')[1].split(",")[0]
              for line in (tmp_path / "experts.jsonl").read_text().splitlines()]
    assert tokens == [str(2 * MBS * SEQ)] * 2


def test_a_collapsed_router_is_said_once_per_block_its_recovery_too_and_a_healthy_one_never(
        single_rank, caplog):
    """A router whose weight is zero scores every expert alike, so every token goes to the
    same two experts (topk breaks the tie the same way for every row): max/mean load 2 of
    the most E/k = 2, its two busiest experts 100% of the assignments. After the one-step
    warm-up, a whole window of it (steps 2-51) says the collapse of each block, once; the
    routers' weights given back, the next whole window (52-101) says each block's recovery.
    The randomly initialised routers of the same model are never named."""
    config = _config()
    window = window_steps(config.run.log_interval)
    healthy, collapsed = _model(config), _model(config)
    kept = [router.weight.detach().clone() for router in _routers(collapsed)]
    with torch.no_grad():
        for router in _routers(collapsed):
            router.weight.zero_()
    caplog.set_level(logging.INFO, logger="pretrain")
    watches = [build(config, chunks, None, logs=True) for chunks in (healthy, collapsed)]
    said = {}
    for step in range(1, 2 * window + 2):
        if step == window + 2:
            with torch.no_grad():
                for router, weight in zip(_routers(collapsed), kept, strict=True):
                    router.weight.copy_(weight)
        for chunks, watch in zip((healthy, collapsed), watches, strict=True):
            _step(watch, chunks, seed=step)
            logged = watch.measure(step)
            if chunks is collapsed and step <= window + 1:
                assert logged["moe_max_load"] == 2.0 and logged["moe_min_load"] == 0.0
            else:  # a single step may pass the imbalance level, 1.5: no window holds it
                assert logged["moe_max_load"] < 2.0
        if lines := [r.getMessage() for r in caplog.records if r.name == "pretrain"]:
            said[step] = lines
        caplog.clear()
    assert sorted(said) == [window + 1, 2 * window + 1]
    assert said[window + 1] == [
        f"step {window + 1}: the router of block {block} has collapsed: its 2 busiest of 4 "
        "experts received at least 90% of its assignments (now 100%; 50% when even) at every "
        f"logged step of steps 2-{window + 1}; if it persists, resume with a stronger "
        "balancing loss, --model.moe_aux_loss_coeff=0.02; a recovery will be said"
        for block in range(BLOCKS)]
    assert [line.split(": ")[1] for line in said[2 * window + 1]] == [
        f"the router of block {block} has recovered" for block in range(BLOCKS)]


def test_padding_up_to_capacity_is_not_counted_as_tokens(single_rank, tmp_path):
    """With a capacity factor of 1 each expert keeps at most 16 of a micro-batch's 32 x 2
    assignments; padding its input up to that capacity puts slots without a token in the
    routing map (probability 0). The counts are the tokens kept either way, and what was not
    kept is counted as dropped."""
    lines = []
    for pad in ("false", "true"):
        config = _config("--model.moe_expert_capacity_factor=1.0",
                         f"--model.moe_pad_expert_input_to_capacity={pad}")
        chunks = _model(config)
        (tmp_path / pad).mkdir()
        watch = build(config, chunks, tmp_path / pad, logs=True)
        _step(watch, chunks)
        logged = watch.measure(1)
        (line,) = (tmp_path / pad / "experts.jsonl").read_text().splitlines()
        lines.append(json.loads(line))
        assert logged["moe_dropped"] > 0
    assert lines[1] == lines[0]
    for block, received in lines[0]["received"].items():
        assert max(received) <= 2 * 16  # two micro-batches
        assert sum(received) + lines[0]["dropped"][block] == 2 * MBS * SEQ * TOPK


def test_a_dense_model_has_no_watch(single_rank):
    config = load_config(None, ["--run.steps=10", "--optim.warmup_steps=1"])
    assert build(config, [], None, logs=True) is None
