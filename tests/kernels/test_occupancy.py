"""``kernels.occupancy``: programs resident per SM by the hardware's allocation rules (checked by
hand), the register cap that fits two programs and when it is taken, the backward grid that
follows (one wave, 16 rows a program at least), the numbers a compiled kernel and a device's
properties give (stand-in objects: no GPU here), and the interpreter's few programs."""

import contextlib
from types import SimpleNamespace

import pytest
import torch

from kernels import occupancy
from kernels.occupancy import (
    Fit,
    Launch,
    Resources,
    arch_limits,
    backward_programs,
    compiled_resources,
    fit,
    launch_programs,
    programs_per_sm,
    register_cap,
    resident_programs,
)

# An H100 SXM as torch describes it: 132 SMs, 64K registers, 2,048 threads and 228 KiB of
# shared memory per SM.
H100 = SimpleNamespace(major=9, minor=0, multi_processor_count=132,
                       regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048,
                       warp_size=32, shared_memory_per_multiprocessor=228 * 1024)


def compiled(registers: int, warps: int, shared: int = 0, spills: int = 0) -> SimpleNamespace:
    """What occupancy reads of a Triton CompiledKernel once its handles are initialised."""
    return SimpleNamespace(n_regs=registers, n_spills=spills,
                           metadata=SimpleNamespace(num_warps=warps, shared=shared))


@pytest.mark.parametrize("registers,warps,shared,arch,expected", [
    # 128 x 32 = 4,096 registers a warp: 16 warps of the 64K file, two 8-warp programs
    (128, 8, 0, 90, 2),
    # 177 rounds to 184 a thread, 5,888 a warp: 11 warps, one 8-warp program
    (177, 8, 0, 90, 1),
    # 31 rounds to 32: 64 warps by registers, 8 programs of 8 warps (the warp limit too)
    (31, 8, 0, 90, 8),
    # 16 registers, 1 warp: 128 warps by registers, 64 by the warp limit, 32 programs at most
    (16, 1, 0, 90, 32),
    # 100 KiB of shared memory (+1 KiB reserved) a program: 2 of an H100's 228 KiB, 1 of 164
    (32, 1, 100 * 1024, 90, 2),
    (32, 1, 100 * 1024, 80, 1),
])
def test_programs_per_sm_by_hand(registers, warps, shared, arch, expected):
    assert programs_per_sm(Resources(registers, 0, shared), warps, arch) == expected


@pytest.mark.parametrize("n_rows,sms,resident,expected", [
    # one wave: 1M rows would allow 62,500 programs of 16 rows; 132 SMs x 2 hold 264
    (1_000_000, 132, 2, 264),
    # 16,384 rows (a 1.3B micro-batch) of a one-program-per-SM kernel: 132 (1,024 by rows)
    (16_384, 132, 1, 132),
    # the 16-row floor: 100 rows give 7 programs (6 of 16 rows, one of 4), not 264
    (100, 132, 2, 7),
    # 17 rows: 2 programs; 16 rows: 1
    (17, 132, 8, 2),
    (16, 132, 8, 1),
    # at least one: no rows, and a kernel that fits no SM (its launch fails anyway)
    (0, 132, 2, 1),
    (1_000, 132, 0, 1),
])
def test_backward_programs_by_hand(n_rows, sms, resident, expected):
    assert backward_programs(n_rows, sms, resident) == expected




@pytest.mark.parametrize("warps,registers,expected", [
    # two 8-warp programs share 64K registers: 4,096 a warp, 128 a thread
    (8, 65536, 128),
    # two of 16 warps: 64; two of 6: 5,461 a warp, 5,376 in units of 256, 168 a thread
    (16, 65536, 64),
    (6, 65536, 168),
    # two of 4 warps could take 256 a thread: 255, the most a thread addresses
    (4, 65536, 255),
    # half the register file: two 8-warp programs at 64
    (8, 32768, 64),
])
def test_register_cap_by_hand(warps, registers, expected):
    assert register_cap(warps, arch_limits(90)._replace(registers=registers)) == expected


def _capped(registers: int, local: int = 0):
    """A capped compile that gives ``registers`` (and ``local`` bytes of spills), recording the
    caps asked."""
    asked = []

    def compile_capped(cap):
        asked.append(cap)
        return Resources(registers, local, 0)
    return compile_capped, asked


@pytest.mark.parametrize("chosen,capped,spills,expected,asked", [
    # the LayerNorm entry backward at hidden 2048: 166 registers (1 per SM) as ptxas chooses,
    # 128 without a spill when capped: capped, 2 per SM
    (166, 128, 0, Fit(2, 128), [128]),
    # the capped compile spills (the MLP entry computing u with LayerNorm's bias): as chosen
    (170, 128, 100, Fit(1, None), [128]),
    # already two per SM: never recompiled
    (98, None, 0, Fit(2, None), []),
    # a cap that gains nothing (its compile still takes more than 128): as chosen
    (200, 136, 0, Fit(1, None), [128]),
])
def test_fit_caps_registers_only_where_two_programs_fit_without_a_spill(
        chosen, capped, spills, expected, asked):
    compile_capped, seen = _capped(capped or 0, spills)
    assert fit(Resources(chosen, 0, 0), compile_capped, 8, arch_limits(90)) == expected
    assert seen == asked


class _Kernel:
    """A @triton.jit function's warmup: a compiled kernel of ``registers`` registers, or
    ``capped`` (and ``spills``) when compiled with a register cap; records each compile."""

    def __init__(self, registers: int, capped: int | None = None, spills: int = 0,
                 shared: int = 0):
        self.registers, self.capped, self.spills, self.shared = registers, capped, spills, shared
        self.warmups = []

    def warmup(self, *args, grid, **kwargs):
        self.warmups.append((args, grid, kwargs))
        if "maxnreg" in kwargs:
            kernel = compiled(self.capped or self.registers, kwargs["num_warps"], self.shared,
                              self.spills)
        else:
            kernel = compiled(self.registers, kwargs["num_warps"], self.shared)
        kernel._init_handles = lambda: None
        return kernel


def _on_device(monkeypatch, props):
    """torch.cuda as on one GPU that torch describes with ``props``."""
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    occupancy.sm_count.cache_clear()


@pytest.fixture
def fake_h100(monkeypatch):
    """torch.cuda as on one H100, for code that only asks it for properties and devices."""
    _on_device(monkeypatch, H100)
    yield
    occupancy.sm_count.cache_clear()


@pytest.mark.parametrize("kernel,props,expected", [
    # 128 x 32 = 4,096 registers a warp, 32,768 a program of 8 warps: 2 in 64K
    (compiled(128, 8), H100, 2),
    # 255 rounds to 256: 8,192 a warp, 65,536 a program of 8 warps: 1
    (compiled(255, 8), H100, 1),
    # 32 registers, 4 warps: 16 programs by registers and by 64 warps; 100 KiB of shared memory
    # (+1 KiB reserved) a program: 228 KiB hold 2
    (compiled(32, 4, 100 * 1024), H100, 2),
    # the device's own register file: half an H100's holds one 8-warp program of 128 registers
    (compiled(128, 8), SimpleNamespace(**{**vars(H100), "regs_per_multiprocessor": 32768}), 1),
    # the device's own shared memory: 164 KiB hold one program of 100 KiB + 1 KiB (228: 2)
    (compiled(32, 1, 100 * 1024),
     SimpleNamespace(**{**vars(H100), "shared_memory_per_multiprocessor": 164 * 1024}), 1),
    # the device's own thread limit: 1,536 threads (48 warps) hold 12 programs of 4 warps,
    # where registers (32 x 32 x 4 = 4,096 a program) would allow 16
    (compiled(32, 4), SimpleNamespace(**{**vars(H100), "max_threads_per_multi_processor": 1536}),
     12),
    # properties torch does not expose: the architecture's table (an A100's 164 KiB hold one
    # program of 100 KiB + 1 KiB, 228 KiB would hold 2)
    (compiled(32, 1, 100 * 1024), SimpleNamespace(major=8, minor=0), 1),
    # an architecture outside the table: 16 programs at most, where 64 warps of 1 would be 64
    (compiled(16, 1), SimpleNamespace(major=12, minor=0), 16),
    # a device that reports a register file too small for one program (16 x 32 x 128 = 64K
    # registers needed, 32K reported): still one program per SM, not a grid of one program
    (compiled(128, 16), SimpleNamespace(**{**vars(H100), "regs_per_multiprocessor": 32768}), 1),
])
def test_compiled_kernel_on_a_device(kernel, props, expected, monkeypatch):
    """The registers, shared memory and warps the compiled kernel reports, on the device's own
    limits (the capped compile here gains nothing, so the compiler's choice stands)."""
    _on_device(monkeypatch, props)
    fake = _Kernel(kernel.n_regs, shared=kernel.metadata.shared)
    warps = kernel.metadata.num_warps
    found = resident_programs(fake, (), {"num_warps": warps}, torch.device("cuda", 0))
    assert found.resident == expected
    occupancy.sm_count.cache_clear()


def test_a_compiled_kernels_local_memory_is_in_bytes():
    """Triton's ``n_spills`` is the driver's local memory a thread divided by 4 (spilled 32-bit
    registers): 25 of them are 100 bytes, as a cubin's frame and ``bench.kernel_resources``
    count them."""
    assert compiled_resources(compiled(128, 8, 1024, spills=25)) == Resources(128, 100, 1024)


@pytest.mark.parametrize("n_rows,expected", [(5, 4), (1_000, 4), (3, 3), (1, 1), (0, 1)])
def test_interpreter_runs_a_few_programs(n_rows, expected):
    """Without CUDA, up to 4 programs (one per row at most), whatever the kernel: it is not
    compiled (None here), and takes no register cap."""
    assert launch_programs(None, n_rows, torch.device("cpu"), (), {}) == Launch(expected, {})


def test_cuda_launch_is_one_wave_of_its_compiled_kernel(fake_h100):
    """16,384 rows of a kernel compiled to 128 registers x 8 warps (2 per SM): 264 programs,
    compiled once per distinct launch (same argument types and constexprs: no new compile)."""
    kernel = _Kernel(128)
    rows = torch.empty(4, 8)
    kwargs = {"IS_RMS": True, "ROWS": 1, "num_warps": 8}
    cuda = torch.device("cuda", 0)
    assert launch_programs(kernel, 16_384, cuda, (rows, 8, 16), kwargs) == Launch(264, {})
    assert kernel.warmups == [((rows, 8, 16), (1,), kwargs)]
    assert launch_programs(kernel, 4_096, cuda, (torch.empty(2, 8), 8, 16), kwargs).programs == 256
    assert len(kernel.warmups) == 1
    # another dtype, another flag: each its own compile
    launch_programs(kernel, 16_384, cuda, (rows.double(), 8, 16), kwargs)
    launch_programs(kernel, 16_384, cuda, (rows, 8, 16), {**kwargs, "IS_RMS": False})
    assert len(kernel.warmups) == 3
    # no rows: nothing launches, nothing compiles
    idle = _Kernel(255)
    assert launch_programs(idle, 0, cuda, (rows, 8, 16), kwargs) == Launch(1, {})
    assert idle.warmups == []


def test_cuda_launch_takes_the_register_cap_that_fits_two_programs(fake_h100):
    """A kernel the compiler gives 166 registers (1 per SM) and that fits 128 without a spill
    launches capped: 264 programs, ``maxnreg=128``; compiled twice, once. One whose capped
    compile spills launches as the compiler chose, 132 programs."""
    cuda, rows = torch.device("cuda", 0), torch.empty(4, 8)
    kwargs = {"ROWS": 1, "num_warps": 8}
    kernel = _Kernel(166, capped=128)
    assert launch_programs(kernel, 16_384, cuda, (rows,), kwargs) == Launch(264, {"maxnreg": 128})
    assert [w[2] for w in kernel.warmups] == [kwargs, {**kwargs, "maxnreg": 128}]
    launch_programs(kernel, 16_384, cuda, (rows,), kwargs)
    assert len(kernel.warmups) == 2
    spilling = _Kernel(170, capped=128, spills=100)
    assert launch_programs(spilling, 16_384, cuda, (rows,), kwargs) == Launch(132, {})
