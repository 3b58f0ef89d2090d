"""What ops and fused-kernel launches read and write, counted in bytes and attributed to the
source line that issued them (``bench.traffic`` counts a layer with it).

An aten op reads its tensor inputs and writes its outputs, each tensor counted as the memory it
spans (an expanded dimension once); views, aliases and allocations move nothing; an in-place op
reads its inputs and writes its result, ``copy_`` reads only its source; matmuls and attention
kernels are not counted ("inside the matmuls"). A Triton launch reads and writes the tensor
arguments :data:`KERNEL_ROLES` names for its constexprs.
"""

from __future__ import annotations

import os
import re
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# Inside the matmuls: left out of the count (recorded by name only).
MATMULS = frozenset({"mm", "bmm", "addmm", "baddbmm", "matmul", "linear", "mv", "addmv", "dot"})
_ATTENTION = re.compile(r"scaled_dot_product|flash_attention|efficient_attention|cudnn_attention")
# No traffic: metadata, aliases and allocations (a fresh tensor is written by whoever fills it).
FREE = frozenset({"detach", "alias", "lift_fresh", "_unsafe_view", "_reshape_alias", "empty",
                  "empty_like", "empty_strided", "new_empty", "new_empty_strided", "set_",
                  "resize_", "resize_as_"})
WRITE_ONLY = frozenset({"fill_", "zero_", "normal_", "uniform_", "random_", "bernoulli_",
                        "exponential_"})

# What each Triton kernel loads and stores: "argument r|w [CONSTEXPR ...]", where the
# constexprs listed must all be true (a "!" before one: false) for the kernel to touch the
# argument (the ops pass some tensor as a placeholder for an absent input or output). Held to
# the kernels' signatures by tests/bench/test_traffic.py.
KERNEL_ROLES = {
    "norm_fwd": ("x_ptr r", "r_ptr r HAS_RESIDUAL", "w_ptr r", "b_ptr r HAS_BIAS",
                 "out_ptr w", "stats_ptr w"),
    "norm_bwd": ("x_ptr r", "r_ptr r HAS_RESIDUAL", "w_ptr r", "stats_ptr r", "g_ptr r",
                 "dx_ptr w", "dr_ptr w HAS_RESIDUAL", "dw_ptr w"),
    "entry_fwd": ("x_ptr r", "y_ptr r", "r_ptr r UPDATE", "wa_ptr r", "ba_ptr r HAS_BIAS !GATE",
                  "wb_ptr r", "bb_ptr r HAS_BIAS", "wc_ptr r HAS_C", "bc_ptr r HAS_C HAS_BIAS",
                  "wu_ptr r UPDATE RECOMPUTE_U", "bu_ptr r UPDATE RECOMPUTE_U HAS_BIAS",
                  "a_out_ptr w STORE_A", "y_out_ptr w UPDATE", "s_out_ptr w", "stats_ptr w",
                  "scale_ptr r UPDATE"),
    "entry_bwd": ("x_ptr r", "y_ptr r", "r_ptr r UPDATE", "wa_ptr r",
                  "ba_ptr r HAS_C HAS_BIAS !GATE", "wb_ptr r", "bb_ptr r HAS_C HAS_BIAS",
                  "wc_ptr r HAS_C", "wu_ptr r RECOMPUTE_U", "bu_ptr r RECOMPUTE_U HAS_BIAS",
                  "stats_ptr r", "ga_ptr r STORE_A", "gy_ptr r HAS_GY", "gx_ptr r HAS_GX",
                  "gs_ptr r", "dx_ptr w", "dy_ptr w", "dr_ptr w UPDATE", "dw_ptr w",
                  "scale_ptr r UPDATE"),
    "dual_update_fwd": ("u_ptr r", "y_ptr r", "r_ptr r", "ox_ptr w", "oy_ptr w", "scale_ptr r"),
    "dual_update_bwd": ("gx_ptr r", "gy_ptr r", "dr_ptr w", "scale_ptr r"),
    "qkv_norm_fwd": ("mixed_ptr r", "wq_ptr r", "wk_ptr r", "wv_ptr r", "bq_ptr r HAS_BIAS",
                     "bk_ptr r HAS_BIAS", "bv_ptr r HAS_BIAS", "q_ptr w", "k_ptr w", "v_ptr w",
                     "stats_ptr w"),
    "qkv_norm_bwd": ("mixed_ptr r", "wq_ptr r", "wk_ptr r", "wv_ptr r", "stats_ptr r",
                     "gq_ptr r", "gk_ptr r", "gv_ptr r", "dmixed_ptr w", "dw_ptr w"),
}


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of the memory ``t`` spans: its elements, an expanded (stride-0) dimension once."""
    n = 1
    for size, stride in zip(t.shape, t.stride(), strict=True):
        if stride != 0:
            n *= size
    return n * t.element_size() if t.numel() else 0


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def op_bytes(func, args: tuple, kwargs: dict, out,
             size: Callable[[torch.Tensor], int] = tensor_bytes) -> tuple[int, int] | None:
    """(bytes read, bytes written) of one aten op, or None for a matmul (not counted)."""
    name = func.overloadpacket.__name__
    if name in MATMULS or _ATTENTION.search(name):
        return None
    if func.namespace != "aten" or name in FREE or func.is_view:
        return 0, 0
    written = sum(size(t) for t in _tensors(out))
    if name in WRITE_ONLY:
        return 0, written
    inputs = _tensors((args[1:], kwargs)) if name == "copy_" else _tensors((
        args, {k: v for k, v in kwargs.items() if k != "out"}))
    return sum(size(t) for t in inputs), written


def kernel_bytes(name: str, arg_names: list[str], args: tuple, constexprs: dict,
                 size: Callable[[torch.Tensor], int] = tensor_bytes) -> tuple[int, int]:
    """(bytes read, bytes written) of one Triton launch: the tensor arguments the kernel loads
    and stores under ``constexprs`` (:data:`KERNEL_ROLES`), each counted whole."""
    values = dict(zip(arg_names, args, strict=False))
    counts = {"r": 0, "w": 0}
    for role in KERNEL_ROLES[name]:
        arg, mode, *needs = role.split()
        if all(not constexprs[flag[1:]] if flag.startswith("!") else constexprs[flag]
               for flag in needs):
            counts[mode] += size(values[arg])
    return counts["r"], counts["w"]


def _source_roots() -> list[tuple[str, int]]:
    """(path prefix, length of the part to drop) of the directories whose lines are reported."""
    import megatron.core

    repo = Path(__file__).resolve().parents[1]
    roots = [(str(repo / d) + os.sep, len(str(repo)) + 1) for d in ("model", "kernels")]
    megatron_dir = Path(megatron.core.__file__).resolve().parents[1]
    roots.append((str(megatron_dir) + os.sep, len(str(megatron_dir.parent)) + 1))
    return roots


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


class TrafficMode(TorchDispatchMode):
    """Counts bytes per (phase, op, source line, model line) for every aten op it sees and
    every Triton launch given to :meth:`launch`. Set ``phase`` before each pass.

    With ``grid``, a backward launch's fp32 weight-gradient partials (one row of slots per
    program) count at the size ``grid(kernel, n_rows, constexprs)`` programs give them (the
    grid a GPU would launch: ``bench.traffic``), in the launch and in the torch ops that read
    them, whatever grid this machine gave them."""

    def __init__(self, grid: Callable[[str, int, dict], int] | None = None):
        super().__init__()
        self.grid = grid
        self._resized: dict[int, tuple[torch.Tensor, float]] = {}
        self.phase = "forward"
        self.counts: dict[tuple, list[int]] = defaultdict(lambda: [0, 0, 0])
        self.matmuls: dict[str, int] = defaultdict(int)
        self._roots = _source_roots()
        self._model_root = self._roots[0][0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        moved = op_bytes(func, args, kwargs, out, self.size)
        if moved is None:
            self.matmuls[str(func)] += 1
        elif moved != (0, 0):
            self.add(str(func), *moved)
        return out

    def size(self, t: torch.Tensor) -> int:
        """:func:`tensor_bytes`, or a partials tensor's at the GPU grid's size."""
        resized = self._resized.get(id(t))
        if resized is not None and resized[0] is t:
            return round(tensor_bytes(t) * resized[1])
        return tensor_bytes(t)

    def launch(self, name: str, arg_names: list[str], args: tuple, constexprs: dict) -> None:
        values = dict(zip(arg_names, args, strict=False))
        partials = values.get("dw_ptr")
        if self.grid is not None and partials is not None and partials.shape[0]:
            programs = self.grid(name, values["n_rows"], constexprs)
            self._resized[id(partials)] = (partials, programs / partials.shape[0])
        self.add(f"triton.{name}", *kernel_bytes(name, arg_names, args, constexprs, self.size))

    def counting_kernels(self):
        """A context inside which every fused-kernel launch is counted here instead of run."""
        from bench import triton_launches
        from kernels import triton_kernels

        names = {n: list(getattr(triton_kernels, n).arg_names) for n in triton_launches.KERNELS}
        return triton_launches.kernels_replaced(
            lambda name, args, constexprs: self.launch(name, names[name], args, constexprs))

    def add(self, op: str, read: int, written: int) -> None:
        line, via = self._origin()
        entry = self.counts[(self.phase, op, line, via)]
        entry[0] += read
        entry[1] += written
        entry[2] += 1

    def _name(self, path: str, line, function: str) -> str | None:
        for prefix, drop in self._roots:
            if path.startswith(prefix):
                return f"{path[drop:]}:{line} {function}"
        return None

    def _origin(self) -> tuple[str, str]:
        """The innermost reported line of the live stack and the innermost one under model/;
        in backward, where autograd runs an op from C++, the forward lines it comes from."""
        live = self._live_frames()
        if self.phase == "forward":
            return self._pick(live)
        recorded = self._forward_frames()
        line, via = self._pick(recorded)
        if live:
            line = live[0][1]
        return line, via

    def _pick(self, frames: list[tuple[str, str]]) -> tuple[str, str]:
        line = frames[0][1] if frames else "(no source line)"
        via = next((name for path, name in frames if path.startswith(self._model_root)), "")
        return line, via

    def _live_frames(self) -> list[tuple[str, str]]:
        frames, frame = [], sys._getframe(2)
        while frame is not None:
            code = frame.f_code
            name = self._name(code.co_filename, frame.f_lineno, code.co_name)
            if name is not None:
                frames.append((code.co_filename, name))
                if code.co_filename.startswith(self._model_root):
                    break
            frame = frame.f_back
        return frames

    def _forward_frames(self) -> list[tuple[str, str]]:
        node = torch._C._current_autograd_node()
        stack = node.metadata.get("traceback_", []) if node is not None else []
        frames = []
        for entry in reversed(stack):
            match = _FRAME.search(entry)
            if match:
                name = self._name(*match.groups())
                if name is not None:
                    frames.append((match.group(1), name))
        return frames

    def totals(self) -> dict[tuple, int]:
        """Bytes (read + written) per (phase, op, line, via)."""
        return {key: r + w for key, (r, w, _) in self.counts.items()}
