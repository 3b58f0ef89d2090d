"""No Triton kernel of ours loads or stores outside the tensors its launch was given, checked
address by address in Triton's interpreter (tests/kernels/bounds.py) at shapes that are not
multiples of any tile: every op the GPU check's rehearsal times, forward and backward, at odd
widths, one of them wide enough for the entry backward's re-reads. (Every launch of the
kernel tests runs under the same check where it is made: tests/kernels/conftest.py.)

In the interpreter a store under a wrong mask writes into the host's heap, which glibc may
notice only much later (``double free or corruption``); on a GPU it corrupts device memory.
The check first shows that it catches such accesses (in a toy row copy, and in a copy of our
kernels with one mask dropped) and keeps the memory around them intact.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import triton
import triton.language as tl

from kernels import triton_kernels, triton_ops
from tests.kernels.bounds import checked, kernel_names

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="the check reads addresses in Triton's interpreter")

KERNELS = kernel_names()


@triton.jit
def _copy_rows(x_ptr, out_ptr, x_stride, out_stride, n_rows, n_cols, ROWS: tl.constexpr,
               BLOCK: tl.constexpr, MASK_COLS: tl.constexpr):
    """A row copy as our kernels write it; without ``MASK_COLS`` its mask forgets the
    columns, the mistake the check is for."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    mask = (rows < n_rows)[:, None]
    if MASK_COLS:
        mask = mask & (cols < n_cols)[None, :]
    x = tl.load(x_ptr + rows[:, None] * x_stride + cols[None, :], mask=mask, other=0.0)
    tl.store(out_ptr + rows[:, None] * out_stride + cols[None, :], x, mask=mask)


def _copy(x: torch.Tensor, out: torch.Tensor, mask_cols: bool) -> None:
    rows, cols = x.shape
    _copy_rows[(triton.cdiv(rows, 4),)](x, out, x.stride(0), out.stride(0), rows, cols, ROWS=4,
                                        BLOCK=triton.next_power_of_2(cols),
                                        MASK_COLS=mask_cols)


def test_a_correct_kernel_passes_with_every_lane_counted():
    x, out = torch.randn(7, 5), torch.zeros(7, 5)
    with checked() as report:
        _copy(x, out, mask_cols=True)
    assert report.violations == [] and report.launches == {"_copy_rows": 1}
    assert report.accesses == 4 and report.lanes == 2 * 7 * 5  # two tiles: a load, a store
    assert torch.equal(out, x)


def test_a_store_past_the_row_is_caught_and_the_memory_beyond_kept():
    """The copy without its column mask (block 8, rows of 5) into the first of two halves of
    a packed tensor (the model's streams): each row's last 3 lanes would land in the second
    half, which is no element of the output. Its loads stray too, but from a contiguous
    input they read the next row, an element of it: only the last row's are outside."""
    x = torch.randn(7, 5)
    packed = torch.full((7, 16), 9.0)
    with checked() as report:
        _copy(x, packed[:, :5], mask_cols=False)
    assert len(report.violations) == 3, report.violations
    load, *stores = sorted(report.violations)
    assert "load of 3 of 24 lanes outside every tensor argument; first at x_ptr + 140" in load
    assert "store of 12 of 32 lanes outside every tensor argument" in stores[0]
    assert "store of 9 of 24 lanes outside every tensor argument" in stores[1]
    assert torch.equal(packed[:, :5], x) and bool((packed[:, 5:] == 9.0).all())


def test_an_access_reaching_into_another_argument_is_caught():
    """A copy from the first half of a packed tensor into the second with the packed width
    (8) as the row's: each load reaches the second half, an argument of the launch but not
    the one the load addresses (an access must stay within one tensor), and the last row's
    store runs past the storage, whose next row is kept."""
    buffer = torch.full((4, 8), 9.0)
    packed = buffer[:3]
    packed.copy_(torch.randn(3, 8))
    with checked() as report:
        _copy_rows[(1,)](packed[:, :4], packed[:, 4:], 8, 8, 3, 8, ROWS=4, BLOCK=8,
                         MASK_COLS=True)
    assert len(report.violations) == 2, report.violations
    assert "_copy_rows: a load of 24 lanes spans several arguments" in report.violations[0]
    assert "store of 4 of 24 lanes outside every tensor argument" in report.violations[1]
    assert bool((buffer[3] == 9.0).all())


def test_a_wrong_mask_in_our_own_kernels_is_caught(tmp_path, monkeypatch):
    """A copy of our kernels whose statistics are stored without the row mask (13 rows in a
    16-row tile: 3 rows past the statistics tensor), as the plain norm launches it. Run
    without the check, this copy aborts the process with glibc's heap-corruption errors."""
    source = Path(triton_kernels.__file__).read_text()
    right = ("        tl.store(base, mean, mask=row_mask)\n"
             "    tl.store(base + 1, rstd, mask=row_mask)")
    assert right in source, "the negative control's mutation no longer applies"
    copy = tmp_path / "wrong_mask_kernels.py"
    copy.write_text(source.replace(right, "        tl.store(base, mean)\n"
                                          "    tl.store(base + 1, rstd)"))
    spec = importlib.util.spec_from_file_location("wrong_mask_kernels", copy)
    wrong = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(wrong)
    monkeypatch.setattr(triton_ops, "kern", wrong)
    x, weight, bias = torch.randn(13, 96), torch.ones(96), torch.zeros(96)
    with checked() as report:
        out = triton_ops.norm(x, weight, bias, 1e-5, is_rms=False)
    assert report.launches == {"norm_fwd": 1} and len(report.violations) == 2
    for violation, first in zip(report.violations, (104, 108), strict=True):  # mean, rstd
        assert ("norm_fwd: store of 3 of 16 lanes outside every tensor argument; first at "
                f"stats_ptr + {first} bytes") in violation, violation
    assert torch.allclose(out, torch.nn.functional.layer_norm(x, (96,), weight, bias),
                          atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("norm", ["rmsnorm", "layernorm"])
def test_the_rehearsed_ops_stay_inside_their_tensors_at_odd_shapes(norm, dtype):
    """Every op of bench.fused_norms as the GPU check's rehearsal runs it (its modules, calls
    and inputs), forward and forward+backward, at 13 tokens of width 96 (head size 3 for the
    Q/K/V norms) and 3 tokens of width 4100 (a 8192-wide block: the entry backward's
    re-reads)."""
    from bench import fused_norms

    with checked() as report:
        for tokens, hidden in ((13, 96), (3, 4100)):
            args = SimpleNamespace(seq=tokens, batch=1, hidden=hidden, norm=norm)
            config = fused_norms.norm_config(args, dtype)
            backend = fused_norms.implementations(False)["triton (fused)"][0]
            for op in fused_norms.OPS:
                module = fused_norms.op_module(op, backend, config, hidden, "cpu")
                tensors = fused_norms.op_inputs(op, tokens, hidden, dtype, "cpu")
                for run in fused_norms.passes(fused_norms.op_call(op, backend), tensors,
                                              module).values():
                    run()
    assert report.violations == []
    assert set(report.launches) == KERNELS
    assert any(("RELOAD", True) in constants for _, constants in report.variants)
