"""Start-up of the data path at the size of a real corpus, and the loader's throughput.

    python -m bench.data_startup --folder /scratch/bench-data --sizes 0.01,0.1,1

Makes synthetic Megatron datasets (random token ids, documents of 64-4,095 tokens) of each
size in billions of tokens, as uint16 and int32, one prefix and a 100-prefix blend, in
``--folder`` (outside the repository: 1B tokens is 2 GB as uint16, 4 GB as int32), then times
each start in a process of its own, as a training start runs it:

- first: no dataset record, no index cache, page cache dropped (a corpus made elsewhere met
  for the first time; every start paid its check column before dataset records existed);
- cold: record and index cache built, page cache dropped (a requeue on another node);
- warm: the same, page cache warm;
- resume: warm, at the middle of the run (the sample-index cache a resume reads).

Columns: the imports (torch and megatron: the same at any corpus size, and slow with a cold
page cache), the config load, the data checks (``check_data``), megatron's index building or
cache load (``build_datasets``), the first micro-batch, and the sum of the last four (the data
start). The blend's warm start
also reads ``--batches`` more micro-batches of one 4,096-token sequence each: the loader's
sequences per second on this CPU (a node of 8 GPUs at 65k tokens/s each reads ~130).
With ``--overlap-steps N`` each blend is then read for N steps twice more, the page cache
dropped before each pass and each pass on samples of its own, with a stand-in for the step's
device time (``--compute-ms``, a sleep: the host waits on a GPU without holding the GIL):
once reading each step's micro-batches in the step, once reading them one step ahead with the
trainer's ``Prefetcher``. The difference is the read time the trainer's read-ahead hides.
Dropping the page cache needs root (``/proc/sys/vm/drop_caches``); without it the cold modes
are skipped. The run reads one epoch: steps x 64 sequences x 4,096 tokens ~ the corpus.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from bench.common import versions_line
from runtime.markdown import markdown_table

SEQ_LENGTH = 4096
GLOBAL_BATCH = 64
BLEND = 100
VOCAB = {"uint16": 32_000, "int32": 100_000}
DTYPE_CODE = {"uint16": 8, "int32": 4}  # megatron's DType codes
BLOCK_TOKENS = 1 << 24  # a random block, written over and over: fast to make, still random ids
INDEX_MAGIC = b"MMIDIDX\x00\x00"


def _write_dataset(prefix: Path, tokens: int, dtype: str, seed: int) -> None:
    """A Megatron indexed dataset (one sequence per document) of ``tokens`` random ids."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(64, 4096, tokens // 64 + 1, dtype=np.int64)
    ends = np.cumsum(lengths)
    count = int(np.searchsorted(ends, tokens)) + 1
    lengths = lengths[:count]
    lengths[-1] -= int(ends[count - 1]) - tokens
    if lengths[-1] <= 0:
        lengths = lengths[:-1]
        lengths[-1] += tokens - int(lengths.sum())
    block = rng.integers(0, VOCAB[dtype], BLOCK_TOKENS).astype(dtype)
    with open(f"{prefix}.bin", "wb") as f:
        for start in range(0, tokens, BLOCK_TOKENS):
            f.write(block[:min(BLOCK_TOKENS, tokens - start)].tobytes())
    itemsize = np.dtype(dtype).itemsize
    pointers = np.concatenate([[0], np.cumsum(lengths[:-1])]) * itemsize
    with open(f"{prefix}.idx", "wb") as f:
        f.write(INDEX_MAGIC)
        f.write(np.array([1], "<u8").tobytes() + bytes([DTYPE_CODE[dtype]]))
        f.write(np.array([len(lengths), len(lengths) + 1], "<u8").tobytes())
        f.write(lengths.astype("<i4").tobytes())
        f.write(pointers.astype("<i8").tobytes())
        f.write(np.arange(len(lengths) + 1, dtype="<i8").tobytes())


def make_datasets(folder: Path, billions: float, dtype: str, prefixes: int) -> list[str]:
    name = f"{billions:g}B-{dtype}-{prefixes}"
    made = [folder / name / f"part{i:03d}" for i in range(prefixes)]
    if not all(Path(f"{p}.idx").exists() for p in made):
        (folder / name).mkdir(parents=True, exist_ok=True)
        for i, prefix in enumerate(made):
            _write_dataset(prefix, int(billions * 1e9) // prefixes, dtype, seed=i)
    return [str(p) for p in made]


def drop_page_cache() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


class StubTokenizer:
    """What the data path reads of a tokenizer, for ids made without one (its encoding
    gives back any text: the start's round-trip check passes)."""

    def __init__(self, vocab_size: int):
        self.path, self.vocab_size, self.eod, self.pad = "synthetic", vocab_size, 0, -1
        self.unique_identifiers = {"class": "synthetic", "model_sha256": f"{vocab_size:064d}"}

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode()


def worker(spec: dict) -> dict:
    """One start, timed phase by phase (run in a process of its own)."""
    began = time.perf_counter()
    from model.config import ParallelConfig
    from pretrain.config import load_config
    from pretrain.data.batches import build_datasets, step_microbatches
    from pretrain.data.checks import check_data
    from pretrain.data.position import DataPosition
    from runtime import cpu_compat, parallel

    marks = {"imports": time.perf_counter() - began}
    tokens = spec["tokens"]
    steps = max(2, tokens // (GLOBAL_BATCH * SEQ_LENGTH))
    clock = time.perf_counter()
    config = load_config(str(Path("configs/demo-cpu.toml")), [
        f"--data.prefixes={','.join(spec['prefixes'])}", "--data.tokenizer=synthetic.model",
        f"--model.vocab_size={VOCAB[spec['dtype']]}", f"--model.seq_length={SEQ_LENGTH}",
        f"--data.global_batch_size={GLOBAL_BATCH}", "--data.micro_batch_size=1",
        "--data.valid_samples=64", "--data.split=80,20,0", f"--run.steps={steps}",
        f"--run.dir={spec['run_dir']}", f"--data.cache_dir={spec['cache']}",
        "--logging.wandb_mode=disabled"])
    marks["config"] = time.perf_counter() - clock
    tokenizer = StubTokenizer(VOCAB[spec["dtype"]])
    clock = time.perf_counter()
    check_data(config, tokenizer)
    marks["checks"] = time.perf_counter() - clock
    step = steps // 2 if spec["resume"] else 0
    position = DataPosition(step, step * GLOBAL_BATCH, step * GLOBAL_BATCH * SEQ_LENGTH)
    with cpu_compat.enabled():
        parallel.initialize(ParallelConfig(), seed=1)
        clock = time.perf_counter()
        train, _ = build_datasets(config, tokenizer, position)
        marks["index"] = time.perf_counter() - clock
        clock = time.perf_counter()
        batches = step_microbatches(train, position.samples, GLOBAL_BATCH, 1)
        next(batches)
        marks["first_batch"] = time.perf_counter() - clock
        if spec["batches"]:
            clock = time.perf_counter()
            read = 0
            start = position.samples + GLOBAL_BATCH
            while read < spec["batches"]:
                for _ in step_microbatches(train, start, GLOBAL_BATCH, 1):
                    read += 1
                start += GLOBAL_BATCH
            marks["sequences_per_s"] = read / (time.perf_counter() - clock)
        if spec.get("overlap_steps"):
            past_read = position.samples + GLOBAL_BATCH * 2 + spec["batches"]  # unread samples
            marks.update(overlap(train, spec["overlap_steps"], spec["compute_ms"] / 1e3,
                                 first_step=past_read // GLOBAL_BATCH + 1))
        parallel.destroy()
    marks["start"] = sum(marks[k] for k in ("config", "checks", "index", "first_batch"))
    return marks


def overlap(train, steps: int, compute_s: float, first_step: int) -> dict:
    """Seconds per step reading in the step and reading one step ahead, each pass from a
    dropped page cache and on samples no pass read before; the clock starts after one step
    (the first step has nothing read ahead in either pass)."""
    from pretrain.data.batches import step_microbatches
    from pretrain.data.prefetch import Prefetcher

    def read(start: int) -> list[dict]:
        return list(step_microbatches(train, start, GLOBAL_BATCH, 1))

    def one_pass(first: int, ahead: bool) -> float:
        drop_page_cache()
        prefetch = Prefetcher(read) if ahead else None
        for k in range(steps + 1):
            if k == 1:
                clock = time.perf_counter()
            start = (first + k) * GLOBAL_BATCH
            if prefetch is None:
                read(start)
            else:
                prefetch.take(start)
                prefetch.ahead(start + GLOBAL_BATCH)
            time.sleep(compute_s)  # the step's device time
        seconds = (time.perf_counter() - clock) / steps
        if prefetch is not None:
            prefetch.close()
        return seconds

    return {"in_step_s": one_pass(first_step, False),
            "ahead_s": one_pass(first_step + steps + 2, True)}


def _run_worker(spec: dict) -> dict:
    result = subprocess.run([sys.executable, "-m", "bench.data_startup", "--worker",
                             json.dumps(spec)], capture_output=True, text=True, check=False)
    if result.returncode:
        raise SystemExit(f"worker failed: {result.stderr.strip().splitlines()[-1]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def bench_dataset(folder: Path, billions: float, dtype: str, prefixes: int,
                  batches: int, can_drop: bool, overlap_steps: int = 0,
                  compute_ms: float = 0.0) -> list[tuple[str, dict]]:
    made = make_datasets(folder, billions, dtype, prefixes)
    cache = folder / "cache" / f"{billions:g}B-{dtype}-{prefixes}"
    shutil.rmtree(cache, ignore_errors=True)
    for prefix in made:
        Path(prefix + ".record.json").unlink(missing_ok=True)
    spec = {"prefixes": made, "dtype": dtype, "tokens": int(billions * 1e9), "cache": str(cache),
            "run_dir": str(folder / "run"), "resume": False, "batches": 0}
    rows = []
    for mode in ("first", "cold", "warm", "resume"):
        if mode in ("first", "cold"):
            if not can_drop:
                continue
            drop_page_cache()
        blend_warm = mode == "warm" and prefixes > 1
        timing = _run_worker({**spec, "resume": mode == "resume",
                              "batches": batches if blend_warm else 0,
                              "overlap_steps": overlap_steps if blend_warm and can_drop else 0,
                              "compute_ms": compute_ms})
        rows.append((mode, timing))
    return rows


def _overlap_cells(t: dict, compute_s: float) -> list[str]:
    read, exposed = t["in_step_s"] - compute_s, max(0.0, t["ahead_s"] - compute_s)
    hidden = f"{1 - exposed / read:.0%}" if read > 0 else ""
    return [f"{t['in_step_s']:.3f}", f"{t['ahead_s']:.3f}", f"{read:.3f}", f"{exposed:.3f}",
            hidden]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--folder", help="where the synthetic datasets go (GBs; not the repository)")
    p.add_argument("--sizes", default="0.01,0.1,1", help="billions of tokens, comma-separated")
    p.add_argument("--dtypes", default="uint16,int32")
    p.add_argument("--batches", type=int, default=2000,
                   help="micro-batches the blend's warm start reads for the throughput")
    p.add_argument("--keep", action="store_true", help="keep the datasets afterwards")
    p.add_argument("--overlap-steps", type=int, default=0,
                   help="steps each blend is read in the step and read ahead (0: not timed)")
    p.add_argument("--compute-ms", type=float, default=500.0,
                   help="the stand-in device time of a step, for --overlap-steps")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    if not args.folder:
        p.error("--folder is required")
    folder = Path(args.folder)
    can_drop = drop_page_cache()
    print(f"# data start-up: {os.cpu_count()} CPUs; {versions_line()}; page cache "
          f"{'dropped for first/cold' if can_drop else 'not droppable (no root): warm only'}")
    print("| tokens | dtype | prefixes | start | imports s | config s | checks s | index s "
          "| first batch s | data start s | sequences/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    overlaps: list[list[str]] = []
    try:
        for billions in (float(s) for s in args.sizes.split(",")):
            for dtype in args.dtypes.split(","):
                for prefixes in (1, BLEND):
                    for mode, t in bench_dataset(folder, billions, dtype, prefixes,
                                                 args.batches, can_drop, args.overlap_steps,
                                                 args.compute_ms):
                        if "ahead_s" in t:
                            overlaps.append([f"{billions:g}B", dtype, str(prefixes)]
                                            + _overlap_cells(t, args.compute_ms / 1e3))
                        rate = f"{t['sequences_per_s']:.0f}" if "sequences_per_s" in t else ""
                        print(f"| {billions:g}B | {dtype} | {prefixes} | {mode} | "
                              f"{t['imports']:.1f} | {t['config']:.2f} | "
                              f"{t['checks']:.2f} | {t['index']:.2f} | "
                              f"{t['first_batch']:.3f} | {t['start']:.2f} | {rate} |",
                              flush=True)
        if overlaps:
            print(f"\n# read in the step vs read one step ahead, {args.overlap_steps} steps of "
                  f"{GLOBAL_BATCH} x {SEQ_LENGTH} tokens from a dropped page cache, "
                  f"{args.compute_ms:g} ms of stand-in device time per step")
            print(markdown_table(["tokens", "dtype", "prefixes", "step s, read in step",
                                  "step s, read ahead", "read s in step", "read s not hidden",
                                  "hidden"], overlaps, right_from=3))
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
