"""The training loop: one function, :func:`train`, run on every rank.

Per step: the step's micro-batches go through megatron's schedule, the loss and gradients are
checked for NaN/Inf and, with guard.spikes, for spikes (pretrain.train.guard: a bad step is
skipped and counted; too many in a row stop the run or roll it back to its latest checkpoint),
the optimizer and LR schedule step, and metrics, validation and checkpoints follow their
intervals. SIGTERM/SIGUSR1 and Ctrl-C finish the current step, save, and return normally;
during start-up they stop the run before its first step, with nothing to save
(pretrain.run.stop).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from model import compiled
from model.sizes import ParameterCount, whole_model_count
from pretrain.build import params_dtype, preflight, setup
from pretrain.config import Config, GuardAction
from pretrain.data.batches import (
    build_datasets,
    build_valid_sets,
    microbatches_per_step,
    step_microbatches,
)
from pretrain.data.checks import Data
from pretrain.data.position import DataPosition
from pretrain.data.prefetch import Prefetcher
from pretrain.data.tokenizer import Tokenizer
from pretrain.hf import llama as hf_llama
from pretrain.optim import build_optimizer, step_lrs
from pretrain.report import console
from pretrain.report.metrics import MetricsLogger, is_logging_rank
from pretrain.report.model_summary import expert_layout_text, sizes_text
from pretrain.report.progress import Progress
from pretrain.report.throughput import Throughput
from pretrain.report.units import count, human
from pretrain.report.wandb_settings import check_wandb
from pretrain.run import checkpoint
from pretrain.run.folder import check_writable, prepare_run_dir, run_metadata
from pretrain.run.lock import RunLock
from pretrain.run.saver import Saver
from pretrain.run.stop import StopRequest, signal_text
from pretrain.train import diagnostics, experts, profiling
from pretrain.train.evaluate import evaluate_sets, loss_share, per_set, validates
from pretrain.train.guard import (
    SpikeGuard,
    Verdict,
    grad_norm_limit_into,
    short_window_warning,
)
from pretrain.train.start import StartPoint, check_start, sha256
from pretrain.train.stragglers import Stragglers
from pretrain.train.watchdog import Watchdog
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


def _stopped_in_start_up(stop: StopRequest, at: int) -> dict:
    log.info("stopped by %s during start-up, before step %d; nothing to save",
             signal_text(stop.signal_name), at + 1)
    return {"stopped_at": at}


class Prepared(NamedTuple):
    """What the checks before a start found: the tokenizer, where the run starts, its
    downstream tasks, built (None: it has none), and the data as its checks read it."""

    tokenizer: Tokenizer
    begin: StartPoint
    downstream: object | None
    data: Data


def check_before_start(config: Config, config_path: str | None) -> Prepared:
    """Every check a start makes before a process group or model exists (what ``--dry-run``
    runs too): every folder it will write is writable, W&B (credentials, its server), the
    tokenizer and the data (validation split included), what the run resumes or starts from,
    and its downstream tasks (built: their data read). Writes nothing."""
    check_writable(config)
    check_wandb(config)
    tokenizer, data = preflight(config)
    begin = check_start(config, config_path, data)
    tasks = None
    if config.eval.downstream_tasks:  # lm-eval is imported only by runs that use it
        from pretrain.train import downstream

        tasks = downstream.prepare(config)
    return Prepared(tokenizer, begin, tasks, data)


def train(config: Config, stop: StopRequest | None = None,
          config_path: str | None = None) -> dict:
    """Train (resuming from the newest complete checkpoint in the run folder, if any).
    Returns the final validation metrics. ``stop`` is the signal catcher (installed by the
    CLI before its imports), ``config_path`` the file the config was read from.

    Nothing is written to run.dir until every check passed: the config, the data, what the
    checkpoint to resume or load is (all before a process group or model exists) and the
    lock (one run per folder)."""
    stop = stop or StopRequest.install()
    tokenizer, begin, tasks, data = check_before_start(config, config_path)
    chunks = setup(config)
    console.quiet_other_ranks(is_logging_rank())
    if parallel.any_rank(stop.requested):  # start-up stops only together
        return _stopped_in_start_up(stop, 0)
    lock = RunLock(Path(config.run.dir))
    lock.acquire()
    try:
        if checkpoint.resolve(Path(config.run.dir) / "checkpoints") != begin.previous:
            begin = check_start(config, config_path, data)  # another run saved before we locked
        run = Training(config, chunks, begin, stop)
        if parallel.any_rank(stop.requested):
            return _stopped_in_start_up(stop, begin.position.step)
        return run.start(tokenizer, tasks)
    finally:
        lock.release()


class Training:
    """One training run on this rank, read in the order it happens: :meth:`__init__` builds the
    optimizer and restores the start point, :meth:`start` writes the run folder and opens the
    data and the reporters, :meth:`loop` takes the steps (step, validate, save, stop), and
    every way out of it passes through one teardown."""

    def __init__(self, config: Config, chunks: list, begin: StartPoint, stop: StopRequest):
        self.config, self.chunks, self.begin, self.stop = config, chunks, begin, stop
        self.run_dir = Path(config.run.dir)
        self.ckpt_root = self.run_dir / "checkpoints"
        self.saver = Saver(self.ckpt_root, config.run.keep_last, config.run.async_save)
        self.recompiles: compiled.Recompiles | None = None  # set by loop() in compiled runs
        self.optimizer, self.scheduler = build_optimizer(config, chunks, params_dtype(config))
        self.sizes = whole_model_count(chunks)  # collective
        self.parameters = self.sizes.total
        self._resume()
        self.guard = SpikeGuard(config.guard, begin.record.get("guard"))

    def _resume(self) -> None:
        """The checkpoint this run resumes, or the weights a fresh run starts from."""
        begin = self.begin
        if begin.previous is not None:
            checkpoint.load(begin.previous, begin.record, self.chunks, self.optimizer,
                            self.scheduler)
        elif begin.weights is not None:
            if hf_llama.is_hf_folder(str(begin.weights)):
                hf_llama.load(self.chunks, str(begin.weights), self.config.model)
            else:
                weights.load(self.chunks, begin.weights)
            # bf16: the optimizer's fp32 main weights were copied at its creation; refresh them
            self.optimizer.reload_model_params()

    def at(self, step: int) -> DataPosition:
        d = self.config.data
        return self.begin.position.advance(step, d.global_batch_size, self.config.seq_length)

    def start(self, tokenizer, downstream=None) -> dict:
        """Write the run folder, open the data and the reporters, then run :meth:`loop`."""
        config, begin, start = self.config, self.begin, self.begin.position.step
        if dist.get_rank() == 0:  # the lock is held: no other run is writing one
            for unfinished in checkpoint.remove_unfinished(self.ckpt_root):
                log.info("removed %s, left by a save that did not complete", unfinished)
        prepare_run_dir(self.run_dir, config, self.parameters,
                        resuming=begin.previous is not None)
        self.identity = {**begin.identity, "config_sha256": sha256(self.run_dir / "config.toml")}
        announce(config, self.sizes, start, begin.previous)
        if (short := short_window_warning(config.guard)) and is_logging_rank():
            log.warning(short)
        self.tokenizer, self.downstream = tokenizer, downstream
        self.train_set, self.valid_set = build_datasets(config, tokenizer, begin.position)
        self.valid_sets = build_valid_sets(config, tokenizer)  # data.valid_sets
        if parallel.any_rank(self.stop.requested):
            return _stopped_in_start_up(self.stop, start)
        self.metrics = MetricsLogger(config, self.run_dir, run_metadata(self.parameters))
        for key, (old, new) in begin.changes.items():
            log.info("resumed with %s = %s (was %s until step %d)", key, json.dumps(new),
                     json.dumps(old), start)
        self.metrics.log_changes(start, begin.changes)
        self.progress = Progress(start, config.run.steps, enabled=is_logging_rank())
        self.watchdog = Watchdog(config.run.hang_timeout, self.run_dir / "hangs",
                                 dist.get_rank())
        self.profiler = profiling.build(config.profiling, self.run_dir, dist.get_rank(), start,
                                        self.progress.message)
        d = config.data
        self.prefetch = Prefetcher(lambda first: list(step_microbatches(
            self.train_set, first, d.global_batch_size, d.micro_batch_size)))
        finished = False
        try:
            result = self.loop(start)
            with self.watchdog.long("the background write of the last checkpoint"):
                self.saver.wait()  # complete before the run ends
            finished = True
            return result
        except (TrainingAborted, CheckpointError):
            finished = True  # an end the run reports (W&B closes it), not a crash
            raise
        finally:  # the one teardown
            self.watchdog.stop()  # first: after a hang it waits for the watchdog's exit
            self.prefetch.close()
            self.profiler.close()
            self.saver.close()  # after an exception: a write still in flight is waited for
            self.progress.close()
            if finished:
                self.metrics.finish()

    def loop(self, step: int) -> dict:
        """Steps from ``step`` to run.steps; validation and checkpoints on their intervals;
        a stop request ends it after a save."""
        r = self.config.run
        throughput = Throughput(self.config)
        diag = diagnostics.build(self.config, self.chunks)  # None when off: no hooks at all
        stragglers = Stragglers(self.chunks, r.straggler_ratio, is_logging_rank())
        routers = experts.build(self.config, self.chunks, self.run_dir, is_logging_rank())
        # compiled runs: what compiles after the first step is said once, where it happened
        self.recompiles = compiled.Recompiles() if self.config.kernels.compile else None
        if step == 0 and validates(self.config):
            self.validate(0)
        self.progress.begin()  # after the first validation: the ETA counts training steps only
        while step < r.steps:
            began = time.perf_counter()
            stragglers.step_begins()
            if routers:
                routers.step_begins()
            with self.profiler.step(step + 1):  # a trace, and a snapshot on out-of-memory
                status, verdict, lrs, grad_norm = self.step(step, diag)
            step += 1
            self.watchdog.step_done(step)
            if self.recompiles and step > self.begin.position.step + 1:
                self.say_recompiles(f"step {step}")
            self.saver.poll()  # completes a background save whose write has ended
            if verdict is not Verdict.UPDATE:
                log.warning("step %d: %s, update skipped", step, self.skip_text(verdict, status,
                                                                            grad_norm))
            record = None
            if step % r.log_interval == 0 or step == r.steps:
                record = {"step": step, "consumed_tokens": self.at(step).tokens,
                          "loss": status.loss, **lrs,
                          "grad_norm": float(grad_norm) if grad_norm is not None else None,
                          "skipped_steps": self.guard.skipped,
                          "skipped_spikes": self.guard.spikes,
                          **throughput.measure(time.perf_counter() - began)}
                if self.recompiles:
                    record.update(self.recompiles.totals())
                record.update(stragglers.measure(step))  # collective
                if routers:
                    record.update(routers.measure(step))  # collective
                self.metrics.log(record, routers.expert_loads if routers else None)
            self.progress.step(step, record)
            if self.recompiles and step == self.begin.position.step + 1:
                self.progress.message(compiled.first_step_text(time.perf_counter() - began))
                self.recompiles.mark()
            for extra in diag.records(step, status.loss) if diag else ():  # collective
                self.metrics.log(extra)
            if self.guard.exhausted():
                step = self.roll_back(step)
                continue
            if validates(self.config) and step % r.eval_interval == 0 and step < r.steps:
                self.validate(step)
            if self.downstream and not status.stop and self.downstream.due(step, step == r.steps):
                self.score_downstream(step)
            if status.stop or (r.save_interval and step % r.save_interval == 0) \
                    or step == r.steps:
                with self.watchdog.long(f"the checkpoint of step {step}"):
                    self.save(step)
            if status.stop:
                self.progress.message(self.stop.stopped_text(step))
                return {"stopped_at": step}
        self.progress.close()
        if validates(self.config):
            return self.validate(step)
        # the result says where the run ended, and the line why it has no validation loss
        self.progress.message(f"finished at step {step} without validation: "
                              "data.valid_samples is 0 and data.valid_sets is empty")
        return {"step": step}

    def step(self, step: int, diag) -> tuple[StepStatus, Verdict, float, float]:
        """One optimizer step from ``step`` (0-based): forward and backward over its
        micro-batches, then the update unless the guard skips it (a NaN/Inf, or a spike of the
        loss before the optimizer or of the gradient norm inside it). Returns the step's
        status, the guard's verdict, the learning rate it applied (or would have) and the
        gradient norm (NaN: not computed)."""
        config, d = self.config, self.config.data
        self.optimizer.zero_grad()
        batches = self.prefetch.take(self.at(step).samples)
        if step + 1 < config.run.steps:  # the next step's batches are read while this one runs
            self.prefetch.ahead(self.at(step + 1).samples)
        with diag.step(step + 1) if diag else contextlib.nullcontext():
            losses = forward_backward(self.chunks, iter(batches),
                                      microbatches_per_step(d.global_batch_size,
                                                            d.micro_batch_size),
                                      config.seq_length, d.micro_batch_size)
        status = step_status(losses, self.chunks, self.stop)
        lrs = step_lrs(self.optimizer)  # the rates this step applies
        verdict = self.guard.judge_loss(status.loss, status.finite)
        grad_norm = float("nan")
        if verdict is Verdict.UPDATE:
            limit = self.guard.grad_norm_limit()
            grad_norm_limit_into(self.optimizer, limit)  # megatron skips the update above it
            _, grad_norm, _ = self.optimizer.step()
            if grad_norm is not None and grad_norm > limit:
                verdict = Verdict.GRAD_SPIKE
            else:
                self.scheduler.step(increment=1)
        self.guard.record(verdict, status.loss, grad_norm)
        return status, verdict, lrs, grad_norm

    def skip_text(self, verdict: Verdict, status: StepStatus, grad_norm: float) -> str:
        if verdict is Verdict.LOSS_SPIKE:
            return f"{verdict.value} (loss {status.loss:.4f} > {self.guard.loss_limit():.4f})"
        if verdict is Verdict.GRAD_SPIKE:
            return (f"{verdict.value} (gradient norm {grad_norm:.4f} > "
                    f"{self.guard.grad_norm_limit():.4f})")
        return verdict.value

    def roll_back(self, step: int) -> int:
        """After guard.max_skipped skipped steps in a row: stop the run, or (guard.action =
        rollback) reload the latest checkpoint, move the data position past the next
        guard.rollback_skip_batches batches and return the checkpoint's step to go on from."""
        g, d = self.config.guard, self.config.data
        streak = f"{self.guard.streak_text()} (guard.max_skipped = {g.max_skipped})"
        with self.watchdog.long(f"the checkpoint in flight after step {step}"):
            self.saver.wait()  # a save in flight is the checkpoint to return to
        target = checkpoint.resolve(self.ckpt_root)
        if g.action is GuardAction.STOP:
            raise TrainingAborted(f"{streak}; {checkpoint.latest_text(self.ckpt_root)}")
        if target is None:
            raise TrainingAborted(f"{streak}; guard.action is rollback but no checkpoint was "
                                  "written yet (set run.save_interval)")
        if len(self.guard.rollbacks) >= g.max_rollbacks:
            raise TrainingAborted(f"{streak}, after {len(self.guard.rollbacks)} rollbacks "
                                  f"(guard.max_rollbacks = {g.max_rollbacks}); "
                                  f"{checkpoint.latest_text(self.ckpt_root)}")
        with self.watchdog.long(f"the rollback to {target.name}"):
            record = checkpoint.read_record(target)
            checkpoint.load(target, record, self.chunks, self.optimizer, self.scheduler)
            saved = checkpoint.position(record, d.global_batch_size, self.config.seq_length)
            skip = g.rollback_skip_batches * d.global_batch_size
            position = DataPosition(saved.step, saved.samples + skip,
                                    saved.tokens + skip * self.config.seq_length)
            self.train_set, _ = build_datasets(self.config, self.tokenizer, position)
        self.guard.roll_back(record.get("guard"), step, saved.step, saved.samples,
                             position.samples)
        self.begin = self.begin._replace(position=position)
        self.metrics.log({"step": step, "rollback_to_step": saved.step,
                          "rollback_first_skipped_sample": saved.samples,
                          "rollback_skipped_samples": skip,
                          "rollbacks": len(self.guard.rollbacks)})
        self.progress.message(
            f"{streak}: rolled back to {target.name} and skipping its next "
            f"{g.rollback_skip_batches} batches (samples {saved.samples}-{position.samples - 1})"
            f"; rollback {len(self.guard.rollbacks)} of at most {g.max_rollbacks}")
        return saved.step

    def validate(self, step: int) -> dict:
        with self.watchdog.long(f"validation at step {step}"):
            result = evaluate_sets(self.config, self.chunks, self.valid_set, self.valid_sets)
        self.say_recompiles(f"validation at step {step}")
        self.metrics.log({"step": step, **result})
        for name, loss, ppl in per_set(result):
            self.progress.message(f"validation{' ' + name if name else ''} at step {step}: "
                                  f"loss {loss:.4f}, perplexity {ppl:.1f}")
        return result

    def score_downstream(self, step: int) -> None:
        """The downstream tasks on the live model (pretrain.train.downstream); every rank."""
        began = time.perf_counter()
        with self.watchdog.long(f"downstream evaluation at step {step}"):
            result = self.downstream.score(self.chunks, self.tokenizer)
        seconds = time.perf_counter() - began
        self.say_recompiles(f"downstream tasks at step {step}")
        self.metrics.log({"step": step, **result, "downstream_seconds": seconds})
        shown = ", ".join(f"{key.removeprefix('downstream/')} {value:.4f}"
                          for key, value in result.items())
        self.progress.message(f"downstream at step {step}: {shown} ({seconds:.1f} s)")

    def say_recompiles(self, where: str) -> None:
        """One console line for blocks compiled again since the last look (compiled runs,
        after the first step: :class:`model.compiled.Recompiles`)."""
        if self.recompiles is not None and (line := self.recompiles.since(where)):
            self.progress.message(line)

    def save(self, step: int) -> None:
        """A checkpoint after ``step``, refused (the run aborts) when a weight is not finite."""
        if not weights_finite(self.chunks):
            raise TrainingAborted(f"the weights after step {step} are not finite (NaN/Inf); "
                                  f"no checkpoint written; {self.saver.latest_text()}")
        record = {**self.identity, "position": self.at(step)._asdict(),
                  "guard": self.guard.state(), "settings": self.config.to_dict()}
        self.saver.save(step, self.chunks, self.optimizer, self.scheduler, record)


def announce(config: Config, sizes: ParameterCount, start: int, previous: Path | None) -> None:
    """The first screen: what is trained (an MoE model's experts and active parameters too),
    where (the expert layout too), on what, and from which point."""
    m, p, d, r = config.model, config.parallel, config.data, config.run
    dp = parallel_state.get_data_parallel_world_size()
    where = device.compute_device()
    hardware = f"{where} ({device.device_name()})" if device.uses_cuda() else "cpu"
    tokens = d.global_batch_size * config.seq_length
    log.info("training %s: %s, %s on %s", m.residual_scheme, sizes_text(m, sizes),
             str(params_dtype(config)).removeprefix("torch."), hardware)
    micro = microbatches_per_step(d.global_batch_size, d.micro_batch_size)
    world = dist.get_world_size()
    context = f" x cp {p.cp}" if p.cp > 1 else ""
    log.info("layout: world %d = tp %d%s x pp %d x dp %d%s; %s of %s per step and "
             "data-parallel rank", world, p.tp, context, p.pp, dp,
             expert_layout_text(m, p, world),
             count(micro, "micro-batch"), count(d.micro_batch_size, "sequence"))
    log.info("data: %s; %s tokens per step x %s steps = %s tokens",
             ", ".join(d.prefixes), f"{tokens:,}", f"{r.steps:,}", human(tokens * r.steps))
    if previous is not None:
        point = f"resuming from {previous} (step {start} of {r.steps})"
    elif r.init_from:
        point = f"starting at step 0 from the weights of {r.init_from}"
    else:
        point = "starting at step 0"
    log.info("run folder: %s; %s", r.dir, point)
