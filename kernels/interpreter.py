"""Two adjustments to Triton's CPU interpreter (``TRITON_INTERPRET=1``), the only way the fused
kernels run without CUDA: in the tests, the CPU benchmarks and the GPU check's rehearsal.
Compiled kernels never see either; :func:`adjust` is called by ``kernels.triton_kernels`` when
it is imported under the interpreter, so every process that interprets the kernels (test
workers, their gloo ranks, a bench) has both.

- :func:`_index_scalars`: Triton 3.6's interpreter (the GPU image's) turns a scalar tensor used
  as an index (a ``range`` bound) into an int with ``int()`` of its one-element array, which
  the locked NumPy (2.4) refuses ("only 0-dimensional arrays can be converted to Python
  scalars"); Triton 3.9 squeezes the array first. The same squeeze here.
- :func:`_patch_the_language_once_per_launch`: the interpreter maps ``triton.language`` onto its
  NumPy builder by patching the language's modules, and it does so at every launch (restoring
  them after) and again at every call of a ``@triton.jit`` helper inside the kernel, once per
  program of the grid, without restoring. Each patch walks the modules with
  ``inspect.getmembers``. Inside a launch, a helper of a module whose view of the language the
  launch has patched already (the kernel's own module; triton.language's standard library
  after its first helper) would set the same functions again, so that patch is skipped. One
  RMSNorm forward and backward over 64 rows: 557 walks before, 17 after; the kernel parity
  modules (tests/kernels/test_triton_kernels.py, test_registered_ops.py) 155 s before, 98 s
  after, on one core.
"""

from __future__ import annotations


def adjust() -> None:
    """Both adjustments, once per process (a second call changes nothing)."""
    from triton.runtime import interpreter

    _index_scalars(interpreter)
    _patch_the_language_once_per_launch(interpreter)


def _index_scalars(interpreter) -> None:
    patch_tensor = getattr(interpreter, "_patch_lang_tensor", None)
    if patch_tensor is None or getattr(patch_tensor, "squeezes_index", False):
        return

    def patch_tensor_squeezing(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patch_tensor_squeezing.squeezes_index = True
    interpreter._patch_lang_tensor = patch_tensor_squeezing


class _Unchanged:
    """The scope of a patch that was skipped: nothing to restore."""

    def restore(self) -> None:
        pass


def _patch_the_language_once_per_launch(interpreter) -> None:
    patch_lang = getattr(interpreter, "_patch_lang", None)
    if patch_lang is None or getattr(patch_lang, "once_per_launch", False):
        return
    # the modules (their globals) whose view of the language the running launch has patched;
    # None between launches
    patched: set[int] | None = None

    class _LaunchScope:
        """A launch's patches: restoring them ends the launch."""

        def __init__(self, scope):
            self.scope = scope

        def restore(self) -> None:
            nonlocal patched
            self.scope.restore()
            patched = None

    def patch_lang_once(fn):
        nonlocal patched
        module = id(fn.__globals__)
        if patched is None:  # a launch
            scope = _LaunchScope(patch_lang(fn))
            patched = {module}
            return scope
        if module in patched:  # a helper of a module already patched in this launch
            return _Unchanged()
        patched.add(module)  # a helper of another module (triton.language's own: tl.sum)
        return patch_lang(fn)

    patch_lang_once.once_per_launch = True
    interpreter._patch_lang = patch_lang_once
