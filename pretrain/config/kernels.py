"""[kernels]: how the blocks compute (norm backend, compiled blocks, CUDA graphs, the fused
optimizer), and its rules."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

from kernels.backend import NormBackend
from model.config import coerce_choices, require

if TYPE_CHECKING:
    pass


class CompileBackend(StrEnum):
    INDUCTOR = "inductor"  # generated kernels
    AOT_EAGER = "aot_eager"  # Dynamo and AOTAutograd's capture, run by eager torch
    EAGER = "eager"  # Dynamo's capture only


@dataclass
class KernelsConfig:
    """Which implementation computes the norms (``kernels/backend.py``), resolved once when the
    model is built."""

    norm_backend: NormBackend = NormBackend.AUTO
    """auto | torch | triton | te. auto: the fused Triton kernels on a CUDA machine with Triton,
    else the torch reference."""
    compile: bool = False
    """Compile each transformer block with torch.compile (model/compiled.py): blocks of one
    class share their compiled code, the schedules, recompute wrappers, embedding and loss stay
    eager. Compilation happens in the first step, which the console reports with its
    seconds; later starts load it from compile_cache. Off by default until a GPU run has timed
    it; the CPU demo's config turns it on, where it pays for itself (docs/compile.md).
    generate, lm-eval and export-hf run eager whatever this says."""
    compile_backend: CompileBackend = CompileBackend.INDUCTOR
    """With compile: inductor (generated code), or aot_eager / eager (Dynamo's capture only,
    no code generation: for checking graph breaks and recompiles quickly)."""
    compile_cache: str = ""
    """With compile: the folder of inductor's and Triton's compiled artifacts, read and
    written by every rank, so a restart or resume reuses them; a folder every node sees lets
    a multi-node run share them ("": <run.dir>/compile_cache). Where its filesystem refuses
    flock, which inductor's cache locks need, a node-local folder in TMPDIR instead, said at
    the start (docs/run-folder.md)."""
    cuda_graphs: bool = False
    """With compile and the inductor backend on a CUDA device: capture each compiled block's
    kernels as CUDA graphs (inductor's cudagraph trees, torch.compile's reduce-overhead),
    replayed every step to cut kernel-launch overhead. Refused without CUDA. Untested on a
    GPU so far (docs/compile.md)."""

    def __post_init__(self) -> None:
        coerce_choices("kernels", self)


def validate_compile(k: KernelsConfig, recompute: str, attention: str) -> None:
    require(not (k.compile and recompute == "selective"),
            "kernels.compile (true) and parallel.recompute (selective) do not compose: "
            "megatron's checkpoint of core attention saves and restores the RNG state inside "
            "the block, which breaks its graph; use parallel.recompute full or none")
    # megatron's DotProductAttention forks the RNG tracker around its dropout (a state saved
    # and restored) and reads a tensor's value on the host: several breaks in every block.
    require(not (k.compile and attention == "local"),
            "kernels.compile (true) and model.attention_backend (local) do not compose: "
            "megatron's DotProductAttention forks the RNG tracker for its dropout and reads a "
            "value on the host, which break every block's graph; use model.attention_backend "
            "sdpa (or auto), or kernels.compile false")
    if k.cuda_graphs:
        require(k.compile, "kernels.cuda_graphs (true) needs kernels.compile true: the graphs "
                "are captured around the compiled blocks")
        require(k.compile_backend is CompileBackend.INDUCTOR,
                f"kernels.cuda_graphs (true) needs kernels.compile_backend inductor, not "
                f"{k.compile_backend}")
