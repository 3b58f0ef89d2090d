"""Where a training step's GPU time goes, kernel by kernel, and what a scheme adds over pre.

``bench.gpu_step --profile N`` runs N more steps of each (scheme, setting) under
``torch.profiler`` after its timed steps (so profiling overhead never reaches the timings),
and keeps, per GPU kernel, the calls and the GPU time per step. The report puts the schemes of
one setting side by side, kernels sorted by how much more time a scheme spends in them than
pre: the list of what stands between a scheme and pre's step time, to measure before and
after a change.
"""

from __future__ import annotations

from collections.abc import Callable

from runtime.markdown import markdown_table

NAME_WIDTH = 70


def kernel_times(step: Callable[[], None], steps: int) -> dict[str, list[float]]:
    """{kernel name: [calls per step, GPU ms per step]} over ``steps`` calls of ``step``.
    Without CUDA (a rehearsal of the benchmark on the CPU): CPU operators and their own
    CPU time instead."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize()
    times = {}
    for event in prof.key_averages():
        device_us = getattr(event, "device_time_total", None)
        if device_us is None:  # torch releases before device_time_total
            device_us = event.cuda_time_total
        if not cuda:
            device_us = event.self_cpu_time_total
        if device_us > 0:
            times[event.key] = [event.count / steps, device_us / 1e3 / steps]
    return times


def difference_table(profiles: dict[str, dict[str, list[float]]], rows: int = 20) -> str:
    """Kernels of several schemes' profiles (one setting) side by side, GPU ms per step, the
    ``rows`` kernels on which some scheme spends most more than pre first."""
    schemes = list(profiles)
    base = profiles.get("pre", {})
    names = {name for times in profiles.values() for name in times}

    def ms(scheme: str, name: str) -> float:
        return profiles[scheme].get(name, [0.0, 0.0])[1]

    def extra(name: str) -> float:
        return max(ms(s, name) - base.get(name, [0.0, 0.0])[1] for s in schemes)

    ranked = sorted(names, key=extra, reverse=True)[:rows]
    table = [[_short(name)]
             + [f"{ms(s, name):.2f} ({profiles[s].get(name, [0, 0])[0]:g})" for s in schemes]
             + [f"{extra(name):+.2f}"] for name in ranked]
    totals = [["all kernels"] + [f"{sum(t[1] for t in profiles[s].values()):.2f}"
                                 for s in schemes] + [""]]
    return markdown_table(["kernel", *[f"{s} ms (calls)" for s in schemes], "most over pre"],
                          table + totals)


def _short(name: str) -> str:
    name = name.replace("|", "/")
    return name if len(name) <= NAME_WIDTH else name[:NAME_WIDTH - 3] + "..."
