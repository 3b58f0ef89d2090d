"""The commands behind two figures of the docs: bench.official_code (docs/schemes.md's table of
errors against the official code) and bench.cpu_compat (the CPU layer's cost, docs/kernels.md).
Both run in the test process, at a small size."""

from __future__ import annotations

import torch

from bench import cpu_compat as bench_cpu_compat
from bench import official_code
from runtime import cpu_compat
from tests.model import test_official_code


def test_official_code_table_has_every_case_within_the_tests_bound(single_rank):
    rows, literal = official_code.errors()
    assert [row[0] for row in rows] == [case[0] for case in test_official_code.CASES]
    assert all(len(row) == 2 + len(test_official_code.NORMS) for row in rows)
    assert all(float(value) <= 1e-5 for row in rows for value in row[2:])
    assert literal > 1e-3  # the literal reading is another function
    table = official_code.report(rows, literal)
    assert table.splitlines()[0] == "| scheme | switches | rmsnorm | layernorm | layernorm + bias |"
    assert "| siamese_hybrid | `hybrid_first_block = \"prenorm\"` |" in table
    assert "| siamese | `siamese_depth_constant = false` |" in table


def test_cpu_compat_times_steps_with_and_without_the_mode(single_rank, monkeypatch):
    if torch.cuda.is_available():
        assert not cpu_compat.active()  # inert with CUDA: nothing to measure
        return
    seen = []
    original = bench_cpu_compat.without_mode

    def recording():
        seen.append(torch.overrides._get_current_function_mode_stack()[:])
        return original()

    monkeypatch.setattr(bench_cpu_compat, "without_mode", recording)
    args = bench_cpu_compat.parse_args(["--layers", "1", "--hidden", "32", "--ffn", "64",
                                        "--seq", "16", "--batch", "2", "--vocab", "64",
                                        "--repeats", "2", "--warmup", "1"])
    times = bench_cpu_compat.measure(args)
    assert bench_cpu_compat.parse_args(["--clock", "cpu"]).clock == "cpu"
    assert {k: len(v) for k, v in times.items()} == {"with the mode": 2, "without the mode": 2}
    assert len(seen) == 3 and all(seen)  # the mode was in force before each popped step
    # and popped inside it: a step without the mode leaves the stack as it found it
    assert torch.overrides._get_current_function_mode_stack() == seen[-1]
    text = bench_cpu_compat.report(times)
    assert "| with the mode |" in text and "| without the mode |" in text
    assert "overhead of the mode:" in text


def test_without_mode_pops_the_cpu_layers_mode(single_rank):
    if torch.cuda.is_available():
        return
    before = torch.overrides._get_current_function_mode_stack()
    with bench_cpu_compat.without_mode():
        inside = torch.overrides._get_current_function_mode_stack()
    assert len(inside) == len(before) - 1
    assert torch.overrides._get_current_function_mode_stack() == before


def test_cpu_compat_overhead_is_the_median_of_each_rounds_ratio():
    times = {"with the mode": [1.1, 3.0, 1.2, 1.3], "without the mode": [1.0, 2.0, 1.0, 1.0]}
    text = bench_cpu_compat.report(times)  # round ratios 1.1, 1.5, 1.2, 1.3: median 1.25
    assert "overhead of the mode: +25.0% of a step, +250.0 ms" in text  # diffs .1 1 .2 .3
    assert "| with the mode | 1250.0 | 1.250 |" in text  # medians 1.25 s and 1.0 s
