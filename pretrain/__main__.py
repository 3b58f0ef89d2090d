"""``python -m pretrain <command>``: train-tokenizer, prepare-data, train, eval.

User mistakes (config, data, checkpoint, command line) print one ``error:`` line and exit 2;
an aborted run (e.g. repeated NaN/Inf) exits 3.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from model.config import ConfigError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2, like every other user mistake
        raise ConfigError(f"command line: {message}")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m pretrain", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    t = sub.add_parser("train-tokenizer", help="train a sentencepiece tokenizer")
    t.add_argument("inputs", nargs="+", help=".txt (paragraph = document) or .jsonl files")
    t.add_argument("--output", required=True, help="output prefix (writes PREFIX.model)")
    t.add_argument("--vocab-size", type=int, default=8192)
    t.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe")

    d = sub.add_parser("prepare-data", help="tokenise text into a Megatron indexed dataset")
    d.add_argument("inputs", nargs="+")
    d.add_argument("--tokenizer", required=True, help="sentencepiece .model file")
    d.add_argument("--output", required=True, help="output prefix (PREFIX.bin/.idx)")
    d.add_argument("--workers", type=int, default=1)

    for name, text in (("train", "train (resumes from the run folder's latest checkpoint)"),
                       ("eval", "validation loss and perplexity of a checkpoint")):
        c = sub.add_parser(name, help=text)
        c.add_argument("--config", help="TOML file (configs/*.toml)")
        if name == "train":
            c.add_argument("--dry-run", action="store_true",
                           help="print the resolved config, sizes and layout, then exit")
        else:
            c.add_argument("--checkpoint", required=True,
                           help="a checkpoint folder, or a run's checkpoints/ folder")
    return p


def main(argv: list[str] | None = None) -> int:
    # Our progress at INFO; megatron's own INFO chatter (bucket layouts, dataset configs) off.
    logging.basicConfig(level=logging.WARNING, format="[pretrain] %(message)s", stream=sys.stderr)
    logging.getLogger("pretrain").setLevel(logging.INFO)
    try:
        args, overrides = _parser().parse_known_args(argv)
        bad = [o for o in overrides if not o.startswith("--") or "=" not in o]
        if bad and args.command in ("train", "eval"):
            raise ConfigError(f"command line: {bad[0]!r} is not a --section.key=value override")
        if overrides and args.command not in ("train", "eval"):
            raise ConfigError(f"command line: unrecognized arguments: {' '.join(overrides)}")
        return _run(args, overrides)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def _run(args, overrides: list[str]) -> int:
    if args.command == "train-tokenizer":
        from pretrain.tokenizer import train_tokenizer

        path = train_tokenizer(args.inputs, args.output, args.vocab_size, args.model_type)
        print(path)
        return 0
    if args.command == "prepare-data":
        from pretrain.prepare import prepare_data

        print(json.dumps(prepare_data(args.inputs, args.tokenizer, args.output, args.workers)))
        return 0

    from pretrain.config import load_config

    config = load_config(args.config, overrides)
    if args.command == "train" and args.dry_run:
        from pretrain.dry_run import dry_run

        print(dry_run(config))
        return 0
    from pretrain.train import TrainingAborted

    try:
        if args.command == "train":
            from pretrain.train import train

            print(json.dumps(train(config)))
        else:
            from pretrain.evaluate import evaluate_checkpoint

            print(json.dumps(evaluate_checkpoint(config, args.checkpoint)))
    except TrainingAborted as err:
        print(f"error: {err}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
