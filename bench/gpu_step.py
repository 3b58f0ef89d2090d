"""GPU training-step time, throughput, MFU and activation memory of the residual schemes at
the 1.3B shape, each as a ratio to pre at the same micro-batch.

One GPU, bf16, flash attention (Transformer Engine's when installed, else torch SDPA:
``model.attention_backend = auto``), no recompute unless ``--recomputes`` adds settings. A
*step* is one forward+backward through megatron's schedule plus the AdamW step of megatron's
optimizer, as in training. Both phases are timed on the GPU with CUDA events (one
synchronisation per step, at its end), so the optimizer's share is reported on its own. Each
(scheme, micro-batch, recompute) runs in its own process, because several
1.3B models with optimizer state do not fit on one GPU together and a fresh allocator keeps
the memory figures independent; ``--rounds`` cycles through all of them again and medians are
taken over every round. Activation memory is the peak allocated during forward+backward minus
what was allocated just before it (bf16 weights, fp32 gradient buffers, optimizer state).

    python -m bench.gpu_step [--layers 16 --micro-batches 2,4 --steps 10 --rounds 3]
    python -m bench.gpu_step --unfused-optimizer   # megatron's torch fallback (optim.fused off)
    python -m bench.gpu_step --deterministic      # the cost of run.deterministic
    python -m bench.gpu_step --micro-batches 4,8 --recomputes none,full   # the best setting
    python -m bench.gpu_step --micro-batches 4 --profile 3   # + GPU kernels side by side

If 16 layers do not fit at micro-batch 1, lower ``--layers``. Without CUDA it prints one line;
its worker (one scheme in one process) runs on the CPU too, with wall-clock times and no memory
figures, which is how ``bench.gpu_check`` rehearses it at a tiny size.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from bench import step_profile
from bench.common import Mark, int_list, random_batch, versions_line
from model.schemes import Recompute
from runtime import cpu_compat
from runtime.markdown import markdown_table

SCHEMES = ("pre", "siamese", "siamese_hybrid")
TARGETS = ("targets: pre >= 65k tokens/s and >= 53% MFU; step / pre: siamese <= 1.02, "
           "siamese_hybrid, post, hybridnorm <= 1.03; activation / pre: siamese <= 1.05, "
           "siamese_hybrid <= 1.08; optimizer step <= 12 ms at 1.2B parameters")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # Defaults: the paper presets' 1.3B shape (configs/paper), HybridNorm's 1.2B model.
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8, help="K/V heads (grouped-query attention)")
    p.add_argument("--ffn", type=int, default=8192, help="SwiGLU width")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--micro-batches", type=int_list, default=[2, 4],
                   help="comma-separated micro-batch sizes to sweep")
    p.add_argument("--recomputes", default="none",
                   help="comma-separated parallel.recompute values to sweep (none, selective, "
                        "full): with the micro-batches, the settings the best pre is chosen from")
    p.add_argument("--recompute", default="none", help=argparse.SUPPRESS)  # the worker's
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--steps", type=int, default=10, help="timed steps per scheme and round")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3,
                   help="repeat the scheme cycle; medians are taken over all rounds")
    p.add_argument("--schemes", default=",".join(SCHEMES))
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--documents", type=int, default=0, metavar="TOKENS",
                   help="pack documents of TOKENS tokens on average and attend within them "
                        "(data.document_attention; SDPA: flex attention on CUDA); 0: off")
    p.add_argument("--transformer-impls", default="auto",
                   help="comma-separated model.transformer_impl values to compare side by side "
                        "(e.g. local,te: the TE on/off column)")
    p.add_argument("--transformer-impl", help=argparse.SUPPRESS)  # internal: the worker's
    p.add_argument("--norm-backend", default="auto", help="kernels.norm_backend")
    p.add_argument("--no-optimizer", action="store_true",
                   help="time forward+backward only (no optimizer state, no AdamW step)")
    p.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw",
                   help="optim.name: AdamW, or Muon for the blocks' matrices and AdamW for the "
                        "rest")
    p.add_argument("--unfused-optimizer", action="store_true",
                   help="optim.fused = false: megatron's own torch fallback (no TE/apex)")
    p.add_argument("--micro-batch", type=int, help=argparse.SUPPRESS)  # internal: the worker's
    p.add_argument("--profile", type=int, default=0, metavar="STEPS",
                   help="after the timed steps, profile this many more per setting and print "
                        "the GPU kernels side by side (bench.step_profile)")
    p.add_argument("--deterministic", action="store_true",
                   help="bit-reproducible kernels, as run.deterministic (runtime.device)")
    p.add_argument("--compile", default="none",
                   help="compile each block (kernels.compile) with this torch.compile backend: "
                        "inductor, aot_eager, eager; none: eager blocks")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="with --compile inductor: CUDA graphs around each compiled block "
                        "(kernels.cuda_graphs)")
    p.add_argument("--experts", type=int, default=0,
                   help="mixture of experts: routed experts in every block (model.num_experts; "
                        "0: dense)")
    p.add_argument("--topk", type=int, default=2, help="with --experts: model.moe_router_topk")
    p.add_argument("--expert-ffn", type=int, default=None,
                   help="with --experts: each expert's width (model.moe_ffn_hidden_size; "
                        "default --ffn)")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # internal: measure one scheme
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    allowed = [r.value for r in Recompute]
    for value in args.recomputes.split(","):
        if value not in allowed:
            p.error(f"--recomputes: {value!r} is not one of {', '.join(allowed)}")
    if args.warmup < 1 and not args.no_optimizer:
        p.error("--warmup must be >= 1: the first step allocates the optimizer state")
    return args


def build(args, scheme: str):
    """The model, DDP-wrapped as in training, its optimizer (or None) and the run config."""
    from megatron.core.transformer.module import Float16Module

    from model import decay
    from model.builder import build_model, wrap_ddp
    from model.config import ModelConfig, ParallelConfig
    from pretrain.config import Config, DataConfig, OptimConfig, OptimName
    from pretrain.optim import build_optimizer

    model_cfg = ModelConfig(
        residual_scheme=scheme, num_layers=args.layers, hidden_size=args.hidden,
        num_attention_heads=args.heads, num_query_groups=args.kv_heads,
        ffn_hidden_size=args.ffn, vocab_size=args.vocab, seq_length=args.seq,
        attention_backend=("sdpa" if args.documents and args.attention_backend == "auto"
                           else args.attention_backend),
        transformer_impl=args.transformer_impl,
        **({"num_experts": args.experts, "moe_router_topk": args.topk,
            "moe_ffn_hidden_size": args.expert_ffn} if args.experts else {}),
    )
    config = Config(model=model_cfg, parallel=ParallelConfig(recompute=args.recompute),
                    # a non-zero LR from the first step
                    optim=OptimConfig(name=OptimName(args.optimizer), warmup_steps=0,
                                      fused=not args.unfused_optimizer),
                    data=DataConfig(micro_batch_size=args.micro_batch,
                                    global_batch_size=args.micro_batch))
    torch.manual_seed(0)
    chunks = build_model(model_cfg, config.parallel, torch.bfloat16, args.norm_backend,
                         positions_per_token=bool(args.documents))
    if args.compile != "none":
        from model import compiled

        compiled.compile_blocks(chunks, args.compile, args.cuda_graphs)
    whole = decay.muon_matrix if args.optimizer == "muon" else None  # as pretrain.build
    chunks = wrap_ddp([Float16Module(c.config, c) for c in chunks], config.parallel, whole)
    optimizer = None
    if not args.no_optimizer:
        optimizer, _ = build_optimizer(config, chunks, torch.bfloat16)
    return chunks, optimizer, config


def measure(args, scheme: str) -> dict:
    """Time ``args.steps`` steps after ``args.warmup`` (the first step allocates the optimizer
    state, so the memory baseline is only right after it)."""
    from kernels.backend import resolve
    from model.backends import resolve_attention_backend, resolve_transformer_impl
    from model.builder import count_parameters
    from model.config import ParallelConfig
    from pretrain.report.throughput import Throughput
    from runtime import device, parallel
    from runtime.schedule import forward_backward

    if args.deterministic:
        device.make_deterministic()
    parallel.initialize(ParallelConfig())
    chunks, optimizer, config = build(args, scheme)
    batch = random_batch(args.vocab, args.micro_batch, args.seq, device.compute_device())
    if args.documents:
        from bench.document_attention import packed

        batch = packed(batch, args.seq, args.documents, args.vocab - 1)

    def step(between=None) -> list[torch.Tensor]:
        """One training step; its losses (tensors). ``between`` runs after forward+backward,
        before the optimizer step (the timing event that splits the two)."""
        if optimizer is not None:
            optimizer.zero_grad()
        step_losses = forward_backward(chunks, [batch], 1, args.seq, args.micro_batch)
        if between is not None:
            between()
        if optimizer is not None:
            optimizer.step()
        return step_losses

    cuda = torch.cuda.is_available()  # without it (a rehearsal): no memory figures
    fwd_bwd, optim, activation, peak, losses = [], [], 0, 0, []
    for index in range(args.warmup + args.steps):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() if cuda else 0
        start, middle, end = Mark(), Mark(), Mark()
        start.record()
        losses += step(middle.record)
        end.record()
        fwd_bwd_s, optim_s = middle.seconds_since(start), end.seconds_since(middle)
        step_peak = torch.cuda.max_memory_allocated() if cuda else 0
        if index >= args.warmup:
            fwd_bwd.append(fwd_bwd_s)
            optim.append(optim_s)
            activation = max(activation, step_peak - before)
            peak = max(peak, step_peak)
    losses = [float(loss) for loss in losses]
    if not all(map(math.isfinite, losses)):
        raise RuntimeError(f"{scheme}: non-finite loss {losses}")
    compile_seconds = 0.0
    if args.compile != "none":  # compiled in the warm-up steps
        from model import compiled

        compile_seconds = compiled.compile_seconds()
    profile = step_profile.kernel_times(step, args.profile) if args.profile else None
    parameters = count_parameters(chunks)
    throughput = Throughput(config)
    parallel.destroy()
    return {
        "scheme": scheme, "micro_batch": args.micro_batch, "parameters": parameters,
        "fwd_bwd_s": fwd_bwd, "optimizer_s": optim,
        "step_s": [a + b for a, b in zip(fwd_bwd, optim, strict=True)],
        "activation_bytes": activation, "peak_bytes": peak, "first_loss": losses[0],
        "seq": args.seq,
        "flops_per_step": throughput.flops_per_step, "peak_tflops": throughput.peak,
        "device": device.device_name(),
        "attention": str(resolve_attention_backend(config.model.attention_backend)),
        "linears": str(resolve_transformer_impl(config.model.transformer_impl)),
        "norms": str(resolve(args.norm_backend)), "profile": profile,
        "compile": args.compile, "cuda_graphs": args.cuda_graphs,
        "compile_s": compile_seconds,
    }


def run_worker(scheme: str, micro_batch: int, impl: str, recompute: str,
               forwarded: list[str], timeout: float | None = None) -> dict | None:
    """Measure one scheme at one micro-batch with one linear-layer implementation and one
    recompute setting in a process of its own (stopped after ``timeout`` seconds); None (after
    printing why) if it failed.

    On a GPU the process is a fresh interpreter: a fresh allocator keeps each worker's memory
    figures its own. Without CUDA (the CPU rehearsal, which has no memory figures) it is forked
    from this one once the worker's imports are done (:func:`_forked`): the same ``main``, the
    same arguments, without a start-up that was 4 of each worker's 5 s there."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        argv = [*forwarded, "--worker", scheme, "--micro-batch", str(micro_batch),
                "--transformer-impl", impl, "--recompute", recompute, "--result", str(result)]
        try:
            if torch.cuda.is_available():
                proc = subprocess.run([sys.executable, "-m", "bench.gpu_step", *argv],
                                      cwd=Path(__file__).resolve().parents[1],
                                      capture_output=True, text=True, timeout=timeout)
            else:
                proc = _forked(argv, timeout)
        except subprocess.TimeoutExpired:
            print(f"{scheme} at micro-batch {micro_batch}: stopped after {timeout:.0f} s",
                  file=sys.stderr)
            return None
        if proc.returncode != 0 or not result.is_file():
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
            print(f"{scheme} at micro-batch {micro_batch}, linears {impl}, recompute "
                  f"{recompute}: failed (exit "
                  f"{proc.returncode}); if "
                  f"out of memory, lower --layers or --micro-batches\n{tail}\n",
                  file=sys.stderr)
            return None
        return json.loads(result.read_text())


# What a worker imports (build, measure): imported once before the first fork, not per worker.
_WORKER_MODULES = ("bench.document_attention", "kernels.backend", "model.backends",
                   "model.builder", "model.compiled", "model.config", "pretrain.config",
                   "pretrain.optim", "pretrain.report.throughput", "runtime.device",
                   "runtime.parallel", "runtime.schedule")


def _forked(argv: list[str], timeout: float | None) -> subprocess.CompletedProcess:
    """``main(argv)`` in a child forked from this process, its output in a file; the child
    computes on one thread (an intra-op pool does not survive a fork) and ends without
    teardown. Raises TimeoutExpired after killing it at ``timeout``."""
    for module in _WORKER_MODULES:
        importlib.import_module(module)
    with tempfile.TemporaryFile("w+") as log:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the worker
            code = 1
            try:
                os.dup2(log.fileno(), 1)  # C-level output too
                os.dup2(log.fileno(), 2)
                sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115 - ends with the child
                sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
                torch.set_num_threads(1)
                code = main(argv)
            except BaseException:  # noqa: BLE001 - whatever it was, its traceback is the log
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        deadline = None if timeout is None else time.monotonic() + timeout
        while (status := os.waitpid(pid, os.WNOHANG))[0] == 0:
            if deadline is not None and time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                raise subprocess.TimeoutExpired(argv, timeout)
            time.sleep(0.02)
        log.seek(0)
        return subprocess.CompletedProcess(argv, os.waitstatus_to_exitcode(status[1]),
                                           log.read(), "")


def summarise(r: dict) -> dict:
    """Medians of the timed steps, and the rates derived from the step time."""
    step = statistics.median(r["step_s"])
    tflops = r["flops_per_step"] / step / 1e12
    return {"fwd_bwd": statistics.median(r["fwd_bwd_s"]), "step": step, "tflops": tflops,
            "optimizer": statistics.median(r["optimizer_s"]),
            "tokens": r["micro_batch"] * r["seq"] / step,
            "mfu": tflops / r["peak_tflops"] if r["peak_tflops"] else None,
            "activation": r["activation_bytes"]}


def report(args, results: dict[tuple[str, int, str, str], dict]) -> None:
    """The table, one row per (scheme, micro-batch, linears, recompute), then the best pre
    setting."""
    first = next(iter(results.values()))
    kv = args.kv_heads or args.heads
    step_kind = ("fwd+bwd only" if args.no_optimizer else
                 f"fwd+bwd + {'Muon and AdamW' if args.optimizer == 'muon' else 'AdamW'} step")
    optimizer = ("megatron's torch fallback (optim.fused off)" if args.unfused_optimizer
                 else "optim.fused")
    print(f"device: {first['device']}; {versions_line()}")
    print(f"shape: {args.layers} layers x {args.hidden} hidden, {args.heads} heads / {kv} KV, "
          f"SwiGLU {args.ffn}, seq {args.seq}, vocab {args.vocab}; bf16; attention "
          f"{first['attention']}, norms {first['norms']}; "
          f"optimizer {optimizer}"
          + ("; deterministic kernels (run.deterministic)" if args.deterministic else ""))
    print(f"median of {args.steps} x {args.rounds} steps after {args.warmup} warm-up, one "
          f"process per scheme and micro-batch; step = {step_kind}, GPU time by CUDA events; "
          "tokens/s, TFLOP/s and MFU from the step time; FLOPs/token by Megatron-LM's formula "
          "(pretrain/report/throughput.py); activation = peak allocated in fwd+bwd minus weights, "
          "grads, optimizer state; ratios against pre at the same micro-batch, linears and "
          "recompute")
    print(f"{TARGETS}\n")
    stats = {key: summarise(r) for key, r in results.items()}

    def ratio(key: tuple[str, int, str, str], field: str) -> str:
        base = stats.get(("pre", *key[1:]))
        return f"{stats[key][field] / base[field]:.3f}" if base else "n/a"

    rows = [[
        scheme, str(mb), results[key]["linears"], recompute,
        f"{results[key]['parameters']:,}",
        f"{1e3 * s['fwd_bwd']:.1f}", f"{1e3 * s['optimizer']:.1f}", f"{1e3 * s['step']:.1f}",
        ratio(key, "step"), f"{s['tokens']:,.0f}", f"{s['tflops']:.1f}",
        f"{s['mfu']:.1%}" if s["mfu"] is not None else "n/a",
        f"{s['activation'] / 2**30:.2f}", ratio(key, "activation"),
        f"{results[key]['first_loss']:.3f}",
    ] for key, s in stats.items() for scheme, mb, _, recompute in [key]]
    print(markdown_table(
        ["scheme", "micro-batch", "linears", "recompute", "parameters", "fwd+bwd ms",
         "optimizer ms",
         "step ms", "step / pre", "tokens/s", "TFLOP/s", "MFU", "activation GiB",
         "activation / pre", "first loss"], rows))
    pre = {key[1:]: s for key, s in stats.items() if key[0] == "pre"}
    if pre:
        best = max(pre, key=lambda k: pre[k]["tokens"])
        mb, _, recompute = best
        linears = results[("pre", *best)]["linears"]
        print(f"\nbest pre setting: micro-batch {mb}, linears {linears}, recompute {recompute} "
              f"({pre[best]['tokens']:,.0f} tokens/s)")
    settings = sorted({key[1:] for key, r in results.items() if r.get("profile")})
    for setting in settings:
        profiles = {key[0]: r["profile"] for key, r in results.items()
                    if key[1:] == setting and r.get("profile")}
        mb, impl, recompute = setting
        print(f"\nGPU kernels per step (torch.profiler, {args.profile} steps), micro-batch {mb}, "
              f"linears {impl}, recompute {recompute}:\n")
        print(step_profile.difference_table(profiles))


def _exit_now() -> None:
    """End a worker process once its result is written, without the interpreter's teardown
    of torch and megatron's modules (1.4 s of a 5.8 s worker on the CPU; a check starts 17
    workers), as multiprocessing ends its children; the driver releases the GPU either way."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        with cpu_compat.enabled():  # inert with CUDA; megatron on the CPU in a rehearsal
            Path(args.result).write_text(json.dumps(measure(args, args.worker)))
        if argv is None:  # a worker process: its result is all it leaves
            _exit_now()
        return 0
    if not torch.cuda.is_available():
        print("bench.gpu_step: no CUDA GPU on this machine; nothing measured")
        return 0
    forwarded = list(argv if argv is not None else sys.argv[1:])
    results: dict[tuple[str, int, str, str], dict] = {}
    failed = False
    settings = [(mb, impl, recompute) for mb in args.micro_batches
                for impl in args.transformer_impls.split(",")
                for recompute in args.recomputes.split(",")]
    for _ in range(args.rounds):
        for micro_batch, impl, recompute in settings:
            for scheme in args.schemes.split(","):
                r = run_worker(scheme, micro_batch, impl, recompute, forwarded)
                if r is None:
                    failed = True
                    continue
                key = (scheme, micro_batch, impl, recompute)
                if key in results:  # another round: pool the samples
                    for field in ("fwd_bwd_s", "optimizer_s", "step_s"):
                        results[key][field] += r[field]
                    results[key]["activation_bytes"] = max(
                        results[key]["activation_bytes"], r["activation_bytes"])
                else:
                    results[key] = r
    if results:
        report(args, results)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
