"""Per-stream diagnostics: values against a hand-run forward/backward, logging to metrics.jsonl
and W&B, parallel layouts, loss-spike events, and no hooks when off."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from kernels.norms import Norm
from model.builder import build_model, wrap_ddp
from model.config import ParallelConfig
from model.schemes import PositionEmbedding
from pretrain.config import load_config
from pretrain.train.diagnostics import LossSpikeDetector, StreamDiagnostics, build
from runtime import weights
from runtime.schedule import forward_backward
from tests.helpers import MBS, SEQ, batches, tiny_model
from tests.pretrain_fixtures import cli, metrics, train_args
from tests.wandb_reader import read_run


def _rms_norm(t: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps) * weight


def manual_stats(model, microbatches: list[dict], two_stream: bool) -> dict[str, float]:
    """The expected diagnostics, computed without hooks: run the blocks one by one by hand,
    keep every block output, backpropagate the mean loss over the micro-batches, and reduce
    the outputs and their gradients; the merge's norms are written out here too."""
    names = ("x", "y") if two_stream else ("h",)
    layers = list(model.decoder.layers)
    sq = {(n, i): 0.0 for n in names for i in range(len(layers))}
    grad = dict.fromkeys(sq, 0.0)
    count = [0] * len(layers)
    merge = {"a": 0.0, "b": 0.0, "cos": 0.0, "tokens": 0, "elems": 0}
    eps = model.config.layernorm_epsilon
    rope = model.position_embedding_type == PositionEmbedding.ROPE.value
    for mb in microbatches:
        h = model.embedding(input_ids=mb["tokens"], position_ids=mb["position_ids"])
        rotary = model.rotary_pos_emb(h.shape[0]) if rope else None
        outs = []
        for layer in layers:
            h, _ = layer(h, attention_mask=None, rotary_pos_emb=rotary)
            h.retain_grad()
            outs.append(h)
        final = model.decoder.final_layernorm
        # Untied embeddings (the default) use the output layer's own weight: pass none.
        tied = (model.shared_embedding_or_output_weight()
                if model.share_embeddings_and_output_weights else None)
        logits, _ = model.output_layer(final(h) if final is not None else h, weight=tied)
        if hasattr(model, "_scale_logits"):  # megatron's output-logit scaling, if configured
            logits = model._scale_logits(logits)
        per_token = model.compute_language_model_loss(mb["labels"], logits)
        mask = mb["loss_mask"].float()
        ((per_token * mask).sum() / mask.sum() / len(microbatches)).backward()
        for i, out in enumerate(outs):
            parts = out.detach().chunk(2, -1) if two_stream else (out.detach(),)
            grads = out.grad.chunk(2, -1) if two_stream else (out.grad,)
            for n, part, g in zip(names, parts, grads, strict=True):
                sq[n, i] += part.pow(2).sum().item()
                grad[n, i] += g.pow(2).sum().item()
            count[i] += parts[0].numel()
        if two_stream:
            x, y = outs[-1].detach().chunk(2, -1)
            a = _rms_norm(x, final.x_norm.weight.detach(), eps)
            b = _rms_norm(y, final.y_norm.weight.detach(), eps)
            merge["a"] += a.pow(2).sum().item()
            merge["b"] += b.pow(2).sum().item()
            cos = (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))
            merge["cos"] += cos.sum().item()
            merge["tokens"] += cos.numel()
            merge["elems"] += a.numel()
    out = {}
    for (n, i), value in sq.items():
        out[f"diag/{n}_rms/block{i:02d}"] = math.sqrt(value / count[i])
        out[f"diag/{n}_grad_norm/block{i:02d}"] = math.sqrt(grad[n, i])
    if two_stream:
        na, nb = math.sqrt(merge["a"]), math.sqrt(merge["b"])
        out["diag/merge/x_rms"] = na / math.sqrt(merge["elems"])
        out["diag/merge/y_rms"] = nb / math.sqrt(merge["elems"])
        out["diag/merge/cosine"] = merge["cos"] / merge["tokens"]
        out["diag/merge/x_share"] = na / (na + nb)
    return out


def _assert_close(logged: dict, expected: dict, rel: float = 1e-5) -> None:
    assert set(expected) <= set(logged), sorted(set(expected) - set(logged))
    for key, value in expected.items():
        assert logged[key] == pytest.approx(value, rel=rel), key


def _hooks(chunks) -> int:
    return sum(len(m._forward_hooks) for c in chunks for m in c.modules())


@pytest.mark.parametrize("scheme", ["siamese", "siamese_hybrid", "pre", "post"])
def test_values_match_a_hand_run_pass(single_rank, scheme):
    model = tiny_model(scheme)
    chunks = wrap_ddp(build_model(model, ParallelConfig()), ParallelConfig())
    diag = StreamDiagnostics(chunks, model.num_layers, interval=1,
                             two_stream=model.residual_scheme.traits.two_stream)
    data = batches(2)
    with diag.step(1):
        forward_backward(chunks, data, 2, SEQ, MBS)
    logged = diag.records(1, 1.0)[0]
    assert logged["step"] == 1
    expected = manual_stats(chunks[0].module, data, model.residual_scheme.traits.two_stream)
    _assert_close(logged, expected)
    if model.residual_scheme.traits.two_stream:
        assert 0 < logged["diag/merge/x_share"] < 1
    assert _hooks(chunks) == 0


def _known_streams(table, out_weight, mb, num_layers, eps, two_stream):
    """The streams of a model whose branches output zero, written out with no model code:
    Pre-Norm keeps h = embedding in every block; SiameseNorm's x is post-normed twice per block
    (norm weights 2) and y stays the embedding; the merge uses Na weight 3 and Nb weight 1.
    Returns every block's (x, y) or (h,) outputs, after backpropagating the loss into them."""
    table = table.clone().requires_grad_()  # a leaf, so the streams carry gradients
    e = table[mb["tokens"]].transpose(0, 1).contiguous()  # [s, b, h], as megatron lays it out
    x, y, outs = e, e, []
    for _ in range(num_layers):
        if two_stream:
            x = _rms_norm(_rms_norm(x, 2.0, eps), 2.0, eps)  # r = 0: x = Npost_mlp(Npost_attn(x))
        y = y.clone()  # y + r with r = 0: a new tensor, so each block's gradient is its own
        outs.append((x, y) if two_stream else (y,))
        for t in outs[-1]:
            t.retain_grad()
    if two_stream:
        merged = _rms_norm(_rms_norm(x, 3.0, eps) + _rms_norm(y, 1.0, eps), 1.0, eps)
    else:
        merged = _rms_norm(y, 1.0, eps)
    logits = merged @ out_weight.t()
    labels = mb["labels"].transpose(0, 1)
    torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                      labels.reshape(-1)).div(2).backward()
    return outs


@pytest.mark.parametrize("scheme", ["siamese", "pre"])
def test_values_on_a_model_with_known_streams(single_rank, scheme):
    """Zero output projections make every branch output zero, so the streams follow from the
    embedding table alone: Pre-Norm's h and SiameseNorm's y stay the embedding (RMS of the
    table's rows), x is the embedding normalised to RMS 2, and the merge sees Na(x) and Nb(y)
    pointing the same way (cosine 1) with norms 3 : 1 (x share 0.75)."""
    model = tiny_model(scheme)
    chunks = wrap_ddp(build_model(model, ParallelConfig()), ParallelConfig())
    gpt = chunks[0].module
    embedding = gpt.embedding.word_embeddings.weight
    table = torch.randn(embedding.shape, generator=torch.Generator().manual_seed(3))
    table = table.to(embedding.device)
    with torch.no_grad():
        gpt.embedding.word_embeddings.weight.copy_(table)
        for layer in gpt.decoder.layers:
            layer.self_attention.linear_proj.weight.zero_()
            layer.mlp.linear_fc2.weight.zero_()
            for module in layer.modules():  # every norm (branches are zero: only x sees them)
                if isinstance(module, Norm):
                    module.weight.fill_(2.0)
        if model.residual_scheme.traits.two_stream:
            gpt.decoder.final_layernorm.x_norm.weight.fill_(3.0)
    two_stream = model.residual_scheme.traits.two_stream
    diag = StreamDiagnostics(chunks, model.num_layers, interval=1, two_stream=two_stream)
    data = batches(2)
    with diag.step(1):
        forward_backward(chunks, data, 2, SEQ, MBS)
    logged = diag.records(1, 1.0)[0]

    eps = model.norm_eps
    out_weight = gpt.output_layer.weight.detach()
    per_mb = [_known_streams(table, out_weight, mb, model.num_layers, eps, two_stream)
              for mb in data]
    names = ("x", "y") if two_stream else ("h",)
    for block in range(model.num_layers):
        for i, name in enumerate(names):
            value = torch.cat([outs[block][i].detach() for outs in per_mb])
            grad = torch.cat([outs[block][i].grad for outs in per_mb])
            assert logged[f"diag/{name}_rms/block{block:02d}"] == pytest.approx(
                value.pow(2).mean().sqrt().item(), rel=1e-5)
            assert logged[f"diag/{name}_grad_norm/block{block:02d}"] == pytest.approx(
                grad.norm().item(), rel=1e-4)
    # The closed forms behind those numbers (the norms' eps moves them by < 1e-5 here).
    tokens = torch.cat([mb["tokens"].reshape(-1) for mb in data])
    embedding_rms = table[tokens].pow(2).mean().sqrt().item()
    stream = "y" if two_stream else "h"
    assert logged[f"diag/{stream}_rms/block03"] == pytest.approx(embedding_rms, rel=1e-6)
    if two_stream:
        assert logged["diag/x_rms/block00"] == pytest.approx(2.0, rel=1e-4)
        assert logged["diag/merge/cosine"] == pytest.approx(1.0, rel=1e-6)
        assert logged["diag/merge/x_share"] == pytest.approx(0.75, rel=1e-4)
        assert logged["diag/merge/x_rms"] == pytest.approx(3.0, rel=1e-4)
        # y passes every block unchanged, so the same gradient reaches each block's y.
        assert logged["diag/y_grad_norm/block00"] == pytest.approx(
            logged["diag/y_grad_norm/block03"], rel=1e-6)


def test_no_hooks_unless_a_step_is_measured(single_rank):
    model = tiny_model("siamese")
    chunks = wrap_ddp(build_model(model, ParallelConfig()), ParallelConfig())
    schedule = ["--run.steps=10", "--optim.warmup_steps=1"]
    config = load_config(None, [*schedule, "--diagnostics.interval=0"])
    assert build(config, chunks) is None  # off: nothing is even constructed
    diag = build(load_config(None, [*schedule, "--diagnostics.interval=3"]), chunks)
    with diag.step(1):
        assert _hooks(chunks) == 0
        forward_backward(chunks, batches(1), 1, SEQ, MBS)
    assert diag.records(1, 5.0) == []
    with diag.step(3):
        assert _hooks(chunks) == model.num_layers + 1  # every block and the merge
    assert _hooks(chunks) == 0
    with pytest.raises(RuntimeError), diag.step(6):
        raise RuntimeError("a failing step still removes its hooks")
    assert _hooks(chunks) == 0


def test_loss_spike_detector():
    detector = LossSpikeDetector(factor=1.5, window=4, min_history=3)
    # Falling losses never spike; the first min_history steps only fill the window.
    assert [detector.update(s, v) for s, v in enumerate([9.0, 8.0, 7.0, 6.0], 1)] == [None] * 4
    event = detector.update(5, 10.0)  # median of (9, 8, 7, 6) = 7.5; 10 < 11.25
    assert event is None
    event = detector.update(6, 12.0)  # median of (8, 7, 6, 10) = 7.5; 12 > 11.25
    assert event == {"step": 6, "event": "loss_spike", "spike_loss": 12.0, "spike_median": 7.5}
    nan = detector.update(7, float("nan"))  # non-finite: an event, never in the window
    assert nan["event"] == "loss_spike" and list(detector.losses) == [7.0, 6.0, 10.0, 12.0]


@pytest.fixture(scope="module")
def logged_run(data, tmp_path_factory):
    """Two steps through the real CLI, diagnostics every step, W&B offline, a checkpoint after
    each step (so step 2's values can be recomputed from the weights it started with)."""
    run = tmp_path_factory.mktemp("diag") / "run"
    cli(*train_args(data, run, "--run.steps=2", "--optim.warmup_steps=1", "--run.save_interval=1",
                    "--data.valid_samples=0",
                    "--diagnostics.interval=1", "--logging.wandb_mode=offline"))
    return run


def test_run_logs_correct_diagnostics_to_jsonl_and_wandb(single_rank, logged_run):
    rows = [r for r in metrics(logged_run) if any(k.startswith("diag/") for k in r)]
    assert [r["step"] for r in rows] == [1, 2]
    config = load_config(str(logged_run / "config.toml"))
    # Recompute step 2 by hand: the step-1 checkpoint's weights on the batch step 2 trained on.
    from pretrain.data.batches import build_datasets, step_microbatches
    from pretrain.data.tokenizer import open_tokenizer

    (model,) = build_model(config.model, config.parallel)
    weights.load([model], logged_run / "checkpoints" / "step_00000001")
    train_set, _ = build_datasets(config, open_tokenizer(config.data.tokenizer))
    d = config.data
    second_batch = d.global_batch_size  # the first sample of step 1
    microbatches = list(step_microbatches(train_set, second_batch, d.global_batch_size,
                                          d.micro_batch_size))
    expected = manual_stats(model, microbatches, two_stream=True)
    assert len(expected) == 4 * config.model.num_layers + 4
    _assert_close(rows[1], expected, rel=1e-4)
    # W&B holds the same numbers at the same steps.
    (wandb_file,) = sorted((logged_run / "wandb").glob("offline-run-*/run-*.wandb"))
    _, history = read_run(wandb_file)
    for row in rows:
        (logged,) = [h for h in history if h["_step"] == row["step"] and "diag/merge/cosine" in h]
        for key in expected:
            assert logged[key] == pytest.approx(row[key], rel=1e-12), key


@pytest.mark.slow
def test_tp_sp_and_pp_runs_log_the_single_process_values(data, logged_run, tmp_path):
    """From the same weights: TP=2 with sequence parallelism (each rank holds half the
    tokens) and PP=2 (each stage holds one block, the last one the merge) log what one
    process logs."""
    init = f"--run.init_from={Path(logged_run) / 'checkpoints' / 'step_00000001'}"
    common = ["--run.steps=1", "--optim.warmup_steps=0", "--data.valid_samples=0",
              "--diagnostics.interval=1", init]
    logged = {}
    for name, layout, nproc in (("single", [], 1),
                                ("tp2sp", ["--parallel.tp=2",
                                           "--parallel.sequence_parallel=true"], 2),
                                ("pp2", ["--parallel.pp=2"], 2)):
        cli(*train_args(data, tmp_path / name, *common, *layout), nproc=nproc)
        (logged[name],) = [r for r in metrics(tmp_path / name) if "diag/merge/cosine" in r]
    reference = {k: v for k, v in logged["single"].items() if k.startswith("diag/")}
    assert len(reference) == 4 * 2 + 4
    for name in ("tp2sp", "pp2"):
        _assert_close(logged[name], reference, rel=1e-4)
