"""The training loop: one function, :func:`train`, run on every rank.

Per step: the step's micro-batches go through megatron's schedule, the loss and gradients are
checked for NaN/Inf (a bad step is skipped and counted; too many in a row abort), the
optimizer and LR schedule step, and metrics, validation and checkpoints follow their
intervals. SIGTERM/SIGUSR1 finish the current step, save, and return normally; during
start-up they stop the run before its first step, with nothing to save (pretrain.run.stop).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from model.builder import count_parameters
from pretrain.build import params_dtype, preflight, setup
from pretrain.config import Config
from pretrain.data.batches import (
    build_datasets,
    microbatches_per_step,
    step_microbatches,
)
from pretrain.data.position import DataPosition
from pretrain.hf import llama as hf_llama
from pretrain.optim import build_optimizer
from pretrain.report import console
from pretrain.report.metrics import MetricsLogger, check_wandb, is_logging_rank
from pretrain.report.progress import Progress
from pretrain.report.throughput import Throughput
from pretrain.report.units import human
from pretrain.run import checkpoint
from pretrain.run.folder import prepare_run_dir, run_metadata
from pretrain.run.lock import RunLock
from pretrain.run.stop import StopRequest
from pretrain.train import diagnostics
from pretrain.train.evaluate import evaluate, loss_share
from pretrain.train.start import StartPoint, check_start, sha256
from runtime import device, parallel, weights
from runtime.errors import CheckpointError
from runtime.schedule import forward_backward

log = logging.getLogger("pretrain")


class TrainingAborted(RuntimeError):
    """The run cannot continue (e.g. too many consecutive non-finite steps)."""


class StepStatus(NamedTuple):
    loss: float
    """The batch loss: the mean over data-parallel replicas of their micro-batch means."""
    finite: bool
    """The loss and every gradient on every rank are finite."""
    stop: bool
    """Some rank was asked (by a signal) to stop."""


def step_status(losses: list[torch.Tensor], chunks, stop: StopRequest) -> StepStatus:
    """Everything a step's host-side decisions need, agreed by every rank in one all-reduce
    and read back to the host once (one synchronisation per step)."""
    share = loss_share(losses)
    nonfinite = sum((~torch.isfinite(buffer.grad_data).all() for chunk in chunks
                     for buffer in chunk.buffers), share.new_zeros(()))
    totals = torch.cat([share, nonfinite.reshape(1), share.new_tensor([stop.requested])])
    dist.all_reduce(totals)
    loss_sum, holders, bad, stops = totals.tolist()
    mean = loss_sum / holders
    return StepStatus(mean, math.isfinite(mean) and bad == 0, stops > 0)


def weights_finite(chunks) -> bool:
    """Every model weight on every rank is finite (one all-reduce), checked before a save."""
    bad = sum((~torch.isfinite(p).all() for chunk in chunks for p in chunk.parameters()),
              torch.zeros((), device=device.compute_device()))
    dist.all_reduce(bad)
    return not bad.item()


def _model_parameters(chunks) -> int:
    """Parameters of the whole model: this rank's share summed over TP and PP ranks."""
    total = torch.tensor([count_parameters(chunks)], dtype=torch.int64,
                         device=device.compute_device())
    dist.all_reduce(total, group=parallel_state.get_model_parallel_group())
    return int(total.item())


def _stopped_in_start_up(stop: StopRequest, at: int) -> dict:
    log.info("stopped by %s during start-up, before step %d; nothing to save",
             stop.signal_name, at + 1)
    return {"stopped_at": at}


def train(config: Config, stop: StopRequest | None = None,
          config_path: str | None = None) -> dict:
    """Train (resuming from the newest complete checkpoint in the run folder, if any).
    Returns the final validation metrics. ``stop`` is the signal catcher (installed by the
    CLI before its imports), ``config_path`` the file the config was read from.

    Nothing is written to run.dir until every check passed: the config, the data, what the
    checkpoint to resume or load is (all before a process group or model exists) and the
    lock (one run per folder)."""
    stop = stop or StopRequest.install()
    check_wandb(config)
    tokenizer = preflight(config)
    begin = check_start(config, config_path)
    chunks = setup(config)
    console.quiet_other_ranks(is_logging_rank())
    if parallel.any_rank(stop.requested):  # start-up stops only together
        return _stopped_in_start_up(stop, 0)
    lock = RunLock(Path(config.run.dir))
    lock.acquire()
    try:
        if checkpoint.resolve(Path(config.run.dir) / "checkpoints") != begin.previous:
            begin = check_start(config, config_path)  # another run saved before we locked
        return _train_locked(config, tokenizer, chunks, begin, stop)
    finally:
        lock.release()


def _train_locked(config: Config, tokenizer, chunks, begin: StartPoint, stop: StopRequest) -> dict:
    r, d = config.run, config.data
    run_dir, ckpt_root = Path(r.dir), Path(r.dir) / "checkpoints"
    optimizer, scheduler = build_optimizer(config, chunks, params_dtype(config))
    parameters = _model_parameters(chunks)
    if begin.previous is not None:
        checkpoint.load(begin.previous, begin.record, chunks, optimizer, scheduler)
    elif begin.weights is not None:
        if hf_llama.is_hf_folder(str(begin.weights)):
            hf_llama.load(chunks, str(begin.weights), config.model)
        else:
            weights.load(chunks, begin.weights)
        # bf16: the optimizer's fp32 main weights were copied at its creation; refresh them
        optimizer.reload_model_params()
    start = begin.position.step
    if parallel.any_rank(stop.requested):
        return _stopped_in_start_up(stop, start)
    prepare_run_dir(run_dir, config, parameters, resuming=begin.previous is not None)
    identity_record = {**begin.identity, "config_sha256": sha256(run_dir / "config.toml")}
    announce(config, parameters, start, begin.previous)
    train_set, valid_set = build_datasets(config, tokenizer, begin.position)
    if parallel.any_rank(stop.requested):
        return _stopped_in_start_up(stop, start)
    metrics = MetricsLogger(config, run_dir, run_metadata(parameters))
    progress = Progress(start, r.steps, enabled=is_logging_rank())
    throughput = Throughput(config)
    diag = diagnostics.build(config, chunks)  # None when off: no hooks at all
    micro = microbatches_per_step(d.global_batch_size, d.micro_batch_size)

    def at(step: int) -> DataPosition:
        return begin.position.advance(step, d.global_batch_size, config.seq_length)

    def validation(step: int) -> dict:
        result = evaluate(config, chunks, valid_set)
        metrics.log({"step": step, **result})
        progress.message(f"validation at step {step}: loss {result['val_loss']:.4f}, "
                         f"perplexity {result['val_ppl']:.1f}")
        return result

    def save(step: int) -> None:
        if not weights_finite(chunks):
            raise TrainingAborted(f"the weights after step {step} are not finite (NaN/Inf); "
                                  f"no checkpoint written; "
                                  f"{checkpoint.latest_text(ckpt_root)}")
        record = {**identity_record, "position": at(step)._asdict()}
        checkpoint.save(ckpt_root, step, chunks, optimizer, scheduler, r.keep_last, record)

    if start == 0 and d.valid_samples:
        validation(0)
    progress.begin()  # after the first validation: the ETA counts training steps only
    bad_in_a_row = skipped = 0
    step = start
    while step < r.steps:
        began = time.perf_counter()
        optimizer.zero_grad()
        with diag.step(step + 1) if diag else contextlib.nullcontext():
            losses = forward_backward(chunks, step_microbatches(
                train_set, at(step).samples, d.global_batch_size, d.micro_batch_size),
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
            record = {"step": step, "consumed_tokens": at(step).tokens, "loss": loss,
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
                f"(run.max_nonfinite_steps = {r.max_nonfinite_steps}); "
                f"{checkpoint.latest_text(ckpt_root)}")
        if d.valid_samples and step % r.eval_interval == 0 and step < r.steps:
            validation(step)
        stopping = status.stop
        if stopping or (r.save_interval and step % r.save_interval == 0) or step == r.steps:
            try:
                save(step)
            except (CheckpointError, TrainingAborted):
                progress.close()
                metrics.finish()
                raise
        if stopping:
            progress.message(f"stopped by signal after step {step}; checkpoint saved")
            progress.close()
            metrics.finish()
            return {"stopped_at": step}
    progress.close()
    final = validation(step) if d.valid_samples else {}
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
