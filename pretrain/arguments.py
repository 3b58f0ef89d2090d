"""The command line of ``python -m pretrain``: its commands, their arguments, and which config
a command reads when ``--config`` is not given.

Kept apart from the entry point (``pretrain/__main__.py``, which installs signal handlers when
imported) so ``launch.finished`` resolves a run folder exactly as training does.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from runtime.errors import ConfigError

OVERRIDES_HELP = """\
Any config field can be set on the command line as --section.key=value (command line >
--config file > its base files > defaults), for example:
  --optim.lr=1e-3 --run.dir=runs/lr1e-3 --model.num_layers=12 --run.deterministic=true
Lists: --data.prefixes=data/a,data/b (commas), or the key repeated
  (--data.prefixes=data/a --data.prefixes=data/b), or TOML (--data.prefixes='["data/a"]');
  --data.weights=0.3,0.7. Megatron-LM's weighted form ["0.3", "data/a", "0.7", "data/b"] is
  accepted too. Sections: model, parallel, optim, data, run, guard, logging, kernels,
  diagnostics, eval, profiling; what a field means, with its type, default and allowed values:
  python -m pretrain explain optim.lr (a section's fields: explain optim); every field:
  docs/config.md.
Without --config, train, eval and generate use the config.toml of the run folder named by
--run.dir (eval and generate: the run folder holding --checkpoint)."""
# read a checkpoint, take config overrides
CHECKPOINT_COMMANDS = ("eval", "generate", "export-hf", "lm-eval")
INPUTS_HELP = (".jsonl/.json[.gz] (one document per line), .parquet, .arrow, a datasets "
               "save_to_disk folder, or plain text[.gz] (see --plain-text)")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2, like every other user mistake
        raise ConfigError(f"command line: {message}")


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m pretrain`` (also read by ``launch.finished``)."""
    p = _Parser(prog="python -m pretrain",
                description="tokenizers, data, training, evaluation, text, export")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    t = sub.add_parser("train-tokenizer", help="train a sentencepiece tokenizer")
    t.add_argument("inputs", nargs="+", help=INPUTS_HELP)
    t.add_argument("--output", required=True, help="output prefix (writes PREFIX.model)")
    t.add_argument("--vocab-size", type=int, default=8192)
    t.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe",
                   help="sentencepiece model type (pretrain.data.tokenizer.ModelType)")

    d = sub.add_parser("prepare-data", help="tokenise text into a Megatron indexed dataset")
    d.add_argument("inputs", nargs="+", help=INPUTS_HELP + "; quoted globs are expanded")
    d.add_argument("--tokenizer", required=True,
                   help="sentencepiece .model file, or a Hugging Face tokenizer.json or its folder")
    d.add_argument("--output", required=True, help="output prefix (PREFIX.bin/.idx)")
    d.add_argument("--workers", type=int, default=1)
    d.add_argument("--shards", type=int,
                   help="split the inputs into this many shards (PREFIX.shards/): runs of "
                        "whole files, or with fewer files, of JSON lines; each resumable, "
                        "then merged into PREFIX (pretrain.data.shards)")
    d.add_argument("--shard", type=int,
                   help="prepare only this shard (0-based; a slurm array task's index)")
    d.add_argument("--blend", action="store_true",
                   help="keep the shards as a blend instead of merging them")
    d.add_argument("--allow-lossy-tokenizer", action="store_true",
                   help="prepare with a tokenizer that does not give back the text it encodes "
                        "(refused otherwise; the dataset's record keeps the choice)")
    for command in (t, d):
        command.add_argument("--text-field", default="text",
                             help="the text field (JSON lines) or column (tables) to read")
        command.add_argument("--plain-text", default="auto",  # checked by data.documents
                             help="how a plain-text file becomes documents: auto (the default): "
                                  ".txt/.text files at blank lines, any other (source code) "
                                  "whole; file: each file whole; paragraphs: at blank lines")

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
            c.add_argument("--seed", type=int, default=0,
                           help="seeds the sampling: each prompt draws from its own generator, "
                                "seeded with --seed and the prompt's place (the first is 0), so "
                                "a command repeats its text and prompts draw independently")
    e = sub.add_parser("explain", help="what a config field means: its description, type, "
                                       "default and allowed values (all: docs/config.md)")
    e.add_argument("field", metavar="FIELD",
                   help="a config field as section.key (optim.lr), or a section (optim)")
    r = sub.add_parser("report", help="a run's curves as PNGs and one HTML page (no W&B needed)")
    r.add_argument("run_dir", metavar="RUN_DIR", help="a run folder (it holds metrics.jsonl)")
    r.add_argument("--output", help="folder for the PNGs and report.html (default RUN_DIR/report)")
    r.add_argument("--smooth", type=int, default=0, metavar="N",
                   help="draw the train loss as the mean of its last N logged steps over the "
                        "faint raw line (0: the raw line only)")
    for command in sub.choices.values():
        command.add_argument("--verbose", action="store_true",
                             help="show every third-party warning and megatron's INFO logs")
    return p


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """(arguments, config overrides) of a command line; a malformed override or an argument
    the command does not take is a :class:`ConfigError`."""
    args, overrides = parser().parse_known_args(argv)
    bad = [i for i, o in enumerate(overrides) if not o.startswith("--") or "=" not in o]
    if bad and args.command in ("train", *CHECKPOINT_COMMANDS):
        following = overrides[bad[0] + 1] if bad[0] + 1 < len(overrides) else None
        raise ConfigError(f"command line: {_slip(overrides[bad[0]], following)}")
    if overrides and args.command not in ("train", *CHECKPOINT_COMMANDS):
        raise ConfigError(f"command line: unrecognized arguments: {' '.join(overrides)}")
    return args, overrides


def _slip(item: str, following: str | None) -> str:
    """What an argument that is not a --section.key=value override was probably meant to be."""
    if not item.startswith("-") and item.endswith(".toml"):
        return f"{item!r} is not an argument of its own; give a config file as --config {item}"
    if item.startswith("--") and following is not None and not following.startswith("-"):
        return f"{item!r} needs its value after '=', not a space: {item}={following}"
    return f"{item!r} is not a --section.key=value override"


def checkpoint_config(checkpoint: str) -> Path | None:
    """The config.toml of the run folder holding ``checkpoint`` (the checkpoint folder, a
    run's checkpoints/ folder or the run folder), or None."""
    path = Path(checkpoint)
    for folder in (path, path.parent, path.parent.parent):
        if (folder / "config.toml").is_file():
            return folder / "config.toml"
    return None


def run_folder_config(args, overrides: list[str]) -> str:
    """The config of an existing run when --config is not given: RUN/config.toml of
    --run.dir, or for eval of the run folder holding --checkpoint."""
    candidates = [Path(o.partition("=")[2]) / "config.toml"
                  for o in overrides if o.startswith("--run.dir=")]
    if args.command in CHECKPOINT_COMMANDS:
        candidates.append(checkpoint_config(args.checkpoint))
    for candidate in filter(None, candidates):
        if candidate.is_file():
            return str(candidate)
    where = ("--run.dir=RUN of an existing run" if args.command == "train"
             else "a --checkpoint inside a run folder that has config.toml")
    raise ConfigError(f"{args.command} needs --config FILE (e.g. --config "
                      f"configs/demo-cpu.toml), or {where}")


def other_config_hint(args) -> str:
    """For a checkpoint command given a --config other than the checkpoint's own: the hint
    that the run folder's config.toml (what the checkpoint was trained with) is one flag away.
    A missing tokenizer or dataset, or another model, is then most likely the wrong config."""
    if args.command not in CHECKPOINT_COMMANDS or not args.config:
        return ""
    own = checkpoint_config(args.checkpoint)
    if own is None or own.resolve() == Path(args.config).resolve():
        return ""
    return f"; the checkpoint's run folder has its own config ({own}): leave out --config to use it"
