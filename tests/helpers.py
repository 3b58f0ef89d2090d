"""Shared fixtures-in-code for the tests: tiny configs, fixed batches, rank spawning."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from multiprocessing import forkserver

import torch
import torch.multiprocessing as mp

from model.config import ModelConfig
from runtime import cpu_compat, device
from runtime.launcher import free_port
from tests.zygote import stable_environ

SEQ, MBS, VOCAB = 16, 2, 100


def _norm_variants() -> list[str]:
    """Every registered normalization (kernels.normalizations), and "NAME+bias" for one whose
    bias is optional (model.norm_bias): what a registry-wide test runs over."""
    from kernels import normalizations

    found = []
    for kind in normalizations.KINDS.values():
        found.append(kind.name)
        if any(p.optional and p.name == "bias" for p in kind.parameters):
            found.append(f"{kind.name}+bias")
    return found


NORMS = _norm_variants()


def norm_fields(variant: str) -> dict:
    """The model fields of a :data:`NORMS` variant."""
    name, _, bias = variant.partition("+")
    return {"normalization": name, "norm_bias": bias == "bias"}


def tiny_model(scheme: str, **overrides) -> ModelConfig:
    fields = dict(
        residual_scheme=scheme, num_layers=4, hidden_size=32, num_attention_heads=4,
        num_query_groups=2, ffn_hidden_size=64, vocab_size=VOCAB, seq_length=SEQ,
    )
    fields.update(overrides)
    return ModelConfig(**fields)


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch's intra-op threads at 1 inside the block, as every spawned rank computes
    (:func:`_bootstrap`). The tiny models gain nothing from more, and where the cores are busy
    (the suite's two workers on two cores, other jobs) torch's threads wait on each other:
    the parity test's 11 MoE references took 109 s with 2 threads and 4.5 s with 1 under a
    load average of 5 on the 2-core machine (2026-11-28)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def perturb_every_parameter(model, scale: float = 0.3) -> None:
    """Move every parameter of ``model`` off its initial value, whatever its kind: by
    ``scale`` times its own spread, or by ``scale`` where it has none (norm weights, gates,
    scalars, static mixing weights). A parameter left where it starts can hide a wrong
    equation or a wrong layout: a branch scale starting at 0 multiplies away whatever its
    branch reads, a norm weight at 1 hides which norm is applied."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            before = param.detach().clone()
            spread = param.float().std().item() if param.numel() > 1 else 0.0
            for _ in range(8):  # a small draw can round back to a bf16 scalar's own value
                param.add_((scale * (spread or 1.0)) * torch.randn_like(param))
                if not torch.equal(param, before):
                    break
            assert not torch.equal(param, before), name


def batches(count: int, seed: int = 0, seq: int = SEQ, mbs: int = MBS) -> list[dict]:
    """Fixed microbatches of random tokens, identical in every process, on the device this
    process computes on (drawn on the CPU, so the tokens do not depend on the device)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        tokens = torch.randint(0, VOCAB, (mbs, seq + 1), generator=gen)
        tokens = tokens.to(device.compute_device())
        out.append({
            "tokens": tokens[:, :-1].contiguous(),
            "labels": tokens[:, 1:].contiguous(),
            "loss_mask": torch.ones(mbs, seq, device=tokens.device),
            "position_ids": torch.arange(seq, device=tokens.device).unsqueeze(0)
            .expand(mbs, -1).contiguous(),
        })
    return out


EOD = VOCAB - 1


def document_batches(count: int, seed: int = 0, seq: int = SEQ, mbs: int = MBS) -> list[dict]:
    """:func:`batches` of packed documents: EOD (the last id) ends a document every 3-7
    tokens, positions restart after each, and the document ids ride as the attention mask
    (model.documents), as data.document_attention and data.reset_position_ids make them."""
    from model.documents import attention_mask, document_ids

    gen = torch.Generator().manual_seed(seed)
    out = []
    for batch in batches(count, seed, seq, mbs):
        tokens = torch.cat([batch["tokens"], batch["labels"][:, -1:]], dim=1).cpu() % EOD
        for row in tokens:
            at = int(torch.randint(2, 7, (1,), generator=gen))
            while at < len(row):
                row[at] = EOD
                at += int(torch.randint(3, 8, (1,), generator=gen))
        inputs = tokens[:, :-1]
        ids = document_ids(inputs, EOD)
        first = torch.cat([torch.ones_like(ids[:, :1]), ids[:, 1:] != ids[:, :-1]], dim=1)
        index = torch.arange(seq).expand_as(ids)
        starts = torch.cummax(torch.where(first.bool(), index, 0), dim=1).values
        where = batch["tokens"].device
        out.append({**batch, "tokens": inputs.contiguous().to(where),
                    "labels": tokens[:, 1:].contiguous().to(where),
                    "position_ids": (index - starts).to(where),
                    "attention_mask": attention_mask(ids).to(where)})
    return out


def _bootstrap(rank: int, world: int, port: int, fn, args, environ: dict | None) -> None:
    if environ is not None:  # forked from the fork server: the caller's environment now
        os.environ.clear()
        os.environ.update(environ)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
        WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    torch.backends.cuda.matmul.allow_tf32 = False  # as in the test process (conftest.py)
    with cpu_compat.enabled():  # each rank is its own entry point
        fn(*args)


# What makes a child process compute on the CPU whatever this machine has: no visible GPU
# (runtime.device then picks the CPU and gloo) and Triton kernels in its interpreter.
CPU_ONLY_ENV = {"CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1"}


@contextlib.contextmanager
def children_on_cpu() -> Iterator[None]:
    """Processes started inside this block inherit :data:`CPU_ONLY_ENV`."""
    saved = {k: os.environ.get(k) for k in CPU_ONLY_ENV}
    os.environ.update(CPU_ONLY_ENV)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def spawn(world: int, fn, *args, gpu: bool = False) -> None:
    """Run ``fn(*args)`` on ``world`` ranks; raises if any rank fails.

    gloo ranks on the CPU unless ``gpu``, deliberately also on a GPU machine: these tests
    compare a sharded model with an unsharded one, which needs ``world`` devices, and one GPU
    cannot host two NCCL ranks. With ``gpu`` each rank takes its own GPU and NCCL (the
    ``gpu``-marked parity tests, on machines with enough GPUs).

    CPU ranks are forked from multiprocessing's fork server, which has imported torch and
    megatron-core once (tests/preload.py) instead of once per rank. Imports read the
    environment, so the server serves only the environment it started with (test-to-test
    variables aside): a spawn in another one starts a new server with it
    (:func:`_fork_server_for`). On a GPU each rank is a fresh interpreter."""
    with contextlib.nullcontext() if gpu else children_on_cpu():
        environ = dict(os.environ)
        if not gpu:
            _fork_server_for(environ)
        mp.start_processes(_bootstrap, args=(world, free_port(), fn, args,
                                             None if gpu else environ),
                           nprocs=world, join=True, start_method="spawn" if gpu else "forkserver")


_fork_server_environ: dict | None = None


def _fork_server_for(environ: dict) -> None:
    """Have multiprocessing's fork server started with ``environ``: the running one stopped
    if it was started with another. Until 2026-11-28 a spawn in another environment started
    fresh interpreters instead, and a variable set in the test process after the server
    started stays set: torch's compile sets TORCHINDUCTOR_CACHE_DIR in the process on its
    first use, so every later spawn of that pytest worker paid a fresh start per rank (about
    10 s more per two-rank test on the 2-core machine)."""
    global _fork_server_environ
    stable = stable_environ(environ)
    if stable == _fork_server_environ:
        return
    if _fork_server_environ is not None:
        forkserver._forkserver._stop()  # the next start_processes starts it again
    mp.get_context("forkserver").set_forkserver_preload(["tests.preload", "tests.helpers"])
    _fork_server_environ = stable
