"""How long a checkpoint save holds up training, in the foreground and in the background
(``run.async_save``), for a GPT-2-small-sized SiameseNorm model (12 x 768, ~134M parameters,
fp32, AdamW) on the CPU, with megatron's distributed optimizer (the default) and its plain one.

One process trains random batches and saves through :class:`pretrain.run.saver.Saver`, as
training does; the two modes take turns, round by round, so drift hits both alike. Per save:
the time ``save()`` blocks the training process (megatron's distributed optimizer first
gathers its state into the per-parameter form checkpoints hold, in either mode); the step
right after it, against a step with no save (a background writer competes for the cores, and
each memory page the step updates is copied once while the fork shares it); and the time from
the save's start until the checkpoint is complete (``wait()`` after that one step). Medians
over the rounds, after one save per mode that starts megatron's helper process. Checkpoints go
to a temporary folder on the disk of ``--dir``.

    python -m bench.checkpoint_save [--rounds 3 --layers 12 --hidden 768]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.common import one_process, random_batch, versions_line
from model.builder import build_model, model_parameters, wrap_ddp
from model.config import ModelConfig, ParallelConfig
from pretrain.config import Config, RunConfig
from pretrain.optim import build_optimizer
from pretrain.run.saver import Saver
from runtime.markdown import markdown_table
from runtime.schedule import forward_backward

MODES = {"foreground (default)": False, "background (run.async_save)": True}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--ffn", type=int, default=2048, help="SwiGLU width")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=1, help="sequences per step")
    p.add_argument("--rounds", type=int, default=3, help="timed saves per mode")
    p.add_argument("--dir", default=tempfile.gettempdir(), help="where checkpoints are written")
    return p.parse_args(argv)


class Trainer:
    """A model, megatron's optimizer and one fixed batch: a step is forward, backward and the
    AdamW update, which changes every weight and moment in place."""

    def __init__(self, args: argparse.Namespace, distributed_optimizer: bool):
        self.args = args
        model = ModelConfig(num_layers=args.layers, hidden_size=args.hidden,
                            num_attention_heads=args.heads, ffn_hidden_size=args.ffn,
                            vocab_size=args.vocab, seq_length=args.seq)
        config = Config(model=model, run=RunConfig(steps=1000),
                        parallel=ParallelConfig(distributed_optimizer=distributed_optimizer))
        self.chunks = wrap_ddp(build_model(model, config.parallel, seed=1), config.parallel)
        self.optimizer, self.scheduler = build_optimizer(config, self.chunks, torch.float32)
        self.batch = random_batch(args.vocab, args.batch, args.seq)
        self.parameters = model_parameters(self.chunks)
        self.steps = 0

    def step(self) -> float:
        began = time.perf_counter()
        self.optimizer.zero_grad()
        forward_backward(self.chunks, [self.batch], 1, self.args.seq, self.args.batch)
        self.optimizer.step()
        self.scheduler.step(increment=1)
        self.steps += 1
        return time.perf_counter() - began

    def save(self, saver: Saver) -> tuple[float, float, float]:
        """(seconds save() blocked, the next step's seconds, seconds until complete)."""
        began = time.perf_counter()
        saver.save(self.steps, self.chunks, self.optimizer, self.scheduler, record={})
        blocked = time.perf_counter() - began
        next_step = self.step()
        saver.wait()
        return blocked, next_step, time.perf_counter() - began


def folder_size(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def measure(args: argparse.Namespace, root: Path,
            distributed_optimizer: bool) -> tuple[list[list[str]], int]:
    """The table's rows for one optimizer, and the model's parameter count."""
    trainer = Trainer(args, distributed_optimizer)
    plain = [trainer.step() for _ in range(4)][1:]  # the first step warms the allocator
    savers = {name: Saver(root / name.split()[0], keep_last=1, background=background)
              for name, background in MODES.items()}
    for saver in savers.values():  # the first save also starts megatron's helper process
        trainer.save(saver)
    times = {name: [] for name in MODES}
    for _ in range(args.rounds):
        for name, saver in savers.items():
            times[name].append(trainer.save(saver))
    size = folder_size(next((root / "foreground").glob("step_*"))) / 2**30
    optimizer = "distributed" if distributed_optimizer else "plain"
    rows = []
    for name, samples in times.items():
        blocked, next_step, complete = (statistics.median(column)
                                        for column in zip(*samples, strict=True))
        rows.append([optimizer, name, f"{blocked:.2f}", f"{next_step:.2f}",
                     f"{statistics.median(plain):.2f}", f"{complete:.2f}", f"{size:.2f}"])
    return rows, trainer.parameters


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rows = []
    with one_process():
        for distributed_optimizer in (True, False):
            with tempfile.TemporaryDirectory(dir=args.dir) as scratch:
                found, parameters = measure(args, Path(scratch), distributed_optimizer)
                rows += found
    print(f"device: CPU ({platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads); {versions_line()}")
    print(f"siamese, {args.layers} x {args.hidden}, {args.heads} heads, SwiGLU {args.ffn}, "
          f"vocab {args.vocab}: {parameters / 1e6:.0f}M parameters, fp32, AdamW; a step is "
          f"{args.batch} x {args.seq} tokens; seconds, medians of {args.rounds} saves per row\n")
    print(markdown_table(["optimizer", "save", "blocks training", "the next step",
                          "a step, no save", "until complete", "checkpoint GiB"], rows,
                         right_from=2))


if __name__ == "__main__":
    main()
