"""Data preparation throughput: tokens per second, per worker process, for a sentencepiece and
a Hugging Face tokenizer.

    python -m bench.prepare_throughput --folder /scratch/prep --megabytes 40 --workers 1,2

The corpus is Python's own documentation topics (always installed) repeated to ``--megabytes``
of JSON lines; both tokenizers are 8,192-piece BPEs trained on it here (sentencepiece through
``train-tokenizer``'s code, byte-level BPE through the ``tokenizers`` library). Each row is one
``prepare_data`` call, timed end to end (reading, tokenising, writing the .bin/.idx and the
record). The per-worker rate shows how preparation scales with processes; a sharded
preparation (``--shards``) adds one such process group per shard or array task.
"""

from __future__ import annotations

import argparse
import json
import os
import pydoc_data.topics
import shutil
import time
from pathlib import Path

from bench.common import package_version
from pretrain.data.prepare import prepare_data
from pretrain.data.tokenizer import train_tokenizer

VOCAB = 8192


def make_corpus(folder: Path, megabytes: float) -> Path:
    lines = [json.dumps({"text": t}) + "\n" for t in pydoc_data.topics.topics.values()]
    block = "".join(lines)
    path = folder / "corpus.jsonl"
    with path.open("w") as f:
        for _ in range(max(1, int(megabytes * 1e6 / len(block)))):
            f.write(block)
    return path


def hf_tokenizer(corpus: Path, folder: Path) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([str(corpus)], trainer)
    path = folder / "hf" / "tokenizer.json"
    path.parent.mkdir()
    tok.save(str(path))
    return str(path)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--folder", required=True, help="a scratch folder (removed afterwards)")
    p.add_argument("--megabytes", type=float, default=40.0)
    p.add_argument("--workers", default="1,2")
    args = p.parse_args(argv)
    folder = Path(args.folder)
    folder.mkdir(parents=True, exist_ok=False)
    try:
        corpus = make_corpus(folder, args.megabytes)
        tokenizers = {
            f"sentencepiece {package_version('sentencepiece')}":
                train_tokenizer([str(corpus)], str(folder / "spm"), VOCAB),
            f"HF tokenizers {package_version('tokenizers')}": hf_tokenizer(corpus, folder),
        }
        size = corpus.stat().st_size / 1e6
        print(f"# prepare-data: {size:.0f} MB of JSON lines, {os.cpu_count()} CPUs")
        print("| tokenizer | workers | tokens | seconds | tokens/s | tokens/s per worker "
              "| MB/s |")
        print("|---|---|---|---|---|---|---|")
        for name, model in tokenizers.items():
            for workers in (int(w) for w in args.workers.split(",")):
                out = folder / f"out-{len(list(folder.iterdir()))}"
                began = time.perf_counter()
                summary = prepare_data([str(corpus)], model, str(out), workers)
                seconds = time.perf_counter() - began
                rate = summary["tokens"] / seconds
                print(f"| {name} | {workers} | {summary['tokens']:,} | {seconds:.1f} | "
                      f"{rate:,.0f} | {rate / workers:,.0f} | {size / seconds:.1f} |",
                      flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
