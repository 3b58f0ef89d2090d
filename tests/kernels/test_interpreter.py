"""``kernels.interpreter``: Triton's CPU interpreter patches the language once per launch and
per module of helpers, not once per helper call of every program, and still restores it after
the launch. (That the kernels compute the same is every parity test in this folder.)"""

import pytest
import torch
import triton.language as tl
from triton.runtime import interpreter

from kernels import triton_ops

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="the kernels run compiled, not interpreted, with CUDA")


def _counting(monkeypatch, obj, name: str, calls: list) -> None:
    """``obj.name`` appends its first argument to ``calls``, then does what it did."""
    original = getattr(obj, name)

    def counted(first, *args, **kwargs):
        calls.append(first)
        return original(first, *args, **kwargs)

    monkeypatch.setattr(obj, name, counted)


def test_a_launch_patches_the_language_once_per_module_and_restores_it(monkeypatch):
    patched, programs, launches = [], [], []
    _counting(monkeypatch, interpreter, "_patch_builtin", patched)
    _counting(monkeypatch, interpreter.interpreter_builder, "set_grid_idx", programs)
    _counting(monkeypatch, interpreter.GridExecutor, "__call__", launches)
    load = tl.load
    # 64 rows at hidden 256, forward and backward: several programs per launch, each calling
    # the kernel module's helpers (_tile_rows, _load, _normalize, _store) and triton.language's
    # own (tl.sum)
    x = torch.randn(64, 256, requires_grad=True)
    w = torch.randn(256, requires_grad=True)
    triton_ops.norm(x, w, None, 1e-5, True).sum().backward()
    assert len(programs) > 2 * len(launches) > 0, (len(programs), len(launches))
    # a patch of one module's view of the language walks 3 or 4 modules (the language, its
    # tensor and math modules, the tensor descriptor), once per launch for the kernel's module
    # and for each of triton.language's own whose helpers it calls (2 here, 7-10 walks per
    # launch measured); patched per helper call of every program, it was 557
    assert len(patched) <= 12 * len(launches), (len(patched), len(launches))
    assert tl.load is load  # restored after the launches
    assert x.grad is not None and w.grad is not None
