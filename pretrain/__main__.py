"""``python -m pretrain <command>``: tokenizers, data, training, evaluation, text, export.

Commands: train-tokenizer, prepare-data, train, eval, generate, export-hf, lm-eval.

User mistakes (config, data, checkpoint, command line) print one ``error:`` line and exit 2;
an aborted run (e.g. repeated NaN/Inf) exits 3.
"""

from __future__ import annotations

import sys

from pretrain.stop import StopRequest

# Before the imports below (torch: a second or more): a preemption signal during start-up is
# then a clean stop instead of a kill.
_EARLY_STOP = StopRequest.install() if sys.argv[1:2] == ["train"] else None

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
from pathlib import Path  # noqa: E402

from pretrain import console  # noqa: E402
from runtime.errors import ConfigError, UserError  # noqa: E402

OVERRIDES_HELP = """\
Any config field can be set on the command line as --section.key=value (command line >
--config file > its base files > defaults), for example:
  --optim.lr=1e-3 --run.dir=runs/lr1e-3 --model.num_layers=12 --run.deterministic=true
Lists: --data.prefixes=data/a,data/b (commas), or the key repeated
  (--data.prefixes=data/a --data.prefixes=data/b), or TOML (--data.prefixes='["data/a"]');
  --data.weights=0.3,0.7. Megatron-LM's weighted form ["0.3", "data/a", "0.7", "data/b"] is
  accepted too. Sections: model, parallel, optim, data, run, logging, kernels, diagnostics;
  every field is documented in model/config.py and pretrain/config.py.
Without --config, train, eval and generate use the config.toml of the run folder named by
--run.dir (eval and generate: the run folder holding --checkpoint)."""
# read a checkpoint, take config overrides
CHECKPOINT_COMMANDS = ("eval", "generate", "export-hf", "lm-eval")
INPUTS_HELP = (".jsonl/.json[.gz] (one document per line), .parquet, .arrow, a datasets "
               "save_to_disk folder, or text[.gz] (paragraph = document)")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2, like every other user mistake
        raise ConfigError(f"command line: {message}")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m pretrain", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    t = sub.add_parser("train-tokenizer", help="train a sentencepiece tokenizer")
    t.add_argument("inputs", nargs="+", help=INPUTS_HELP)
    t.add_argument("--output", required=True, help="output prefix (writes PREFIX.model)")
    t.add_argument("--vocab-size", type=int, default=8192)
    t.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe",
                   help="sentencepiece model type (pretrain.tokenizer.ModelType)")

    d = sub.add_parser("prepare-data", help="tokenise text into a Megatron indexed dataset")
    d.add_argument("inputs", nargs="+", help=INPUTS_HELP)
    d.add_argument("--tokenizer", required=True,
                   help="sentencepiece .model file, or a Hugging Face tokenizer.json or its folder")
    d.add_argument("--output", required=True, help="output prefix (PREFIX.bin/.idx)")
    d.add_argument("--workers", type=int, default=1)
    for command in (t, d):
        command.add_argument("--text-field", default="text",
                             help="the text field (JSON lines) or column (tables) to read")

    for name, text in (("train", "train (resumes from the run folder's latest checkpoint)"),
                       ("eval", "validation loss and perplexity of a checkpoint"),
                       ("generate", "sample text from a checkpoint (greedy or seeded)"),
                       ("export-hf", "write a checkpoint as a Hugging Face model folder"),
                       ("lm-eval", "score lm-evaluation-harness tasks with a checkpoint")):
        c = sub.add_parser(name, help=text, description=text, epilog=OVERRIDES_HELP,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        c.add_argument("--config", help="TOML file (configs/*.toml)")
        if name == "train":
            c.add_argument("--dry-run", action="store_true",
                           help="print the resolved config, sizes and layout, then exit")
        else:
            c.add_argument("--checkpoint", required=True,
                           help="a checkpoint folder, or a run's checkpoints/ folder")
        if name == "export-hf":
            c.add_argument("--output", required=True, help="a new folder")
        if name == "lm-eval":
            c.add_argument("--tasks", required=True, help="comma-separated lm-eval task names")
            c.add_argument("--include-path", help="a folder of local task YAML files")
            c.add_argument("--num-fewshot", type=int)
            c.add_argument("--limit", type=int, help="at most this many documents per task")
        if name == "generate":
            c.add_argument("--prompt", action="append", required=True,
                           help="text to continue (repeat for several prompts)")
            c.add_argument("--max-tokens", type=int, default=64)
            c.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
            c.add_argument("--top-k", type=int, default=0, help="0: off")
            c.add_argument("--top-p", type=float, default=1.0, help="1: off")
            c.add_argument("--seed", type=int, default=0, help="the sampling generator's seed")
    for command in sub.choices.values():
        command.add_argument("--verbose", action="store_true",
                             help="show every third-party warning and megatron's INFO logs")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    console.setup(verbose="--verbose" in argv)  # before megatron is imported (its notices)
    # Before the slow imports: a preemption during start-up is then a clean stop, not a kill.
    stop = (_EARLY_STOP or StopRequest.install()) if argv[:1] == ["train"] else None
    try:
        args, overrides = _parser().parse_known_args(argv)
        bad = [o for o in overrides if not o.startswith("--") or "=" not in o]
        if bad and args.command in ("train", *CHECKPOINT_COMMANDS):
            raise ConfigError(f"command line: {bad[0]!r} is not a --section.key=value override")
        if overrides and args.command not in ("train", *CHECKPOINT_COMMANDS):
            raise ConfigError(f"command line: unrecognized arguments: {' '.join(overrides)}")
        return _run(args, overrides, stop)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def _run(args, overrides: list[str], stop: StopRequest | None) -> int:
    if args.command == "train-tokenizer":
        from pretrain.tokenizer import train_tokenizer

        path = train_tokenizer(args.inputs, args.output, args.vocab_size, args.model_type,
                               args.text_field)
        print(path)
        return 0
    if args.command == "prepare-data":
        from pretrain.prepare import prepare_data

        print(json.dumps(prepare_data(args.inputs, args.tokenizer, args.output, args.workers,
                                      args.text_field)))
        return 0

    from pretrain.config import load_config

    path = args.config or _run_folder_config(args, overrides)
    config = load_config(path, overrides, training=args.command == "train")
    if args.command == "train" and args.dry_run:
        from pretrain.dry_run import dry_run

        if os.environ.get("RANK", "0") == "0":  # under torchrun: one copy, not one per rank
            print(dry_run(config))
        return 0
    from pretrain.metrics import is_logging_rank, strict_json
    from pretrain.train import TrainingAborted
    from runtime import cpu_compat, parallel

    with cpu_compat.enabled():  # megatron's CUDA bookkeeping on a CPU machine, for this run
        try:
            if args.command == "lm-eval":
                from pretrain.lm_eval_model import run_lm_eval

                print(strict_json(run_lm_eval(config, args.checkpoint, args.tasks.split(","),
                                              args.include_path, args.num_fewshot, args.limit)))
                return 0
            if args.command == "export-hf":
                from pretrain.hf_export import export_hf

                print(strict_json(export_hf(config, args.checkpoint, args.output)))
                return 0
            if args.command == "generate":
                from pretrain.generate import Sampling, generate_from_checkpoint

                sampling = Sampling(args.max_tokens, args.temperature, args.top_k, args.top_p,
                                    args.seed)
                for line in generate_from_checkpoint(config, args.checkpoint, args.prompt,
                                                     sampling):
                    print(strict_json(line))
                return 0
            if args.command == "train":
                from pretrain.train import train

                result = train(config, stop, config_path=path)
            else:
                from pretrain.evaluate import evaluate_checkpoint

                result = evaluate_checkpoint(config, args.checkpoint)
            if is_logging_rank():  # the rank that holds the loss prints the result, once
                print(strict_json(result))
        except TrainingAborted as err:
            print(f"error: {err}", file=sys.stderr)
            return 3
        finally:
            parallel.destroy()  # NCCL wants its groups torn down before the process exits
    return 0


def _run_folder_config(args, overrides: list[str]) -> str:
    """The config of an existing run when --config is not given: RUN/config.toml of
    --run.dir, or for eval of the run folder holding --checkpoint."""
    candidates = [Path(o.partition("=")[2]) / "config.toml"
                  for o in overrides if o.startswith("--run.dir=")]
    if args.command in CHECKPOINT_COMMANDS:
        checkpoint = Path(args.checkpoint)
        candidates += [folder / "config.toml"
                       for folder in (checkpoint, checkpoint.parent, checkpoint.parent.parent)]
    for candidate in candidates:
        if candidate.is_file():
            return str(candidate)
    where = ("--run.dir=RUN of an existing run" if args.command == "train"
             else "a --checkpoint inside a run folder that has config.toml")
    raise ConfigError(f"{args.command} needs --config FILE (e.g. --config "
                      f"configs/demo-cpu.toml), or {where}")


if __name__ == "__main__":
    sys.exit(main())
