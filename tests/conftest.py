import os
import signal

import pytest
import torch

# Triton decides per kernel, when its @triton.jit decorator runs (i.e. when the module defining
# the kernel is imported), whether it compiles the kernel or runs it in its CPU interpreter, by
# reading TRITON_INTERPRET at that moment. Importing triton itself (megatron does, at import) is
# harmless; what matters is that the variable is set before any test imports a kernel module.
# This file is loaded before every test module, so setting it here holds whatever order tests
# run in. Without CUDA the interpreter is the only way a Triton kernel can run at all, so this
# changes nothing else; with CUDA the kernels stay compiled and the GPU tests time real code.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from model.config import ParallelConfig
from runtime import cpu_compat, parallel
from runtime import device as compute
from tests import scheduling, tiers
from tests.pretrain_fixtures import cli, make_corpus, train_args

tiers.install()


def _share_the_cores() -> None:
    """Under pytest-xdist, each worker computes on its share of the cores, and so does every
    process it starts (OMP_NUM_THREADS, unless set already). torch's default, a thread per
    core in every worker, puts two workers' threads on each core of the 2-core machine, where
    OpenMP's threads spin while they wait for each other (the parity test's MoE references:
    109 s so, 4.5 s on one thread, tests/helpers.one_thread)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers <= 1:
        return
    threads = max(1, (os.cpu_count() or 1) // workers)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


_share_the_cores()


def _ctrl_c_as_in_a_terminal() -> None:
    """A suite started in the background by a shell without job control (``make test &``
    in a script, nohup) inherits SIGINT ignored, and so would every process it starts: the
    tests that press Ctrl-C on a fresh interpreter then saw it finish with 0 instead of 130.
    Python's own handler here is reset to the default in each child, as a terminal's is."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


_ctrl_c_as_in_a_terminal()


def _rewrite_interpreted_kernels() -> None:
    """Have Triton's interpreter parse and rewrite every kernel now, once, while this process
    has a single thread. It does so lazily, with ast.parse, on a kernel's first launch, and
    CPython 3.11 keeps ast.parse's recursion counter per interpreter, not per thread: a parse
    that overlaps another thread's fails (seen once, late in the full suite) with "SystemError: AST
    constructor recursion depth mismatch". The rewritten kernels are cached by Triton."""
    from kernels import triton_kernels

    for value in list(vars(triton_kernels).values()):
        if callable(getattr(value, "rewrite", None)):
            value.rewrite()


if os.environ.get("TRITON_INTERPRET") == "1":
    _rewrite_interpreted_kernels()


def _list_fonts() -> None:
    """Have matplotlib list the system's fonts now, before any test runs. It does so once per
    machine, running ``fc-list``, when its font manager is first imported, and caches the list
    in the home folder (MPLCONFIGDIR or ~/.cache/matplotlib). On a machine that never drew a
    figure (a fresh CI machine's empty home folder) the first figure would start that process
    inside a fast-tier test, which the tier check fails; outside a test it is allowed."""
    import matplotlib.font_manager  # noqa: F401  (importing it builds the cache)


_list_fonts()


@pytest.fixture(scope="session", autouse=True)
def exact_fp32_matmuls():
    """fp32 means fp32: tests compare against float64 transcriptions of the equations with
    fp32 tolerances, which TF32 matrix products (10-bit mantissa) would not meet on a GPU."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


@pytest.fixture(scope="session", autouse=True)
def megatron_on_cpu():
    """The test session is an entry point: on a machine without CUDA it runs inside the CPU
    compatibility layer, as `python -m pretrain` does (spawned ranks enter their own)."""
    with cpu_compat.enabled():
        yield


@pytest.fixture(scope="session")
def device() -> torch.device:
    """The device in-process tests compute on: this process's GPU with CUDA, else the CPU
    (runtime.device decides, as in training). Models built by megatron land there; a test puts
    its inputs there too."""
    return compute.select()


@pytest.fixture(scope="session")
def single_rank(device):
    """megatron's parallel state for one process (TP = PP = 1), shared by in-process tests:
    NCCL on the GPU with CUDA, gloo on the CPU without."""
    parallel.initialize(ParallelConfig(), seed=1234)
    yield
    parallel.destroy()


@pytest.fixture(scope="session")
def data(tmp_path_factory):
    """The real-text corpus, tokenizer and dataset of the CLI tests (tests/pretrain_fixtures),
    made once per session; tests only read it."""
    return make_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="session")
def trained_run(data, tmp_path_factory):
    """A tiny siamese run trained for 6 steps through the CLI, made once per session for the
    tests that only read its checkpoint (generate, lm-eval, export refusals)."""
    run = tmp_path_factory.mktemp("trained") / "run"
    cli(*train_args(data, run, "--run.steps=6", "--run.eval_interval=100"))
    return run


MOE_ARGS = ("--model.num_experts=4", "--model.moe_router_score_function=sigmoid",
            "--model.moe_router_enable_expert_bias=true",
            "--model.moe_router_bias_update_rate=0.1",
            "--model.moe_shared_expert_intermediate_size=64", "--model.moe_ffn_hidden_size=64")


@pytest.fixture(scope="session")
def moe_run(data, tmp_path_factory):
    """A tiny siamese run with experts, trained for 3 steps by two ranks that split the
    experts (parallel.ep=2), made once per session for the tests that read an MoE checkpoint
    (export, lm-eval): sigmoid routing with the expert bias (moved by each step's load, by a
    rate large enough to change routes) and a shared expert."""
    run = tmp_path_factory.mktemp("moe") / "run"
    cli(*train_args(data, run, "--run.steps=3", "--run.eval_interval=100", "--parallel.ep=2",
                    *MOE_ARGS), nproc=2)
    return run


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """The markers of the running test, for the tier checks (tests/tiers.py)."""
    tiers.enter(item)
    try:
        return (yield)
    finally:
        tiers.leave()


# Session fixtures that start processes (the CLI): every test using one, directly or through
# another fixture, is slow.
PROCESS_FIXTURES = frozenset({"data", "trained_run", "moe_run"})


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (CUDA not available)")
    for item in items:
        if PROCESS_FIXTURES & set(item.fixturenames) or "cluster" in item.keywords:
            item.add_marker(pytest.mark.slow)
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip)
        if "cluster" in item.keywords and scheduling.unit(item.nodeid) != scheduling.CLUSTER:
            raise pytest.UsageError(
                f"{item.nodeid} is marked cluster but its module is not in "
                f"tests/scheduling.py CLUSTER_MODULES (two clusters at once would contend)")


def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup`` (``make test``): whole modules per worker, heaviest first
    (``tests/scheduling.py``; xdist's own loadgroup does not group under pytest 9.2)."""
    if config.getvalue("dist") == "loadgroup":
        from tests.scheduling import ModuleScheduling

        return ModuleScheduling(config, log)
    return None
