"""``bench.gpu_step`` prints its table from the workers' results (checked with made-up
timings here; the numbers themselves need a GPU)."""

import pytest

from bench import gpu_step


def fake(scheme: str, micro_batch: int, step_ms: float) -> dict:
    return {"scheme": scheme, "micro_batch": micro_batch, "parameters": 1_000,
            "fwd_bwd_s": [step_ms * 0.8e-3] * 3, "optimizer_s": [step_ms * 0.2e-3] * 3,
            "step_s": [step_ms * 1e-3] * 3, "activation_bytes": 2**30 * micro_batch,
            "first_loss": 10.8, "seq": 4096, "flops_per_step": 1e15, "peak_tflops": 989.0,
            "device": "made-up GPU", "attention": "sdpa", "linears": "local",
            "norms": "triton"}


def test_the_table_has_a_row_per_scheme_and_micro_batch(capsys):
    args = gpu_step.parse_args(["--micro-batches", "2,4"])
    results = {("pre", 2, "auto", "none"): fake("pre", 2, 100.0),
               ("siamese", 2, "auto", "none"): fake("siamese", 2, 102.0),
               ("pre", 4, "auto", "none"): fake("pre", 4, 180.0),
               ("siamese", 4, "auto", "none"): fake("siamese", 4, 185.4)}
    gpu_step.report(args, results)
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| pre") or
            line.startswith("| siamese")]
    assert len(rows) == 4
    assert "| siamese | 4 | local | none |" in out and "| 1.030 |" in out  # 185.4 / 180
    assert "| 20.0 |" in out  # the optimizer's share of pre's 100 ms step at micro-batch 2
    assert ("best pre setting: micro-batch 4, linears local, recompute none (91,022 tokens/s)"
            in out)


def test_recompute_is_a_setting_of_its_own(capsys):
    """Ratios compare within one recompute setting; the best pre setting can be a recomputed
    one when it allows a larger micro-batch."""
    args = gpu_step.parse_args(["--micro-batches", "4,8", "--recomputes", "none,full"])
    results = {("pre", 4, "auto", "none"): fake("pre", 4, 180.0),
               ("siamese", 4, "auto", "none"): fake("siamese", 4, 190.0),
               ("pre", 8, "auto", "full"): fake("pre", 8, 340.0),
               ("siamese", 8, "auto", "full"): fake("siamese", 8, 357.0)}
    gpu_step.report(args, results)
    out = capsys.readouterr().out
    assert "| siamese | 8 | local | full |" in out and "| 1.050 |" in out  # 357 / 340
    assert "best pre setting: micro-batch 8, linears local, recompute full" in out


def test_an_unknown_recompute_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        gpu_step.parse_args(["--recomputes", "none,partial"])
    assert exit_info.value.code == 2
    assert "--recomputes: 'partial' is not one of none, selective, full" in capsys.readouterr().err


def test_profiles_are_put_side_by_side_by_what_a_scheme_adds(capsys):
    """Kernels are ranked by how much more GPU time a scheme spends in them than pre."""
    args = gpu_step.parse_args(["--micro-batches", "2", "--profile", "2"])
    pre, siamese = fake("pre", 2, 100.0), fake("siamese", 2, 105.0)
    pre["profile"] = {"gemm": [10, 80.0], "entry_bwd": [0, 0.0], "norm_fwd": [4, 1.0]}
    siamese["profile"] = {"gemm": [10, 80.5], "entry_bwd": [2, 3.0], "norm_fwd": [1, 0.2]}
    gpu_step.report(args, {("pre", 2, "auto", "none"): pre,
                           ("siamese", 2, "auto", "none"): siamese})
    out = capsys.readouterr().out
    table = out[out.index("GPU kernels per step"):].splitlines()
    kernels = [line.split("|")[1].strip() for line in table if line.startswith("| ")][2:]
    assert kernels[:3] == ["entry_bwd", "gemm", "norm_fwd"], kernels
    assert "| entry_bwd | 0.00 (0) | 3.00 (2) | +3.00 |" in out
    assert "| all kernels | 81.00 | 83.70 |" in out


def test_a_forked_worker_reports_its_failure_and_is_killed_at_its_timeout(monkeypatch,
                                                                          tmp_path):
    """The CPU rehearsal's workers are forked (gpu_step._forked): a worker that raises exits 1
    with its traceback as its output; one that outlives its timeout is killed and reaped."""
    import os
    import subprocess
    import time

    def broken(argv):
        raise ValueError(f"broken with {argv}")

    monkeypatch.setattr(gpu_step, "main", broken)
    done = gpu_step._forked(["--worker", "pre"], timeout=60)
    assert done.returncode == 1
    assert "ValueError: broken with ['--worker', 'pre']" in done.stdout

    def hangs(argv):
        (tmp_path / "pid").write_text(str(os.getpid()))
        time.sleep(60)

    monkeypatch.setattr(gpu_step, "main", hangs)
    began = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        gpu_step._forked(["--worker", "pre"], timeout=1)
    assert time.monotonic() - began < 10
    pid = int((tmp_path / "pid").read_text())
    assert not os.path.exists(f"/proc/{pid}"), "the worker was left (alive or unreaped)"
