"""Training progress on the console: one live line on a terminal, plain lines in a log file.

On a terminal (stderr is a TTY) a tqdm bar shows step, percentage, elapsed time and ETA, with
loss, LR, gradient norm, tokens/s (and MFU on a GPU; with experts the routers' balancing loss
and the busiest expert's load, ``aux`` and ``load``) as its postfix; validation results and
other messages print above it. Anywhere else (slurm output, CI, a redirected log) every
``run.log_interval`` steps prints one plain line with the same fields, so a log file reads
top to bottom. The ETA is the remaining steps at the mean time per step of this process so
far, leaving out its first step (a resumed run does not count the steps it did not train):
that step carries one-off work, above all compiled blocks' compilation (about 14 s of the
CPU demo's first step, whose ETA would otherwise have said an hour for a three-minute run),
so the first step's line gives no ETA.
"""

from __future__ import annotations

import logging
import sys
import time

from tqdm import tqdm

log = logging.getLogger("pretrain")


def clock(seconds: float) -> str:
    """1m05s, 2h03m, 45s."""
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def fields(record: dict) -> str:
    """The step's numbers, as the live line's postfix and the plain line's tail."""
    parts = [f"loss {record['loss']:.4f}", f"lr {record['lr']:.2e}"]
    if record.get("muon_lr") not in (None, record["lr"]):  # optim.muon_lr set
        parts.append(f"muon_lr {record['muon_lr']:.2e}")
    if record.get("grad_norm") is not None:
        parts.append(f"grad_norm {record['grad_norm']:.3f}")
    parts.append(f"{record['tokens_per_s']:,.0f} tok/s")
    if record.get("mfu") is not None:
        parts.append(f"MFU {100 * record['mfu']:.1f}%")
    if record.get("moe_aux_loss") is not None:  # mixture of experts (pretrain.train.experts)
        parts.append(f"aux {record['moe_aux_loss']:.4f}")
    if record.get("moe_max_load") is not None:
        parts.append(f"load {record['moe_max_load']:.2f}")
    return " ".join(parts)


class Progress:
    """Every rank makes one; only the logging rank's (``enabled``) prints anything.

    ``begin()`` starts the clock (and the live line) once training steps begin; messages
    before it are plain log lines."""

    def __init__(self, start: int, total: int, enabled: bool = True, stream=None):
        self.stream = stream or sys.stderr
        self.start, self.total, self.enabled = start, total, enabled
        self.began = time.perf_counter()
        self.first_done: float | None = None  # when this process's first step ended
        self.bar = None

    def begin(self) -> None:
        self.began = time.perf_counter()
        self.first_done = None
        if self.enabled and self.stream.isatty():
            self.bar = tqdm(total=self.total, initial=self.start, file=self.stream,
                            unit="step", dynamic_ncols=True,
                            bar_format="{l_bar}{bar}| {n}/{total} [{elapsed}<{remaining}]"
                                       "{postfix}")

    def timing(self, step: int) -> tuple[float, float | None]:
        """(elapsed seconds, estimated seconds left) after ``step``: the steps after this
        process's first at their mean time so far (None after the first step alone)."""
        now = time.perf_counter()
        after_first = step - self.start - 1
        if self.first_done is None or after_first < 1:
            return now - self.began, None
        return now - self.began, (now - self.first_done) / after_first * (self.total - step)

    def step(self, step: int, record: dict | None) -> None:
        """After each step; ``record`` is the logged metrics of a logged step, else None."""
        if self.first_done is None:
            self.first_done = time.perf_counter()
        if self.bar is not None:
            if record is not None:
                self.bar.set_postfix_str(fields(record), refresh=False)
            self.bar.update(step - self.bar.n)
            return
        if record is None or not self.enabled:
            return
        elapsed, left = self.timing(step)
        log.info("step %d/%d (%.0f%%) %s | elapsed %s, ETA %s", step, self.total,
                 100 * step / self.total, fields(record), clock(elapsed),
                 "-" if left is None else clock(left))

    def message(self, text: str) -> None:
        """A line that stays (validation results, the stop notice)."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(f"[pretrain] {text}", file=self.stream)
        else:
            log.info("%s", text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
