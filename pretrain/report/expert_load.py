"""How evenly a mixture-of-experts router spreads its tokens: the numbers a run logs from one
step's expert counts, and when a router is imbalanced, has collapsed or has recovered.

Kept apart from the counting (``pretrain.train.experts``, which hooks the routers and reduces
the counts across ranks) so that the run's report can draw the imbalance level without torch,
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
most a load can be: no expert can receive more than one assignment per token. Two levels
judge a block's router at a logged step:

- **imbalanced**: its max load lies above the midpoint of that range, ``(1 + E/k) / 2``
  (:func:`imbalance_load`), i.e. its busiest expert is chosen by more than
  ``(k/E + 1) / 2`` of the tokens (more than 62.5% with 8 experts and top-2, about 56% with 64
  and top-8);
- **collapsed**: its k busiest experts received at least ``COLLAPSED_SHARE`` (90%) of the
  block's assignments, where an even router gives them k/E: nearly every token on the same k
  experts, the rest starved.

Routers swing through both early in training while they learn, and usually settle. So a
verdict (:class:`RouterVerdicts`) is only said of a level that **persists**: held at every
logged step of a window of ``WINDOW_STEPS`` training steps (at least ``WINDOW_LOGS`` logged
steps) lying wholly after the learning-rate warm-up. A block said to be imbalanced or
collapsed is said to have **recovered** once a whole window lies at or below the imbalance
level. A router choosing all its experts (k = E) has nothing to judge.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum

FILE = "experts.jsonl"
"""The run folder's file of raw counts, a line per logged step (``pretrain.train.experts``
writes it, ``pretrain.report.expert_map`` reads it)."""
WINDOW_STEPS = 50
"""Training steps a level must hold, at every logged step, before a verdict is said."""
WINDOW_LOGS = 3
"""Logged steps a window holds at least: with ``run.log_interval`` above ``WINDOW_STEPS / 3``
the window grows to ``3 x run.log_interval`` steps."""
COLLAPSED_SHARE = 0.9
"""The share of a block's assignments its k busiest experts receive when it has collapsed."""

LOAD_KEY = re.compile(r"^moe_load/block(\d+)$")
"""The per-block max-load keys of metrics.jsonl."""
EXPERT_LOAD = "moe_expert_load"
"""The prefix of the per-expert loads sent to W&B alone (:func:`expert_load_fields`)."""


def load_key(block: int) -> str:
    """The metrics key of global block ``block``'s max load (two digits, as the stream
    diagnostics' keys, so the keys sort by depth in most runs)."""
    return f"moe_load/block{block:02d}"


def imbalance_load(num_experts: int, topk: int) -> float:
    """The max load above which a router is imbalanced: halfway between an even router (1)
    and one sending every token to the same ``topk`` experts (``num_experts / topk``)."""
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

    def top_share(self, topk: int) -> float:
        """The share of the block's kept assignments its ``topk`` busiest experts received."""
        kept = sum(self.received)
        return sum(sorted(self.received)[-topk:]) / kept if kept else float("nan")


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


def expert_load_fields(blocks: Sequence[BlockLoad]) -> dict[str, float]:
    """Every expert's load, ``moe_expert_load/block<NN>/e<MM>``: what W&B gets besides the
    record (a block x expert heat map in numbers: which experts starve). W&B only, since E x
    blocks numbers per logged step (1,536 for 64 experts in 24 blocks) would swamp
    metrics.jsonl, whose experts.jsonl holds the raw counts already. Expert indices are
    zero-padded to the width of the largest, so the keys sort by expert."""
    fields: dict[str, float] = {}
    for b in blocks:
        width = max(2, len(str(len(b.received) - 1)))
        for expert, received in enumerate(b.received):
            fields[f"{EXPERT_LOAD}/block{b.block:02d}/e{expert:0{width}d}"] = \
                received / b.mean if b.mean else float("nan")
    return fields


class Health(StrEnum):
    """A router's state at one logged step, or over a window of them."""

    EVEN = "even"
    IMBALANCED = "imbalanced"
    COLLAPSED = "collapsed"


def health(load: BlockLoad, num_experts: int, topk: int) -> Health:
    """One logged step's level of ``load`` (module docstring)."""
    if load.top_share(topk) >= COLLAPSED_SHARE:
        return Health.COLLAPSED
    return Health.IMBALANCED if load.max_load > imbalance_load(num_experts, topk) else Health.EVEN


def window_steps(log_interval: int) -> int:
    """The training steps a verdict's window spans at this logging interval."""
    return max(WINDOW_STEPS, WINDOW_LOGS * log_interval)


def balancing_advice(aux_loss_coeff: float) -> str:
    """The setting to resume with when a router stays imbalanced: twice the balancing loss's
    weight, or Megatron-LM's usual 1e-2 where the run has none. A resume may change it
    (``pretrain.run.identity``: it weighs a loss, it shapes no tensor)."""
    raised = 2 * aux_loss_coeff if aux_loss_coeff > 0 else 1e-2
    return f"--model.moe_aux_loss_coeff={raised:g}"


@dataclass
class _Block:
    said: Health = Health.EVEN
    since: int = 0
    """The step of the last change said (0: none)."""
    seen: list[tuple[int, Health, float]] = field(default_factory=list)
    """(step, health, max load) of the logged steps in the current window."""


class RouterVerdicts:
    """What the console says of each MoE block's router, from its loads at every logged step:
    a warning when a block turns imbalanced or collapsed and the level persists for a whole
    window after warm-up, a note when it recovers. Plain arithmetic on :class:`BlockLoad`, so
    a run's whole history can be replayed through it (the tests do)::

        verdicts = RouterVerdicts(8, 2, warmup_steps=100, log_interval=10, aux_loss_coeff=1e-2)
        for health, line in verdicts.observe(step, loads):
            log.log(logging.INFO if health is Health.EVEN else logging.WARNING, line)
    """

    def __init__(self, num_experts: int, topk: int, warmup_steps: int, log_interval: int,
                 aux_loss_coeff: float):
        self.num_experts, self.topk = num_experts, topk
        self.warmup_steps = warmup_steps
        self.window = window_steps(log_interval)
        self.advice = balancing_advice(aux_loss_coeff)
        self.blocks: dict[int, _Block] = {}
        self.first: int | None = None
        """The first step this process observed after warm-up: a resumed run judges only
        what it has seen itself."""

    def observe(self, step: int, loads: list[BlockLoad]) -> list[tuple[Health, str]]:
        """The verdicts to say at logged step ``step``, each with its line (none while
        nothing changed)."""
        if self.topk >= self.num_experts or step <= self.warmup_steps:
            return []
        if self.first is None:
            self.first = step
        covered = step - self.first + 1 >= self.window
        lines = []
        for load in loads:
            block = self.blocks.setdefault(load.block, _Block())
            block.seen = [s for s in block.seen if s[0] > step - self.window]
            block.seen.append((step, health(load, self.num_experts, self.topk), load.max_load))
            verdict = self._verdict(block.seen) if covered else None
            if verdict is None or verdict is block.said:
                continue
            lines.append((verdict, self._say(step, load, block, verdict)))
            block.said, block.since = verdict, step
        return lines

    @staticmethod
    def _verdict(seen: list[tuple[int, Health, float]]) -> Health | None:
        """The level every logged step of the window agrees on; None while they differ."""
        levels = {h for _, h, _ in seen}
        if levels == {Health.COLLAPSED}:
            return Health.COLLAPSED
        if Health.EVEN not in levels:
            return Health.IMBALANCED
        return Health.EVEN if levels == {Health.EVEN} else None

    def _say(self, step: int, load: BlockLoad, block: _Block, verdict: Health) -> str:
        first = block.seen[0][0]
        loads = [m for _, _, m in block.seen]
        head = f"step {step}: the router of block {load.block}"
        span = f"at every logged step of steps {first}-{step}"
        level = imbalance_load(self.num_experts, self.topk)
        if verdict is Health.EVEN:
            return (f"{head} has recovered: its busiest expert's max/mean load stayed at or "
                    f"below {level:.2f} ({max(loads):.2f} at most) {span}; it was "
                    f"{block.said} from step {block.since}")
        advice = (f"if it persists, resume with a stronger balancing loss, "
                  f"{self.advice}; a recovery will be said")
        if verdict is Health.COLLAPSED:
            return (f"{head} has collapsed: its {self.topk} busiest of {self.num_experts} "
                    f"experts received at least {COLLAPSED_SHARE:.0%} of its assignments "
                    f"(now {load.top_share(self.topk):.0%}; {self.topk / self.num_experts:.0%} "
                    f"when even) {span}; {advice}")
        return (f"{head} is imbalanced: its busiest expert's max/mean load stayed above "
                f"{level:.2f}, halfway between an even load, 1, and every token on the same "
                f"{self.topk} of {self.num_experts} experts, {self.num_experts / self.topk:g} "
                f"({min(loads):.2f}-{max(loads):.2f}) {span}; {advice}")
