"""Each transformer block's forward through ``torch.compile`` (``kernels.compile``).

As torchtitan and OLMo-core do, the unit compiled is one block, not the model: the pipeline
schedules, megatron's recompute wrappers, the embedding, the loss and the hooks stay eager
around it. What is compiled is the block's bound ``forward`` (not ``Module.compile``, whose
compiled ``__call__`` would take forward hooks, such as the per-stream diagnostics', into the
graph). Dynamo caches on the code object, so every block of one class shares its compiled
code: a scheme whose blocks are one class compiles once, Mix-LN and HybridNorm* twice; a
block whose guarded constants differ adds an entry: global block 0, which reads the
embedding (``SchemeLayer.reads_embedding``). What differs from block to block enters as an
input, not a constant: SiameseNorm's c_l is a tensor inside a compiled block
(``TwoStreamLayer.c_operand``), so its blocks past the first share one graph
(``docs/compile.md``).

Graph breaks inside a block are counted, not refused (``fullgraph=False``): a layout or
backend the tests have not covered then runs, slower, instead of stopping, and the first step
reports the count (:func:`report`). The tests hold every scheme to zero breaks and to no
recompile after the first step.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from pathlib import Path

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel.layers import linear_with_grad_accumulation_and_async_allreduce
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.transformer_layer import TransformerLayer

from model.layers.base import SchemeLayer
from runtime import cpu_compat, device, flock
from runtime.errors import ConfigError

log = logging.getLogger("pretrain")

# Entries a code object may hold before Dynamo falls back to eager: every block class of a
# model shares one per distinct set of guarded constants (two: global block 0 and the rest);
# Dynamo's default (8) is ample for that, and this bound keeps a model with many block
# variants compiled.
RECOMPILE_LIMIT = 64


def blocks(chunks) -> list[torch.nn.Module]:
    """The transformer blocks of ``chunks`` (bare GPT modules, before any wrapper)."""
    return [m for chunk in chunks for m in chunk.modules() if isinstance(m, TransformerLayer)]


def use_cache(folder: str | os.PathLike, setting: str = "kernels.compile_cache") -> Path:
    """Inductor's and Triton's on-disk caches (compiled graphs, autograd graphs, kernels) in
    ``folder``, so a restart or resume, on this node or another one sharing the folder,
    loads them instead of compiling again. Set before the first compile: inductor reads the
    variable each time it looks a cache up.

    Inductor locks its cache files with flock and falls back only where flock does not exist
    at all (ENOSYS): on a filesystem that refuses it (Lustre without flock, ENOLCK) the first
    compiled forward would die. There the cache moves to :func:`local_cache`, said in one line;
    where that refuses flock too, the run is refused before it starts (``setting`` names the
    field to change)."""
    path = Path(folder).resolve()
    path.mkdir(parents=True, exist_ok=True)
    if (err := flock.refusal(path)) is not None:
        local = local_cache()
        if flock.refusal(local) is not None:
            raise ConfigError(f"{setting} ('{path}'): the compile cache needs file locks, and "
                              f"flock fails there ({err.strerror}) and in '{local}'; set "
                              f"{setting} to a folder on a filesystem with flock, or "
                              "kernels.compile=false")
        log.info("%s: flock is not supported on %s (%s), which inductor's cache needs; "
                 "compiling with the cache in %s instead", setting, path, err.strerror, local)
        path = local
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    os.environ["TRITON_CACHE_DIR"] = str(path / "triton")
    return path


def local_cache() -> Path:
    """The node-local compile cache for a run folder without flock: in the temporary folder
    (TMPDIR), one per user, shared by that user's runs as inductor's own default is."""
    path = Path(tempfile.gettempdir()) / f"pretrain-compile-cache-{os.getuid()}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def require_cuda_graphs_device() -> None:
    """CUDA graphs (``kernels.cuda_graphs``) need a CUDA device: the one-line refusal, given
    before the process groups start (the RNG tracker they need is CUDA's)."""
    if not device.uses_cuda():
        raise ConfigError("kernels.cuda_graphs (true) needs a CUDA device (none on this "
                          "machine); set it false")


def compile_blocks(chunks, backend: str = "inductor", cuda_graphs: bool = False) -> int:
    """Replace each block's ``forward`` by its compiled form (``backend``: inductor, or
    Dynamo's aot_eager / eager for counting breaks without code generation; ``cuda_graphs``:
    inductor's cudagraph trees around each compiled block, CUDA only). Returns the number of
    blocks. Compilation itself happens at the first call, in the first step."""
    if cuda_graphs:
        require_cuda_graphs_device()
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit,
                                               RECOMPILE_LIMIT)
    if not device.uses_cuda():
        cpu_compat.prepare_compile()
    _warn_once_outside()
    options = {"triton.cudagraphs": True} if cuda_graphs else None
    found = blocks(chunks)
    for layer in eager_experts(found):
        layer.forward = torch.compiler.disable(layer.forward, recursive=True)
    for block in found:
        # A scheme's own layer compiles its equations (compute); its forward's last call,
        # megatron's make_viewless_tensor, makes a tensor with requires_grad (which Dynamo
        # refuses) whenever the output is a view (hyper-connections' joined streams), so it
        # stays eager. megatron's own layer (pre) compiles whole.
        name = "compute" if isinstance(block, SchemeLayer) else "forward"
        # dynamic=False: every step's shapes are the same (sequence length, micro-batch), and
        # packed documents change values (document ids, positions), not shapes. A float or
        # int a block reads is a constant of its graph, so none that differs between blocks
        # is read inside one (c_l is read as a tensor).
        setattr(block, name, torch.compile(getattr(block, name), backend=backend,
                                           dynamic=False, options=options))
    return len(found)


def eager_experts(found: list[torch.nn.Module]) -> list[MoELayer]:
    """The MoE layers inside ``found`` blocks, which run eager inside their compiled block:
    how many tokens each expert receives changes every step, and with it the shapes of the
    dispatch and of every expert's matrix product (host-side split sizes), so a compiled MoE
    layer would compile again at every step. The rest of an MoE block (attention, norms, the
    scheme's equations, the router's input) is compiled around it, with one graph break per
    MoE layer, which :func:`first_step_text` says apart from unexpected ones."""
    return [m for block in found for m in block.modules() if isinstance(m, MoELayer)]


def _warn_once_outside() -> None:
    """megatron's tensor-parallel linear advises CUDA_DEVICE_MAX_CONNECTIONS=1 once per
    process, with ``warnings.warn`` and by setting an attribute on itself: two graph breaks
    inside a compiled block at TP > 1. The advice is given here, eagerly, where it applies
    (a CUDA run with TP > 1), and megatron's flag set so the compiled code never reaches it."""
    if linear_with_grad_accumulation_and_async_allreduce.warned:
        return
    if device.uses_cuda() and parallel_state.get_tensor_model_parallel_world_size() > 1 \
            and os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") != "1":
        log.warning("with tensor parallelism, CUDA_DEVICE_MAX_CONNECTIONS=1 lets megatron "
                    "overlap its collectives with compute (set it before the launch)")
    linear_with_grad_accumulation_and_async_allreduce.warned = True


def compile_seconds() -> float:
    """Seconds this process has spent in Dynamo and its backends (forward and the backward
    graphs compiled at the first backward), from torch's own timing of its compile entry."""
    metrics = torch._dynamo.utils.compilation_time_metrics
    return float(sum(sum(times) for name, times in metrics.items()
                     if name in _COMPILE_ENTRIES))


# The outermost compile entries torch times: Dynamo's frame compile (which includes the
# forward's backend) and the backward's lazy compile; inner phases would count twice.
_COMPILE_ENTRIES = ("_compile.compile_inner", "compile_fx.<locals>.bw_compiler",
                    "compile_fx_backward")


def first_step_text(step_seconds: float) -> str:
    """What the console says after the first step of a compiled run: compile seconds so far
    (the first validation's forward graphs included), inductor's cache hits and misses (hits
    on a restart that reuses kernels.compile_cache), and the graph breaks Dynamo counted."""
    inductor = torch._dynamo.utils.counters["inductor"]
    hits, misses = inductor["fxgraph_cache_hit"], inductor["fxgraph_cache_miss"]
    return (f"compiled blocks: {compile_seconds():.1f} s of compilation so far, first step "
            f"{step_seconds:.1f} s; compiled-graph cache {hits} hits, {misses} misses; "
            + breaks_text(break_reasons()))


def breaks_text(reasons: dict[str, int]) -> str:
    """The graph breaks of :func:`first_step_text`, one count of them all: '0 graph breaks';
    '3 graph breaks (3 x <reason>)'; with experts, those at the MoE layers kept eager
    (:func:`eager_experts`, expected) said apart from any other: '6 graph breaks (all at
    the MoE layers, ...)' or '8 graph breaks (6 at the MoE layers, ...; 2 x <reason>)'."""
    at_experts = sum(n for r, n in reasons.items() if _EAGER_EXPERTS in r)
    other = {r: n for r, n in reasons.items() if _EAGER_EXPERTS not in r}
    parts = []
    if at_experts:
        parts.append(f"{'all' if not other else at_experts} at the MoE layers, which run "
                     "eager inside their compiled blocks since the tokens each expert "
                     "receives change every step")
    parts += [f"{n} x {_reason(r)}" for r, n in other.items()]
    text = f"{at_experts + sum(other.values())} graph breaks"
    return text + (" (" + "; ".join(parts) + ")" if parts else "")


# How Dynamo names the call of an MoE layer kept eager (:func:`eager_experts`).
_EAGER_EXPERTS = "MoELayer.forward"


class Recompiles:
    """Compilations after a compiled run's first step, each said once: a validation pass after
    a resume (gradients off), a new sequence length, a changed guard. Dynamo compiles again
    silently; :meth:`since` turns what it compiled since the last call into one console line
    with where it happened, the graphs, the seconds and Dynamo's own reason for the first of
    them (the first failing guard of its first cache entry: for a block of many entries it
    can name another entry's guard, so ``where`` says what the run was doing). Totals go into
    the metrics (:meth:`totals`)."""

    def __init__(self) -> None:
        self.events = 0
        self.seconds = 0.0
        self.armed = False

    def mark(self) -> None:
        """Count from now: called after the first step, whose compilation (the first
        validation's included) :func:`first_step_text` reports; nothing is said before."""
        self.armed = True
        self._entries = list(torch._dynamo.utils.get_compilation_metrics())
        self._counts = Counts().start()
        self._seconds0 = compile_seconds()

    def since(self, where: str) -> str | None:
        """The line for what compiled since the last call (None: nothing did)."""
        if not self.armed:
            return None
        graphs = self._counts.graphs()
        if not graphs:
            return None
        seconds = compile_seconds() - self._seconds0
        reasons = [entry.recompile_reason for entry in self._new_entries()
                   if entry.recompile_reason]
        self.events += 1
        self.seconds += seconds
        self.mark()
        plural = "" if graphs == 1 else "s"
        text = f"compiled blocks recompiled ({where}): {graphs} graph{plural}, {seconds:.1f} s"
        if reasons:
            text += f"; Dynamo's reason: {_reason(reasons[0])}"
        return text

    def totals(self) -> dict[str, float]:
        """What the metrics carry each logged step: recompilations so far and their seconds."""
        return {"recompiles": self.events, "recompile_s": round(self.seconds, 3)}

    def _new_entries(self) -> list:
        """Dynamo's compilation records since :meth:`mark` (it keeps the latest few: all of
        them when the one seen last has dropped out)."""
        entries = list(torch._dynamo.utils.get_compilation_metrics())
        last = self._entries[-1] if self._entries else None
        for i in range(len(entries) - 1, -1, -1):
            if entries[i] is last:
                return entries[i + 1:]
        return entries


def _reason(text: str) -> str:
    """Dynamo's reason without its compile-id prefix ("0/3: "), on one line."""
    first = text.strip().splitlines()[0] if text.strip() else text
    return first.split(": ", 1)[1].strip() if first[:1].isdigit() and ": " in first \
        else first.strip()


class Counts:
    """Graph breaks and compiled graphs since :meth:`start`, from Dynamo's own counters."""

    def start(self) -> Counts:
        self.breaks0 = _break_total()
        self.graphs0 = _graphs()
        self.began = time.perf_counter()
        return self

    def breaks(self) -> int:
        return _break_total() - self.breaks0

    def graphs(self) -> int:
        return _graphs() - self.graphs0


def break_reasons() -> dict[str, int]:
    """Each graph-break reason Dynamo counted in this process, with its count."""
    return dict(torch._dynamo.utils.counters["graph_break"])


def _break_total() -> int:
    return sum(torch._dynamo.utils.counters["graph_break"].values())


def _graphs() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
