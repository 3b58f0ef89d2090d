"""Data preparation throughput: tokens per second for a sentencepiece and a Hugging Face
tokenizer, with worker processes, with shards run as separate processes, and against
Megatron-LM's own ``tools/preprocess_data.py``.

    python -m bench.prepare_throughput --folder /scratch/prep --megabytes 40 --workers 1,2 \
        --shards 2 [--megatron-lm /src/Megatron-LM]

The corpus is Python's own documentation topics (always installed) repeated to ``--megabytes``
of JSON lines in four files; both tokenizers are 8,192-piece BPEs trained on it here
(sentencepiece through ``train-tokenizer``'s code, byte-level BPE through the ``tokenizers``
library). Rows, each timed end to end (reading, tokenising, writing the .bin/.idx and the
record):

- ``workers N``: one ``prepare-data`` process with N tokenising workers (one writer);
- ``shards N``: N shard preparations (``prepare-data --shard k``'s code) in processes of
  their own at once, as a slurm array runs them, then the merge: the writing is split too;
- ``Megatron-LM, workers N`` (with ``--megatron-lm``, a Megatron-LM source tree; sentencepiece
  only): its ``tools/preprocess_data.py --append-eod`` on the same files joined into one,
  whose output must be byte-identical to ours (checked; a difference stops the benchmark),
  timed without its process's imports (the time of its ``main()``).
"""

from __future__ import annotations

import argparse
import filecmp
import functools
import json
import multiprocessing
import os
import pydoc_data.topics
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.common import int_list, package_version
from pretrain.data.prepare import prepare_data
from pretrain.data.shards import prepare_shard, prepare_sharded
from pretrain.data.tokenizer import train_tokenizer
from runtime.markdown import markdown_table

VOCAB = 8192
FILES = 4

# Runs Megatron-LM's tool (its path and arguments follow) and prints the seconds its main()
# took, without the imports our rows do not pay either. Its training package imports
# typing.override (Python 3.12); on 3.11 typing_extensions' copy is put in its place.
MEGATRON_TOOL = """
import importlib.util, sys, time, typing, typing_extensions
typing.override = getattr(typing, "override", typing_extensions.override)
sys.argv = sys.argv[1:]
spec = importlib.util.spec_from_file_location("preprocess_data", sys.argv[0])
tool = sys.modules["preprocess_data"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tool)  # a module by name, so its pool's workers can unpickle its tasks
began = time.perf_counter()
tool.main()
print(f"main seconds {time.perf_counter() - began}")
"""


def make_corpus(folder: Path, megabytes: float) -> list[Path]:
    """``FILES`` JSON-lines files of about ``megabytes`` together."""
    lines = [json.dumps({"text": t}) + "\n" for t in pydoc_data.topics.topics.values()]
    block = "".join(lines)
    repeats = max(FILES, int(megabytes * 1e6 / len(block)))
    paths = [folder / f"corpus-{k}.jsonl" for k in range(FILES)]
    for k, path in enumerate(paths):
        with path.open("w") as f:
            for _ in range(repeats // FILES + (k < repeats % FILES)):
                f.write(block)
    return paths


def hf_tokenizer(corpus: list[Path], folder: Path) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([str(corpus[0])], trainer)
    path = folder / "hf" / "tokenizer.json"
    path.parent.mkdir()
    tok.save(str(path))
    return str(path)


def run_workers(corpus: list[Path], model: str, workers: int, out: Path) -> int:
    return prepare_data([str(p) for p in corpus], model, str(out), workers)["tokens"]


def run_shards(corpus: list[Path], model: str, shards: int, out: Path) -> int:
    """Every shard in a process of its own, all at once (forked from this one, so the time is
    the work, not each array task's one-off imports), then megatron's merge."""
    inputs = [str(p) for p in corpus]
    fork = multiprocessing.get_context("fork")
    procs = [fork.Process(target=prepare_shard, args=(inputs, model, str(out), shards, k))
             for k in range(shards)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
    if any(proc.exitcode for proc in procs):
        raise SystemExit(f"a shard of {out} failed")
    return prepare_sharded(inputs, model, str(out), shards)["tokens"]


def run_megatron_lm(tree: Path, ours: Path, corpus: list[Path], model: str, workers: int,
                    out: Path) -> tuple[int, float]:
    """Megatron-LM's preprocessing of ``corpus`` (one file: the tool reads one input), its
    output compared byte for byte with ours of the same file; returns the tokens and the
    seconds its process spends importing (timed apart, and left out of the row: our rows run
    in an already started process)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    whole = out.parent / "corpus-all.jsonl"
    if not whole.exists():
        with whole.open("wb") as f:
            for path in corpus:
                f.write(path.read_bytes())
    tool = tree / "tools" / "preprocess_data.py"
    if not tool.is_file():
        raise SystemExit(f"--megatron-lm: '{tool}' does not exist")
    command = [sys.executable, "-W", "ignore", "-c", MEGATRON_TOOL, str(tool)]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    began = time.perf_counter()
    done = subprocess.run([*command, "--input", str(whole), "--output-prefix", str(out),
                           "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
                           model, "--workers", str(workers), "--append-eod"], env=env,
                          check=True, capture_output=True, text=True)
    main_seconds = float(done.stdout.strip().splitlines()[-1].split()[-1])
    imports = time.perf_counter() - began - main_seconds
    made = Path(f"{out}_text_document")
    for suffix in (".bin", ".idx"):
        if not filecmp.cmp(f"{made}{suffix}", f"{ours}{suffix}", shallow=False):
            raise SystemExit(f"Megatron-LM's {made}{suffix} differs from ours ({ours}{suffix})")
    dataset = IndexedDataset(str(made))  # held: its lengths are a view of its memory map
    return int(dataset.sequence_lengths.sum()), imports


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--folder", required=True, help="a scratch folder (removed afterwards)")
    p.add_argument("--megabytes", type=float, default=40.0)
    p.add_argument("--workers", type=int_list, default=[1, 2])
    p.add_argument("--shards", type=int_list, default=[2],
                   help="shard counts to run as concurrent processes (at most 4)")
    p.add_argument("--megatron-lm", type=Path,
                   help="a Megatron-LM source tree: also time its tools/preprocess_data.py")
    args = p.parse_args(argv)
    if any(not 1 <= s <= FILES for s in args.shards):
        p.error(f"--shards ({args.shards}) must each be between 1 and {FILES} (the files)")
    folder = Path(args.folder)
    folder.mkdir(parents=True, exist_ok=False)
    try:
        corpus = make_corpus(folder, args.megabytes)
        size = sum(path.stat().st_size for path in corpus) / 1e6
        spm = train_tokenizer([str(corpus[0])], str(folder / "spm"), VOCAB)
        tokenizers = {f"sentencepiece {package_version('sentencepiece')}": spm,
                      f"HF tokenizers {package_version('tokenizers')}":
                          hf_tokenizer(corpus, folder)}
        print(f"# prepare-data: {size:.0f} MB of JSON lines in {FILES} files, "
              f"{os.cpu_count()} CPUs")
        rows = []

        def timed(name: str, how: str, run, model: str, processes: int) -> None:
            out = folder / f"out-{len(rows)}"
            began = time.perf_counter()
            tokens = run(corpus, model, processes, out)
            tokens, excluded = tokens if isinstance(tokens, tuple) else (tokens, 0.0)
            seconds = time.perf_counter() - began - excluded
            rate = tokens / seconds
            rows.append([name, how, f"{tokens:,}", f"{seconds:.1f}", f"{rate:,.0f}",
                         f"{rate / processes:,.0f}", f"{size / seconds:.1f}"])
            print(" | ".join(rows[-1]), file=sys.stderr, flush=True)

        for name, model in tokenizers.items():
            for w in args.workers:
                timed(name, f"workers {w}", run_workers, model, w)
            for s in args.shards:
                timed(name, f"shards {s}", run_shards, model, s)
        if args.megatron_lm:
            ours = folder / "ours-all"
            run_workers(corpus, spm, 1, ours)
            megatron_lm = functools.partial(run_megatron_lm, args.megatron_lm, ours)
            for w in args.workers:
                timed(f"sentencepiece {package_version('sentencepiece')}",
                      f"Megatron-LM, workers {w}", megatron_lm, spm, w)
        print(markdown_table(["tokenizer", "processes", "tokens", "seconds", "tokens/s",
                              "tokens/s per process", "MB/s"], rows, right_from=2))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
