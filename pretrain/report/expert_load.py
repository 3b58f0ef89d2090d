"""How evenly a mixture-of-experts router spreads its tokens: the numbers a run logs from one
step's expert counts, and when a router counts as collapsed.

Kept apart from the counting (``pretrain.train.experts``, which hooks the routers and reduces
the counts across ranks) so that the run's report can draw the collapse level without torch,
and so that the definitions below are one piece of plain arithmetic, tested on their own.

Per MoE block (global index, 0-based) and logged step, over the whole global batch:

- ``received[e]``: the token-expert assignments expert ``e`` was given and kept (after the
  capacity factor drops any; a token routed to k experts is k assignments);
- ``routed``: the assignments the router made before any capacity, tokens x top-k;
- load of expert ``e``: ``received[e] / mean(received)``, so an even router gives every expert
  1.0; ``max load`` and ``min load`` are its largest and smallest value;
- ``dropped``: ``routed - sum(received)``, assignments an expert over its capacity refused
  (0 without a capacity factor).

A router that sends every token to the same k experts has a max load of E/k (E experts), the
most a load can be: no expert can receive more than one assignment per token. A block's router
**has collapsed** when its max load lies above the midpoint of that range,
``(1 + E/k) / 2`` (:func:`collapse_load`), i.e. its busiest expert is chosen by more than
``(k/E + 1) / 2`` of the tokens (more than 62.5% with 8 experts and top-2, about 56% with 64
and top-8), at ``COLLAPSE_STEPS`` logged steps in a row; the training loop then warns once for
that block. A router choosing all its experts (k = E) has nothing to collapse.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

COLLAPSE_STEPS = 3
"""Logged steps in a row above :func:`collapse_load` before a block's collapse is said: one
unlucky batch early in training is not a collapse."""

LOAD_KEY = re.compile(r"^moe_load/block(\d+)$")
"""The per-block max-load keys of metrics.jsonl."""


def load_key(block: int) -> str:
    """The metrics key of global block ``block``'s max load (two digits, as the stream
    diagnostics' keys, so the keys sort by depth in most runs)."""
    return f"moe_load/block{block:02d}"


def collapse_load(num_experts: int, topk: int) -> float:
    """The max load above which a router counts as collapsed: halfway between an even router
    (1) and one sending every token to the same ``topk`` experts (``num_experts / topk``)."""
    return (1.0 + num_experts / topk) / 2.0


@dataclass(frozen=True)
class BlockLoad:
    """One MoE block's counts over one step's global batch."""

    block: int
    received: tuple[int, ...]
    """Assignments each expert was given and kept, by expert index."""
    routed: int
    """Assignments made before any capacity: tokens x top-k."""

    @property
    def mean(self) -> float:
        return sum(self.received) / len(self.received)

    @property
    def max_load(self) -> float:
        return max(self.received) / self.mean if self.mean else float("nan")

    @property
    def min_load(self) -> float:
        return min(self.received) / self.mean if self.mean else float("nan")

    @property
    def dropped(self) -> int:
        return self.routed - sum(self.received)


def load_fields(blocks: Sequence[BlockLoad], capacity: bool) -> dict[str, float]:
    """The metrics.jsonl fields of one step's loads: ``moe_max_load`` (the largest max load
    of any block), ``moe_min_load`` (the smallest min load of any block), with a capacity
    factor ``moe_dropped`` (the fraction of all blocks' routed assignments dropped), and per
    block its max load (:func:`load_key`). Without a capacity factor nothing is dropped, so
    no dropped field is written."""
    if not blocks:
        return {}
    fields = {"moe_max_load": max(b.max_load for b in blocks),
              "moe_min_load": min(b.min_load for b in blocks)}
    if capacity:
        fields["moe_dropped"] = sum(b.dropped for b in blocks) / sum(b.routed for b in blocks)
    fields.update({load_key(b.block): b.max_load for b in blocks})
    return fields


def collapsed_text(step: int, load: BlockLoad, num_experts: int, topk: int) -> str:
    """The warning of a collapsed block's router (said once per block)."""
    tokens = load.routed // topk
    share = max(load.received) / tokens if tokens else float("nan")
    return (f"step {step}: the router of block {load.block} has collapsed: its busiest expert "
            f"received {share:.0%} of the block's tokens (max/mean load {load.max_load:.2f} > "
            f"{collapse_load(num_experts, topk):.2f}, halfway between an even load, 1, and every "
            f"token on the same {topk} of {num_experts} experts, {num_experts / topk:g}) at "
            f"{COLLAPSE_STEPS} logged steps in a row; said once per block")
