"""The training loop: one function, :func:`train`, run on every rank.

Per step: the step's micro-batches go through megatron's schedule, the loss and gradients are
checked for NaN/Inf (a bad step is skipped and counted; too many in a row abort), the
optimizer and LR schedule step, and metrics, validation and checkpoints follow their
intervals. SIGTERM/SIGUSR1 finish the current step, save, and return normally.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import time
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.module import Float16Module

from kernels import dispatch
from model import device, parallel
from model.builder import build_model, count_parameters, wrap_ddp
from model.config import ConfigError
from model.schedule import forward_backward
from pretrain import checkpoint, diagnostics
from pretrain.config import Config, validate
from pretrain.data import build_datasets, microbatches_per_step, step_microbatches
from pretrain.metrics import MetricsLogger
from pretrain.optim import build_optimizer
from pretrain.rundir import prepare_run_dir, run_metadata
from pretrain.throughput import Throughput
from pretrain.tokenizer import Tokenizer

log = logging.getLogger("pretrain")


class TrainingAborted(RuntimeError):
    """The run cannot continue (e.g. too many consecutive non-finite steps)."""


class _StopRequest:
    """Remembers SIGTERM/SIGUSR1 so the loop can stop at a step boundary."""

    def __init__(self) -> None:
        self.requested = False
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handle)

    def _handle(self, signum, _frame) -> None:
        log.info("received %s: will save and stop after this step",
                 signal.Signals(signum).name)
        self.requested = True


def params_dtype(config: Config) -> torch.dtype:
    choice = config.run.params_dtype
    if choice == "auto":
        return torch.bfloat16 if device.uses_cuda() else torch.float32
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[choice]


class StepStatus(NamedTuple):
    loss: float
    """The batch loss: the mean over data-parallel replicas of their micro-batch means."""
    finite: bool
    """The loss and every gradient on every rank are finite."""
    stop: bool
    """Some rank was asked (by a signal) to stop."""


def _loss_share(losses: list[torch.Tensor]) -> tuple[torch.Tensor, float]:
    """This rank's (mean micro-batch loss, weight) towards the batch loss: only the logging
    ranks of the last pipeline stage (first TP rank) hold a loss; the others add zero."""
    if losses and parallel_state.get_tensor_model_parallel_rank() == 0:
        return torch.stack(losses).double().mean(), 1.0
    return torch.zeros((), dtype=torch.float64, device=device.compute_device()), 0.0


def step_status(losses: list[torch.Tensor], chunks, stop: _StopRequest) -> StepStatus:
    """Everything a step's host-side decisions need, agreed by every rank in one all-reduce
    and read back to the host once (one synchronisation per step)."""
    loss, weight = _loss_share(losses)
    nonfinite = sum((~torch.isfinite(buffer.grad_data).all()).double()
                    for chunk in chunks for buffer in chunk.buffers)
    flags = torch.tensor([weight, float(stop.requested)], dtype=torch.float64,
                         device=loss.device)
    totals = torch.cat([loss.reshape(1), flags, torch.as_tensor(nonfinite).reshape(1).to(loss)])
    dist.all_reduce(totals)
    loss_sum, holders, stops, bad = totals.tolist()
    mean = loss_sum / holders
    return StepStatus(mean, math.isfinite(mean) and bad == 0, stops > 0)


def _mean_loss(per_batch: list[torch.Tensor]) -> float:
    """The mean over batches of the batch loss (mean over data-parallel replicas), read back
    once."""
    shares = [_loss_share(losses) for losses in per_batch]
    totals = torch.stack([torch.stack([loss, loss.new_tensor(weight)]) for loss, weight in shares])
    dist.all_reduce(totals)
    return float((totals[:, 0] / totals[:, 1]).mean())


def evaluate(config: Config, chunks, dataset) -> dict:
    """Mean validation loss over run.eval_iters global batches, and its perplexity."""
    d = config.data
    for chunk in chunks:
        chunk.eval()
    per_batch = []
    with torch.no_grad():
        for i in range(config.run.eval_iters):
            batch = step_microbatches(dataset, i, d.global_batch_size, d.micro_batch_size)
            n = microbatches_per_step(d.global_batch_size, d.micro_batch_size)
            per_batch.append(forward_backward(
                chunks, batch, n, config.seq_length, d.micro_batch_size, forward_only=True))
    for chunk in chunks:
        chunk.train()
    loss = _mean_loss(per_batch)
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 80.0))}


def _model_parameters(chunks) -> int:
    """Parameters of the whole model: this rank's share summed over TP and PP ranks."""
    total = torch.tensor([count_parameters(chunks)], dtype=torch.int64,
                         device=device.compute_device())
    dist.all_reduce(total, group=parallel_state.get_model_parallel_group())
    return int(total.item())


def setup(config: Config):
    """Process groups, tokenizer and DDP-wrapped model; shared by training and evaluation."""
    # Check the layout against the launch before megatron builds groups (it would assert).
    validate(config, world_size=int(os.environ.get("WORLD_SIZE", 1)))
    if config.run.deterministic:  # before NCCL and cuBLAS start
        device.make_deterministic()
    parallel.initialize(config.parallel, seed=config.run.seed)
    try:  # before the model is built, so every norm uses the chosen kernels
        dispatch.set_backend(config.kernels.norm_backend)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    tokenizer = Tokenizer(config.data.tokenizer)
    if config.model.vocab_size < tokenizer.vocab_size:
        raise ConfigError(f"model.vocab_size ({config.model.vocab_size}) must be >= the "
                          f"tokenizer's vocabulary ({tokenizer.vocab_size}, "
                          f"{config.data.tokenizer})")
    dtype = params_dtype(config)
    chunks = build_model(config.model, config.parallel, dtype)
    if dtype == torch.bfloat16:  # bf16 weights, fp32 logits for the loss (as Megatron-LM)
        chunks = [Float16Module(chunk.config, chunk) for chunk in chunks]
    return tokenizer, wrap_ddp(chunks, config.parallel)


def train(config: Config) -> dict:
    """Train (resuming from the newest complete checkpoint in the run folder, if any).
    Returns the final validation metrics."""
    run_dir = Path(config.run.dir)
    tokenizer, chunks = setup(config)
    optimizer, scheduler = build_optimizer(config, chunks, params_dtype(config))
    parameters = _model_parameters(chunks)
    prepare_run_dir(run_dir, config, parameters)
    r, d = config.run, config.data
    ckpt_root = run_dir / "checkpoints"
    start = 0
    previous = checkpoint.resolve(ckpt_root)
    if previous is not None:
        start = checkpoint.load(previous, chunks, optimizer, scheduler)
        log.info("resumed from %s at step %d", previous, start)
    elif r.init_from:
        checkpoint.load_weights(Path(r.init_from), chunks)
        log.info("model weights initialised from %s", r.init_from)
    train_set, valid_set = build_datasets(config, tokenizer)
    metrics = MetricsLogger(config, run_dir, run_metadata(parameters))
    stop = _StopRequest()
    throughput = Throughput(config)
    diag = diagnostics.build(config, chunks)  # None when off: no hooks at all
    micro = microbatches_per_step(d.global_batch_size, d.micro_batch_size)
    tokens_per_step = d.global_batch_size * config.seq_length
    if start == 0 and r.eval_iters:
        metrics.log({"step": 0, **evaluate(config, chunks, valid_set)})
    bad_in_a_row = skipped = 0
    step = start
    while step < r.steps:
        began = time.perf_counter()
        optimizer.zero_grad()
        with diag.step(step + 1) if diag else contextlib.nullcontext():
            losses = forward_backward(chunks, step_microbatches(
                train_set, step, d.global_batch_size, d.micro_batch_size),
                micro, config.seq_length, d.micro_batch_size)
        status = step_status(losses, chunks, stop)
        loss = status.loss
        grad_norm = float("nan")
        lr = optimizer.param_groups[0]["lr"]  # the rate this step applies
        if status.finite:
            _, grad_norm, _ = optimizer.step()
            scheduler.step(increment=1)
            bad_in_a_row = 0
        else:
            skipped += 1
            bad_in_a_row += 1
            log.warning("step %d: non-finite loss or gradient, step skipped", step + 1)
        step += 1
        elapsed = time.perf_counter() - began
        if step % r.log_interval == 0 or step == r.steps:
            record = {"step": step, "consumed_tokens": step * tokens_per_step, "loss": loss,
                      "lr": lr,
                      "grad_norm": float(grad_norm) if grad_norm is not None else None,
                      "skipped_steps": skipped, **throughput.measure(elapsed)}
            metrics.log(record)
            log.info("step %d/%d loss %.4f lr %.2e grad_norm %.3f %.0f tok/s", step, r.steps,
                     loss, record["lr"], record["grad_norm"] or 0.0, record["tokens_per_s"])
        for extra in diag.records(step, loss) if diag else ():  # collective on a measured step
            metrics.log(extra)
        if bad_in_a_row >= r.max_nonfinite_steps:
            metrics.finish()
            raise TrainingAborted(
                f"{bad_in_a_row} consecutive steps had a NaN/Inf loss or gradient "
                f"(run.max_nonfinite_steps = {r.max_nonfinite_steps}); last good "
                f"checkpoint: {checkpoint.resolve(ckpt_root)}")
        if r.eval_iters and step % r.eval_interval == 0 and step < r.steps:
            metrics.log({"step": step, **evaluate(config, chunks, valid_set)})
        stopping = status.stop
        if stopping or (r.save_interval and step % r.save_interval == 0) or step == r.steps:
            checkpoint.save(ckpt_root, step, chunks, optimizer, scheduler, r.keep_last)
        if stopping:
            log.info("stopped by signal after step %d; checkpoint saved", step)
            metrics.finish()
            return {"stopped_at": step}
    final = evaluate(config, chunks, valid_set) if r.eval_iters else {}
    if final:
        metrics.log({"step": step, **final})
    metrics.finish()
    return final
