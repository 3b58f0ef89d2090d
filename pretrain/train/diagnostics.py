"""Per-stream training diagnostics: stream RMS, gradients reaching each stream, merge shares,
and loss-spike events.

Why: SiameseNorm's claims are about how its two residual streams behave (x stays normalised,
y grows like Pre-Norm, both keep weight in the final merge) and about stability (no loss or
gradient spikes at high learning rates). These numbers show that while a run trains.

Every ``diagnostics.interval`` steps, :class:`StreamDiagnostics` registers forward hooks on
every transformer block of this rank (and on the SiameseNorm merge), runs that one step with
them, reduces and returns the statistics, and removes the hooks again. Other steps, and runs
with ``interval = 0``, have no hook at all. Per global block l (0-based) it reports

    diag/{x,y}_rms/block{l}        RMS of the block's output streams (h_rms: single stream)
    diag/{x,y}_grad_norm/block{l}  L2 norm of d(step loss)/d(block output stream)
    diag/merge/{x,y}_rms           RMS of Na(x) and Nb(y) inside Nfinal(Na(x) + Nb(y))
    diag/merge/cosine              mean over tokens of cos(Na(x), Nb(y))
    diag/merge/x_share             |Na(x)| / (|Na(x)| + |Nb(y)|)  (Frobenius norms)

The step loss is the mean over the whole global batch, so the gradient norms do not depend on
how the batch is split into micro-batches or data-parallel replicas.

Parallel layouts: each rank fills the rows of the blocks it holds into one tensor shaped for
the whole model; one all-reduce over all ranks sums them, and the logging rank (last pipeline
stage, which also holds the merge) writes the record. Data-parallel replicas see different
tokens, so all of them contribute; without sequence parallelism the activations are replicated
across tensor-parallel ranks, so only TP rank 0 contributes; with it each TP rank holds a
disjoint slice of the sequence and all contribute. The same single all-reduce covers every case.
"""

from __future__ import annotations

import math
from collections import deque
from contextlib import contextmanager
from statistics import median

import torch
import torch.distributed as dist

from model import streams
from runtime import device

# Per-block columns of the statistics tensor (sums, reduced across ranks before use).
_X_SQ, _Y_SQ, _COUNT, _X_GRAD, _Y_GRAD = range(5)
# The merge row: sums of squares of Na(x) and Nb(y), of per-token cosines, tokens, elements.
_NA_SQ, _NB_SQ, _COS, _TOKENS, _ELEMS = range(5)


class LossSpikeDetector:
    """Flags a step whose loss exceeds ``factor`` x the median of the last ``window`` losses.

    A median (not a mean) so that one spike does not raise the bar for the next. Non-finite
    losses count as spikes and never enter the window; the first ``min_history`` steps after
    a (re)start only fill it.
    """

    def __init__(self, factor: float, window: int, min_history: int = 5):
        self.factor = factor
        self.losses: deque[float] = deque(maxlen=window)
        self.min_history = min(min_history, window)

    def update(self, step: int, loss: float) -> dict | None:
        """Feed one step's loss; returns the event record if it is a spike, else None."""
        event = None
        if len(self.losses) >= self.min_history:
            mid = median(self.losses)
            if not math.isfinite(loss) or loss > self.factor * mid:
                event = {"step": step, "event": "loss_spike", "spike_loss": loss,
                         "spike_median": mid}
        if math.isfinite(loss):
            self.losses.append(loss)
        return event


def _sumsq(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().float()
    return (t * t).sum()


class StreamDiagnostics:
    """Stream statistics of the measured steps, and loss-spike events of every step.

    Per training step (``step`` 1-based; :meth:`records` is collective, every rank calls it)::

        with diag.step(step):
            forward_backward(...)
        for record in diag.records(step, loss):
            metrics.log(record)
    """

    def __init__(self, chunks, num_layers: int, interval: int, *, two_stream: bool,
                 sequence_parallel: bool = False, spikes: LossSpikeDetector | None = None):
        # Imported here so that the spike detector alone (used by the sweep) needs no megatron.
        from megatron.core import parallel_state
        from megatron.core.transformer.transformer_layer import TransformerLayer

        from model.layers.merge import StreamMergeNorm

        self.interval = interval
        self.num_layers = num_layers
        self.two_stream = two_stream
        self.spikes = spikes
        self.layers = [m for c in chunks for m in c.modules() if isinstance(m, TransformerLayer)]
        self.merges = [m for c in chunks for m in c.modules() if isinstance(m, StreamMergeNorm)]
        # Replicated activations are counted once; sequence-parallel slices all count.
        self.contributes = sequence_parallel or parallel_state.get_tensor_model_parallel_rank() == 0
        # each rank's loss is its replica's (and, under context parallelism, scaled by cp as
        # megatron's schedule does): activation gradients are dp x cp times the batch loss's
        self.data_parallel = parallel_state.get_data_parallel_world_size(
            with_context_parallel=True)
        self.handles: list = []
        self.measured: int | None = None
        self.stats = torch.zeros(num_layers + 1, 5, dtype=torch.float64,
                                 device=device.compute_device())

    def wants(self, step: int) -> bool:
        """Whether 1-based ``step`` is measured."""
        return self.interval > 0 and step % self.interval == 0

    @contextmanager
    def step(self, step: int):
        """Hooks on for this step's forward-backward if it is measured; removed even if it
        raises. Other steps run with no hook at all."""
        if not self.wants(step):
            yield
            return
        self.attach()
        try:
            yield
        finally:
            self.detach()
        self.measured = step

    def records(self, step: int, loss: float) -> list[dict]:
        """This step's diagnostics record (if measured) and loss-spike event (if any)."""
        out = []
        if self.measured == step:
            out.append({"step": step, **self.collect()})
        event = self.spikes.update(step, loss) if self.spikes is not None else None
        if event is not None:
            out.append(event)
        return out

    # ---- hooks -------------------------------------------------------------------------
    def _split(self, out: torch.Tensor):
        return streams.unpack(out) if self.two_stream else (out, None)

    def _add(self, row: torch.Tensor, column: int, value: torch.Tensor | float) -> None:
        row[column] += value  # stays on the device: no host sync inside forward or backward

    def _layer_hook(self, layer, _inputs, output):
        out = output[0] if isinstance(output, tuple) else output
        row = self.stats[layer.layer_number - 1]  # global 1-based index, whatever the stage
        if self.contributes:
            x, y = self._split(out)
            self._add(row, _X_SQ, _sumsq(x))
            if y is not None:
                self._add(row, _Y_SQ, _sumsq(y))
            self._add(row, _COUNT, x.numel())
        # Activation recompute runs a layer once without grad, then again with it: the sums
        # double, the RMS does not change, and only the second pass registers the grad hook.
        if out.requires_grad:
            out.register_hook(lambda grad, row=row: self._grad_hook(row, grad))

    def _grad_hook(self, row: torch.Tensor, grad: torch.Tensor) -> None:
        if self.contributes:
            gx, gy = self._split(grad)
            self._add(row, _X_GRAD, _sumsq(gx))
            if gy is not None:
                self._add(row, _Y_GRAD, _sumsq(gy))

    def _merge_hook(self, merge, inputs, _output):
        if not self.contributes:
            return
        x, y = streams.unpack(inputs[0])
        with torch.no_grad():
            a, b = merge.x_norm(x).float(), merge.y_norm(y).float()
            row = self.stats[self.num_layers]
            self._add(row, _NA_SQ, _sumsq(a))
            self._add(row, _NB_SQ, _sumsq(b))
            self._add(row, _COS, torch.nn.functional.cosine_similarity(a, b, dim=-1).sum())
            self._add(row, _TOKENS, a.numel() // a.shape[-1])
            self._add(row, _ELEMS, a.numel())

    def attach(self) -> None:
        self.stats.zero_()
        for layer in self.layers:
            self.handles.append(layer.register_forward_hook(self._layer_hook))
        for merge in self.merges:
            self.handles.append(merge.register_forward_hook(self._merge_hook))

    def detach(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def collect(self) -> dict[str, float]:
        """Sum over all ranks (collective) and return the flat metrics of the measured step."""
        stats = self.stats.clone()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(stats)
        return summarize(stats.cpu(), self.num_layers, self.two_stream, self.data_parallel)


def build(config, chunks) -> StreamDiagnostics | None:
    """The run's diagnostics from ``config.diagnostics``; None (nothing at all) when off."""
    d = config.diagnostics
    if d.interval == 0:
        return None
    return StreamDiagnostics(
        chunks, config.model.num_layers, d.interval,
        two_stream=config.model.residual_scheme.traits.two_stream,
        sequence_parallel=config.parallel.sequence_parallel,
        spikes=LossSpikeDetector(d.spike_factor, d.spike_window))


def summarize(stats: torch.Tensor, num_layers: int, two_stream: bool,
              data_parallel: int) -> dict[str, float]:
    """Turn the reduced sums into the logged metrics. Each data-parallel replica computed the
    gradient of its own mean loss; the step loss is their mean, hence the 1 / dp."""
    out: dict[str, float] = {}
    names = ("x", "y") if two_stream else ("h",)
    for block in range(num_layers):
        row = stats[block]
        if row[_COUNT] == 0:
            continue
        for name, sq, grad in zip(names, (_X_SQ, _Y_SQ), (_X_GRAD, _Y_GRAD), strict=False):
            out[f"diag/{name}_rms/block{block:02d}"] = math.sqrt(row[sq] / row[_COUNT])
            out[f"diag/{name}_grad_norm/block{block:02d}"] = math.sqrt(row[grad]) / data_parallel
    merge = stats[num_layers]
    if merge[_TOKENS] > 0:
        na, nb = math.sqrt(merge[_NA_SQ]), math.sqrt(merge[_NB_SQ])
        out["diag/merge/x_rms"] = na / math.sqrt(merge[_ELEMS])
        out["diag/merge/y_rms"] = nb / math.sqrt(merge[_ELEMS])
        out["diag/merge/cosine"] = float(merge[_COS] / merge[_TOKENS])
        out["diag/merge/x_share"] = na / (na + nb) if na + nb > 0 else float("nan")
    return out
