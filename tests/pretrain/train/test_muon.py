"""optim.name muon: which parameters Muon steps, that its step is torch.optim.Muon's, that the
LR schedule drives both optimizers, that every scheme trains with it, and that its checkpoint
resumes exactly (and only with Muon)."""

import dataclasses
import math

import pytest
import torch

from model import decay
from model.builder import build_model, wrap_ddp
from model.config import ParallelConfig
from model.schemes import ResidualScheme
from pretrain.config import Config, DecayStyle, OptimConfig, OptimName, RunConfig
from pretrain.optim import build_optimizer
from pretrain.run import checkpoint
from runtime.errors import ConfigError
from runtime.schedule import forward_backward
from tests.helpers import MBS, SEQ, batches, tiny_model
from tests.pretrain_fixtures import cli, metrics, train_args

NO_SHARDING = ParallelConfig(distributed_optimizer=False)
BLOCK_LINEARS = ("self_attention.linear_qkv.weight", "self_attention.linear_proj.weight",
                 "mlp.linear_fc1.weight", "mlp.linear_fc2.weight")


def muon_config(scheme: str = "siamese", steps: int = 3, **optim) -> Config:
    fields = dict(name=OptimName.MUON, lr=1e-2, warmup_steps=0,
                  decay_style=DecayStyle.CONSTANT, clip_grad=0.0) | optim
    return Config(model=tiny_model(scheme), parallel=NO_SHARDING, run=RunConfig(steps=steps),
                  optim=OptimConfig(**fields))


def build(config: Config, seed: int = 7):
    chunks = wrap_ddp(build_model(config.model, config.parallel, seed=seed), config.parallel)
    return (chunks, *build_optimizer(config, chunks, torch.float32))


def step(chunks, optimizer, scheduler, index: int) -> float:
    optimizer.zero_grad()
    losses = forward_backward(chunks, batches(2, seed=index), 2, SEQ, MBS)
    ok, _, _ = optimizer.step()
    assert ok
    scheduler.step(1)
    return sum(float(loss) for loss in losses)


def weights(chunks) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in chunks[0].module.named_parameters()}


@pytest.mark.parametrize("scheme", [s.value for s in ResidualScheme])
def test_every_scheme_gives_muon_exactly_its_block_linears_and_trains(single_rank, scheme):
    """The registry's Muon set (model.decay.muon_matrix) is the blocks' attention and MLP
    linear weights, nothing else (not the embedding, the output layer, a scheme's own
    matrices); the chain's Muon optimizer holds exactly those; two steps move them."""
    chunks, optimizer, scheduler = build(muon_config(scheme, steps=2))
    named = dict(chunks[0].module.named_parameters())
    expected = {n for n in named if n.startswith("decoder.layers.") and n.endswith(BLOCK_LINEARS)}
    assert "output_layer.weight" in named  # untied (the default): a linear layer, AdamW's
    assert expected and {n for n, p in named.items() if decay.muon_matrix(p)} == expected
    adam, muon = (inner.optimizer for inner in optimizer.chained_optimizers)
    assert isinstance(muon, torch.optim.Muon) and not isinstance(adam, torch.optim.Muon)
    held = {id(p) for g in muon.param_groups for p in g["params"]}
    assert held == {id(named[n]) for n in expected}
    assert not held & {id(p) for g in adam.param_groups for p in g["params"]}
    before = weights(chunks)
    losses = [step(chunks, optimizer, scheduler, i) for i in range(2)]
    assert all(torch.isfinite(torch.tensor(losses)))
    after = weights(chunks)
    assert all(not torch.equal(before[n], after[n]) for n in expected)


def _parts(name: str, tensor: torch.Tensor, model) -> list[torch.Tensor]:
    """The separate matrices one process with unfused layers holds: Q, K and V of the QKV
    weight (megatron's rows: per query group, its heads' Q rows, then K, then V), the gate and
    up halves of the SwiGLU's fc1, else the weight itself."""
    if name.endswith("linear_qkv.weight"):
        head = model.hidden_size // model.num_attention_heads
        q = model.num_attention_heads // model.num_query_groups * head
        grouped = tensor.view(model.num_query_groups, q + 2 * head, -1)
        return [grouped[:, a:b].reshape(-1, tensor.shape[1])
                for a, b in ((0, q), (q, q + head), (q + head, q + 2 * head))]
    if name.endswith("linear_fc1.weight"):
        return list(tensor.chunk(2))
    return [tensor]


def _joined(name: str, parts: list[torch.Tensor], like: torch.Tensor, model) -> torch.Tensor:
    if name.endswith("linear_qkv.weight"):
        return torch.cat([p.view(model.num_query_groups, -1, like.shape[1]) for p in parts],
                         dim=1).view_as(like)
    return torch.cat(parts)


def test_one_process_equals_torch_muon_and_adamw_by_hand(single_rank):
    """Three steps of the chain equal torch.optim.Muon on the separate Q, K, V, gate, up,
    proj and fc2 matrices and torch.optim.AdamW on the rest (decay by role), fed the same
    gradients (a second copy of the model computes them): parameters within 1e-6. The AdamW
    is torch's fused one, the kernel optim.fused steps with: torch's foreach AdamW rounds the
    norms' weights 1e-7 apart, the next gradients differ by 1e-8, and the bf16 Newton-Schulz
    turns that into steps 1e-4 apart (one bf16 rounding of an orthogonalised entry)."""
    config = muon_config("siamese", steps=3)
    o, model = config.optim, config.model
    chunks, optimizer, scheduler = build(config)
    ref_chunks = wrap_ddp(build_model(model, NO_SHARDING, seed=7), NO_SHARDING)
    named = dict(ref_chunks[0].module.named_parameters())
    matrices = {n: [p.detach().clone() for p in _parts(n, t, model)]
                for n, t in named.items() if decay.muon_matrix(t)}
    muon = torch.optim.Muon([p for parts in matrices.values() for p in parts], lr=o.lr,
                            weight_decay=o.muon_weight_decay, momentum=o.muon_momentum,
                            nesterov=o.muon_nesterov, ns_steps=o.muon_ns_steps,
                            adjust_lr_fn="match_rms_adamw")
    rest = [(n, t) for n, t in named.items() if n not in matrices]
    adamw = torch.optim.AdamW(
        [{"params": [t for _, t in rest if decay.decayed(t)], "weight_decay": o.weight_decay},
         {"params": [t for _, t in rest if not decay.decayed(t)], "weight_decay": 0.0}],
        lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, fused=o.fused)
    for index in range(3):
        step(chunks, optimizer, scheduler, index)
        forward_backward(ref_chunks, batches(2, seed=index), 2, SEQ, MBS)
        with torch.no_grad():
            for name, parts in matrices.items():
                grads = _parts(name, named[name].main_grad, model)
                for part, grad in zip(parts, grads, strict=True):
                    part.grad = grad.clone()
            for _, tensor in rest:
                tensor.grad = tensor.main_grad.clone()
            muon.step()
            adamw.step()
            adamw.zero_grad()  # else the next backward adds to .grad (megatron's hook reads it)
            for name, parts in matrices.items():
                named[name].copy_(_joined(name, parts, named[name], model))
    got = weights(chunks)
    for name, tensor in named.items():
        err = (got[name] - tensor).abs().max().item()
        assert err <= 1e-6, (name, err)


def test_the_schedule_scales_both_optimizers(single_rank):
    """Warm-up and decay move the Muon groups' LR from their own peak (optim.muon_lr) in
    step with the AdamW groups' from optim.lr; each group has its own weight decay."""
    config = muon_config("pre", steps=10, lr=1e-3, min_lr=1e-4, muon_lr=2e-2, warmup_steps=4,
                         decay_style=DecayStyle.COSINE, weight_decay=0.1,
                         muon_weight_decay=0.05)
    _, optimizer, scheduler = build(config)
    adam, muon = (inner.optimizer for inner in optimizer.chained_optimizers)
    seen = set()
    for steps in (2, 4, 7, 10):  # in the warm-up, at the peak, decaying, at the end
        scheduler.num_steps = 0
        scheduler.step(steps)
        lr = adam.param_groups[0]["lr"]
        seen.add(lr)
        assert {g["lr"] for g in adam.param_groups} == {lr}
        for group in muon.param_groups:  # muon_lr / lr = 20, also at min_lr
            assert group["lr"] == pytest.approx(20 * lr, rel=1e-9)
            assert group["weight_decay"] == 0.05
        assert {g["weight_decay"] for g in adam.param_groups} == {0.1, 0.0}
    assert len(seen) == 4 and min(seen) == pytest.approx(1e-4)


@pytest.mark.slow  # the checkpoint goes through megatron's writer (a process)
def test_a_muon_checkpoint_resumes_exactly(single_rank, tmp_path):
    """Two steps, saved, resumed for two more: the losses and weights of four uninterrupted
    steps, bit for bit (the momentum was saved). A changed Muon LR or weight decay is a
    schedule change: refused without optim.override_schedule, taken with it. (A resume with
    AdamW is refused from the checkpoint's record before any tensor is read: the CLI test
    below.)"""
    config = muon_config("siamese", steps=4)
    chunks, optimizer, scheduler = build(config)
    reference = [step(chunks, optimizer, scheduler, i) for i in range(4)]
    expected = weights(chunks)
    chunks, optimizer, scheduler = build(config)
    assert [step(chunks, optimizer, scheduler, i) for i in range(2)] == reference[:2]
    checkpoint.save(tmp_path, 2, chunks, optimizer, scheduler, keep_last=1, record={})
    found = checkpoint.resolve(tmp_path)
    chunks, optimizer, scheduler = build(config, seed=8)  # other weights: all must load
    checkpoint.load(found, checkpoint.read_record(found), chunks, optimizer, scheduler)
    assert [step(chunks, optimizer, scheduler, i) for i in range(2, 4)] == reference[2:]
    got = weights(chunks)
    assert all(torch.equal(got[n], expected[n]) for n in expected)
    changed = dataclasses.replace(config.optim, muon_lr=5e-3, muon_weight_decay=0.05)
    chunks, optimizer, scheduler = build(dataclasses.replace(config, optim=changed))
    with pytest.raises(ConfigError, match=r"^optim.muon_lr \(5e-03|^optim.muon_lr \(0.005"):
        checkpoint.load(found, checkpoint.read_record(found), chunks, optimizer, scheduler)
    changed.override_schedule = True  # the Muon groups take the new peak and decay
    chunks, optimizer, scheduler = build(dataclasses.replace(config, optim=changed))
    checkpoint.load(found, checkpoint.read_record(found), chunks, optimizer, scheduler)
    adam, muon = (inner.optimizer for inner in optimizer.chained_optimizers)
    assert {(g["lr"], g["weight_decay"]) for g in muon.param_groups} == {(5e-3, 0.05)}
    assert {g["lr"] for g in adam.param_groups} == {1e-2}


@pytest.mark.slow  # the CLI, twice
def test_the_cli_trains_with_muon_and_refuses_to_resume_with_adamw(data, tmp_path):
    """The documented command (docs/training.md#muon) on the test corpus, with the template's
    distributed optimizer and Muon's own LR (twice AdamW's): a short run, its optimizer
    recorded, both LRs in the metrics and Muon's on the console; a resume with the other
    optimizer is one line, exit 2."""
    run = tmp_path / "run"
    steps = ("--run.steps=3",)
    done = cli(*train_args(data, run, "--optim.name=muon", "--optim.muon_lr=6e-3", *steps))
    assert 'name = "muon"' in (run / "config.toml").read_text()
    records = [r for r in metrics(run) if "loss" in r]
    assert len(records) == 3 and all(math.isfinite(r["loss"]) for r in records), records
    assert [r["muon_lr"] for r in records] == pytest.approx([2 * r["lr"] for r in records])
    assert records[-1]["lr"] > 0 and f"muon_lr {records[-1]['muon_lr']:.2e}" in done.stderr
    refused = cli(*train_args(data, run, "--run.steps=4"), check=False)
    assert refused.returncode == 2
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "holds the optimizer state of optim.name=muon" in errors[0]
