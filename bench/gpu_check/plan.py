"""The check's parts in priority order, each with its own time budget, and the loop that runs
them within the whole run's budget, writing every part's JSON the moment it is known.

The check is one command; its budget is 8 minutes by default (``--budget``), so that with
installing the bundle it ends within 10. A part that the remaining time cannot fit (less left
than it ``needs``) is recorded as skipped, with the reason, rather than started and cut; a
part that fails is recorded with its error and the next one runs.
"""

from __future__ import annotations

import json
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from bench.gpu_check.report import markdown

RESULT = "gpu-check"  # the whole run's files: gpu-check.json and gpu-check.md


@dataclass(frozen=True)
class Sizes:
    """Every shape the parts use: the GPU run's, or the rehearsal's tiny ones."""

    dtype: str  # "bf16" on the GPU; "fp32" in the rehearsal (the interpreter has no bf16)
    copy_bytes: int
    gemm: int  # n of the n x n x n matrix product
    norm_tokens: int
    norm_hidden: int
    norm_rounds: int
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    seq: int
    vocab: int
    micro_batch: int
    steps: int
    warmup: int
    rounds: int
    full_layers: int  # the optimizer step's model: the 1.3B shape's depth
    alternative_tokens: int  # rows of the kernel alternatives at hidden 4096 and 8192
    experts: int  # the MoE part's routed experts per block, top-k and expert width
    topk: int
    expert_ffn: int


# The 1.3B shape's width (hidden 2048, 32 heads / 8 KV, SwiGLU 8192, seq 4096, vocab 50304)
# at 4 layers: the step ratios are the point, and 4 layers leave time for three rounds.
GPU = Sizes(dtype="bf16", copy_bytes=1 << 30, gemm=8192, norm_tokens=8192, norm_hidden=2048,
            norm_rounds=3, layers=4, hidden=2048, heads=32, kv_heads=8, ffn=8192, seq=4096,
            vocab=50304, micro_batch=2, steps=5, warmup=2, rounds=3, full_layers=16,
            alternative_tokens=8192, experts=16, topk=2, expert_ffn=2048)
REHEARSAL = Sizes(dtype="fp32", copy_bytes=8 << 20, gemm=256, norm_tokens=16, norm_hidden=64,
                  norm_rounds=1, layers=1, hidden=64, heads=4, kv_heads=2, ffn=128, seq=32,
                  vocab=256, micro_batch=1, steps=2, warmup=1, rounds=1, full_layers=2,
                  alternative_tokens=2, experts=4, topk=2, expert_ffn=64)


@dataclass
class Context:
    """What a part gets: where to write, the sizes, its deadline, the parts done so far and a
    ``save`` that records a part's partial result at once."""

    out: Path
    sizes: Sizes
    rehearsal: bool
    bundle: Path
    results: dict = field(default_factory=dict)
    deadline: float = 0.0
    save: Callable[[dict], None] = lambda data: None

    def left(self) -> float:
        """Seconds left to the running part."""
        return self.deadline - time.monotonic()


@dataclass(frozen=True)
class Part:
    name: str
    title: str
    budget_s: float  # the most it may take
    needs_s: float  # the least time left for it to start
    run: Callable[[Context], dict]


def run_parts(parts: list[Part], context: Context, budget_s: float) -> dict:
    """Run ``parts`` in order within ``budget_s`` seconds; the merged result."""
    start = time.monotonic()
    context.out.mkdir(parents=True, exist_ok=True)
    result = {"date": datetime.now(UTC).date().isoformat(), "source": "gpu-check",
              "rehearsal": context.rehearsal, "budget_s": budget_s, "parts": {}}
    context.results = result
    for index, part in enumerate(parts):
        left = budget_s - (time.monotonic() - start)
        status = {"title": part.title, "budget_s": part.budget_s}
        if left < part.needs_s:
            status.update(status="skipped", reason=f"{left:.0f} s of the run's {budget_s:.0f} s "
                          f"left, the part needs {part.needs_s:.0f} s")
            result["parts"][part.name] = status
            _write(context.out, index, part.name, None, result)
            continue
        began = time.monotonic()
        context.deadline = began + min(part.budget_s, left)
        context.save = _saver(context.out, result, index, part.name, status, began)
        try:
            data = part.run(context)
            status["status"] = "done"
        except Exception as err:  # the next part still runs; the error is the finding
            data = result.get(part.name)
            status.update(status="failed", error=f"{type(err).__name__}: {err}",
                          traceback=traceback.format_exc().splitlines()[-12:])
        status["seconds"] = round(time.monotonic() - began, 1)
        result["parts"][part.name] = status
        if data is not None:
            result[part.name] = data
        _write(context.out, index, part.name, data, result)
    result["seconds"] = round(time.monotonic() - start, 1)
    _write(context.out, len(parts), "end", None, result)
    return result


def _saver(out: Path, result: dict, index: int, name: str, status: dict,
           began: float) -> Callable[[dict], None]:
    """A running part's ``save``: its partial data, written at once with the merged result."""
    def save(data: dict) -> None:
        result[name] = data
        result["parts"][name] = {**status, "status": "running",
                                 "seconds": round(time.monotonic() - began, 1)}
        _write(out, index, name, data, result)

    return save


def _write(out: Path, index: int, name: str, data: dict | None, result: dict) -> None:
    """The part's own file (when it has data), then the merged JSON and its markdown."""
    if data is not None:
        (out / f"{index:02d}-{name}.json").write_text(json.dumps(data, indent=1) + "\n")
    (out / f"{RESULT}.json").write_text(json.dumps(result, indent=1) + "\n")
    try:
        page = markdown(result)
    except Exception as err:  # the JSON is the record; a page that fails must not stop the run
        page = f"# GPU check\n\nThe page could not be written ({type(err).__name__}: {err}); " \
               f"see {RESULT}.json.\n"
    (out / f"{RESULT}.md").write_text(page)
