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
from pretrain import checkpoint, console, diagnostics
from pretrain.config import Config, validate
from pretrain.data import (
    build_datasets,
    check_data,
    microbatches_per_step,
    step_microbatches,
)
from pretrain.dry_run import human
from pretrain.metrics import MetricsLogger, is_logging_rank
from pretrain.optim import build_optimizer
from pretrain.progress import Progress
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


def _loss_share(losses: list[torch.Tensor]) -> torch.Tensor:
    """This rank's [mean micro-batch loss, weight] towards the batch loss (float64, on the
    compute device): only the logging ranks of the last pipeline stage (first TP rank) hold a
    loss; the others add [0, 0]."""
    share = torch.zeros(2, dtype=torch.float64, device=device.compute_device())
    if losses and parallel_state.get_tensor_model_parallel_rank() == 0:
        share[0], share[1] = torch.stack(losses).double().mean(), 1.0
    return share


def step_status(losses: list[torch.Tensor], chunks, stop: _StopRequest) -> StepStatus:
    """Everything a step's host-side decisions need, agreed by every rank in one all-reduce
    and read back to the host once (one synchronisation per step)."""
    share = _loss_share(losses)
    nonfinite = sum((~torch.isfinite(buffer.grad_data).all() for chunk in chunks
                     for buffer in chunk.buffers), share.new_zeros(()))
    totals = torch.cat([share, nonfinite.reshape(1), share.new_tensor([stop.requested])])
    dist.all_reduce(totals)
    loss_sum, holders, bad, stops = totals.tolist()
    mean = loss_sum / holders
    return StepStatus(mean, math.isfinite(mean) and bad == 0, stops > 0)


def _mean_loss(per_batch: list[list[torch.Tensor]]) -> float:
    """The mean over batches of the batch loss (mean over data-parallel replicas), read back
    once."""
    totals = torch.stack([_loss_share(losses) for losses in per_batch])
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


def setup(config: Config, training: bool = True):
    """Process groups, tokenizer and DDP-wrapped model; shared by training and evaluation
    (``training=False``: the LR schedule is not checked)."""
    # Check the layout against the launch before megatron builds groups (it would assert).
    validate(config, world_size=int(os.environ.get("WORLD_SIZE", 1)), training=training)
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
    console.quiet_other_ranks(is_logging_rank())
    optimizer, scheduler = build_optimizer(config, chunks, params_dtype(config))
    parameters = _model_parameters(chunks)
    r, d = config.run, config.data
    ckpt_root = run_dir / "checkpoints"
    previous = checkpoint.resolve(ckpt_root)
    check_data(config, tokenizer)  # a data mistake stops the run before it writes anything
    prepare_run_dir(run_dir, config, parameters, resuming=previous is not None)
    start = 0
    if previous is not None:
        start = checkpoint.load(previous, chunks, optimizer, scheduler)
    elif r.init_from:
        checkpoint.load_weights(Path(r.init_from), chunks)
    announce(config, parameters, start, previous)
    train_set, valid_set = build_datasets(config, tokenizer)
    metrics = MetricsLogger(config, run_dir, run_metadata(parameters))
    progress = Progress(start, r.steps, enabled=is_logging_rank())
    stop = _StopRequest()
    throughput = Throughput(config)
    diag = diagnostics.build(config, chunks)  # None when off: no hooks at all
    micro = microbatches_per_step(d.global_batch_size, d.micro_batch_size)
    tokens_per_step = d.global_batch_size * config.seq_length
    def validation(at: int) -> dict:
        result = evaluate(config, chunks, valid_set)
        metrics.log({"step": at, **result})
        progress.message(f"validation at step {at}: loss {result['val_loss']:.4f}, "
                         f"perplexity {result['val_ppl']:.1f}")
        return result

    if start == 0 and r.eval_iters:
        validation(0)
    progress.begin()  # after the first validation: the ETA counts training steps only
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
        else:
            record = None
        progress.step(step, record)
        for extra in diag.records(step, loss) if diag else ():  # collective on a measured step
            metrics.log(extra)
        if bad_in_a_row >= r.max_nonfinite_steps:
            progress.close()
            metrics.finish()
            raise TrainingAborted(
                f"{bad_in_a_row} consecutive steps had a NaN/Inf loss or gradient "
                f"(run.max_nonfinite_steps = {r.max_nonfinite_steps}); last good "
                f"checkpoint: {checkpoint.resolve(ckpt_root)}")
        if r.eval_iters and step % r.eval_interval == 0 and step < r.steps:
            validation(step)
        stopping = status.stop
        if stopping or (r.save_interval and step % r.save_interval == 0) or step == r.steps:
            checkpoint.save(ckpt_root, step, chunks, optimizer, scheduler, r.keep_last)
        if stopping:
            progress.message(f"stopped by signal after step {step}; checkpoint saved")
            progress.close()
            metrics.finish()
            return {"stopped_at": step}
    progress.close()
    final = validation(step) if r.eval_iters else {}
    metrics.finish()
    return final


def announce(config: Config, parameters: int, start: int, previous: Path | None) -> None:
    """The first screen: what is trained, where, on what, and from which point."""
    m, p, d, r = config.model, config.parallel, config.data, config.run
    dp = parallel_state.get_data_parallel_world_size()
    where = device.compute_device()
    hardware = f"{where} ({device.device_name()})" if device.uses_cuda() else "cpu"
    tokens = d.global_batch_size * config.seq_length
    log.info("training %s: %s parameters (%d layers x %d, %d heads), %s on %s",
             m.residual_scheme, f"{parameters:,}", m.num_layers, m.hidden_size,
             m.num_attention_heads, str(params_dtype(config)).removeprefix("torch."), hardware)
    log.info("layout: world %d = tp %d x pp %d x dp %d; %d micro-batches of %d sequences per "
             "step and data-parallel rank", dist.get_world_size(), p.tp, p.pp, dp,
             microbatches_per_step(d.global_batch_size, d.micro_batch_size), d.micro_batch_size)
    log.info("data: %s; %s tokens per step x %s steps = %s tokens",
             ", ".join(d.prefixes), f"{tokens:,}", f"{r.steps:,}", human(tokens * r.steps))
    if previous is not None:
        point = f"resuming from {previous} (step {start} of {r.steps})"
    elif r.init_from:
        point = f"starting at step 0 from the weights of {r.init_from}"
    else:
        point = "starting at step 0"
    log.info("run folder: %s; %s", r.dir, point)
