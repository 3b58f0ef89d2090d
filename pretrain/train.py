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

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.module import Float16Module

from kernels import dispatch
from model import parallel
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

    def agreed(self) -> bool:
        """True on every rank if any rank was signalled."""
        flag = torch.tensor([float(self.requested)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def params_dtype(config: Config) -> torch.dtype:
    choice = config.run.params_dtype
    if choice == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[choice]


def _mean_over_dp(losses: list[float]) -> float:
    """The batch loss on every rank: the logging ranks of the last stage contribute."""
    holds = bool(losses) and parallel_state.get_tensor_model_parallel_rank() == 0
    total = torch.tensor([sum(losses) / len(losses) if holds else 0.0, float(holds)],
                         dtype=torch.float64)
    dist.all_reduce(total)
    return (total[0] / total[1]).item()


def _grads_finite(chunks) -> bool:
    finite = all(torch.isfinite(buffer.grad_data).all().item()
                 for chunk in chunks for buffer in chunk.buffers)
    flag = torch.tensor([float(finite)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def evaluate(config: Config, chunks, dataset) -> dict:
    """Mean validation loss over run.eval_iters global batches, and its perplexity."""
    d = config.data
    for chunk in chunks:
        chunk.eval()
    losses = []
    with torch.no_grad():
        for i in range(config.run.eval_iters):
            batch = step_microbatches(dataset, i, d.global_batch_size, d.micro_batch_size)
            n = microbatches_per_step(d.global_batch_size, d.micro_batch_size)
            losses.append(_mean_over_dp(forward_backward(
                chunks, batch, n, config.seq_length, d.micro_batch_size,
                forward_only=True)))
    for chunk in chunks:
        chunk.train()
    loss = sum(losses) / len(losses)
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 80.0))}


def _model_parameters(chunks) -> int:
    """Parameters of the whole model: this rank's share summed over TP and PP ranks."""
    total = torch.tensor([count_parameters(chunks)], dtype=torch.int64)
    dist.all_reduce(total, group=parallel_state.get_model_parallel_group())
    return int(total.item())


def setup(config: Config):
    """Process groups, tokenizer and DDP-wrapped model; shared by training and evaluation."""
    # Check the layout against the launch before megatron builds groups (it would assert).
    validate(config, world_size=int(os.environ.get("WORLD_SIZE", 1)))
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
    throughput = Throughput(config, parameters)
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
        loss = _mean_over_dp(losses)
        grad_norm = float("nan")
        lr = optimizer.param_groups[0]["lr"]  # the rate this step applies
        if math.isfinite(loss) and _grads_finite(chunks):
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
        stopping = stop.agreed()
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
