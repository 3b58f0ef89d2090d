"""How far into its data a run is, recorded in every checkpoint and read by the batches."""

from __future__ import annotations

from typing import NamedTuple


class DataPosition(NamedTuple):
    """How far into its data a run is: at optimizer step ``step``, ``samples`` sequences and
    ``tokens`` tokens were consumed. A run with an unchanged batch has samples = step x batch;
    after an allowed batch change the offsets carry the earlier part of the run."""

    step: int = 0
    samples: int = 0
    tokens: int = 0

    def advance(self, step: int, global_batch: int, seq_length: int) -> DataPosition:
        """The position at ``step`` (>= self.step) with this batch and sequence length."""
        done = step - self.step
        return DataPosition(step, self.samples + done * global_batch,
                            self.tokens + done * global_batch * seq_length)


START = DataPosition()
"""A fresh run's position."""
