"""Training progress on the console: one live line on a terminal, plain lines in a log file.

On a terminal (stderr is a TTY) a tqdm bar shows step, percentage, elapsed time and ETA, with
loss, LR, gradient norm, tokens/s (and MFU on a GPU) as its postfix; validation results and
other messages print above it. Anywhere else (slurm output, CI, a redirected log) every
``run.log_interval`` steps prints one plain line with the same fields, so a log file reads
top to bottom. The ETA is the remaining steps at the mean time per step of this process so
far (a resumed run does not count the steps it did not train).
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
    if record.get("grad_norm") is not None:
        parts.append(f"grad_norm {record['grad_norm']:.3f}")
    parts.append(f"{record['tokens_per_s']:,.0f} tok/s")
    if record.get("mfu") is not None:
        parts.append(f"MFU {100 * record['mfu']:.1f}%")
    return " ".join(parts)


class Progress:
    """Every rank makes one; only the logging rank's (``enabled``) prints anything.

    ``begin()`` starts the clock (and the live line) once training steps begin; messages
    before it are plain log lines."""

    def __init__(self, start: int, total: int, enabled: bool = True, stream=None):
        self.stream = stream or sys.stderr
        self.start, self.total, self.enabled = start, total, enabled
        self.began = time.perf_counter()
        self.bar = None

    def begin(self) -> None:
        self.began = time.perf_counter()
        if self.enabled and self.stream.isatty():
            self.bar = tqdm(total=self.total, initial=self.start, file=self.stream,
                            unit="step", dynamic_ncols=True,
                            bar_format="{l_bar}{bar}| {n}/{total} [{elapsed}<{remaining}]"
                                       "{postfix}")

    def timing(self, step: int) -> tuple[float, float]:
        """(elapsed seconds, estimated seconds left) after ``step``."""
        elapsed = time.perf_counter() - self.began
        done = max(step - self.start, 1)
        return elapsed, elapsed / done * (self.total - step)

    def step(self, step: int, record: dict | None) -> None:
        """After each step; ``record`` is the logged metrics of a logged step, else None."""
        if self.bar is not None:
            if record is not None:
                self.bar.set_postfix_str(fields(record), refresh=False)
            self.bar.update(step - self.bar.n)
            return
        if record is None or not self.enabled:
            return
        elapsed, left = self.timing(step)
        log.info("step %d/%d (%.0f%%) %s | elapsed %s, ETA %s", step, self.total,
                 100 * step / self.total, fields(record), clock(elapsed), clock(left))

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
