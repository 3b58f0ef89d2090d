"""``python -m pretrain <command>``: tokenizers, data, training, evaluation, text, export.

Commands: train-tokenizer, prepare-data, train, eval, generate, export-hf, lm-eval,
report, explain.

User mistakes (config, data, checkpoint, command line) print one ``error:`` line and exit 2;
an aborted run (e.g. repeated NaN/Inf) exits 3; a rank the hang watchdog ended
(pretrain.train.watchdog) exits 4. Ctrl-C exits 130: ``train`` first saves a checkpoint
(pretrain.run.stop); every other command stops where it is, with one line and nothing
half-written (the files a command writes appear whole or not at all).
"""

from __future__ import annotations

import sys

from pretrain.run.stop import INTERRUPTED, StopRequest

# Before the imports below (torch: a second or more): a preemption signal during start-up is
# then a clean stop instead of a kill.
_EARLY_STOP = StopRequest.install() if sys.argv[1:2] == ["train"] else None

import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402

from pretrain import arguments  # noqa: E402
from pretrain.report import console  # noqa: E402
from runtime.errors import CheckpointError, DataError, UserError  # noqa: E402
from runtime.launcher import launch_rank, report_error  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    console.setup(verbose="--verbose" in argv)  # before megatron is imported (its notices)
    # Before the slow imports: a preemption during start-up is then a clean stop, not a kill.
    stop = (_EARLY_STOP or StopRequest.install()) if argv[:1] == ["train"] else None
    args = None
    try:
        args, overrides = arguments.parse(argv)
        return _run(args, overrides, stop)
    except UserError as err:
        hint = arguments.other_config_hint(args) if _config_may_be_wrong(args, err) else ""
        report_error(f"{err}{hint}")
        return 2
    except KeyboardInterrupt:  # Ctrl-C in a command other than train (train catches it)
        report_error(f"interrupted by Ctrl-C: {argv[0] if argv else 'the command'} stopped; "
                     "nothing half-written is left")
        return INTERRUPTED


def _config_may_be_wrong(args, err: UserError) -> bool:
    """A missing tokenizer or dataset, or a checkpoint of another model: what a checkpoint
    command given another run's config meets (the tokenizer mismatch says it itself)."""
    return args is not None and isinstance(err, DataError | CheckpointError) \
        and "--config" not in str(err)


def _run(args, overrides: list[str], stop: StopRequest | None) -> int:
    from pretrain.data.documents import Reading

    if args.command == "train-tokenizer":
        from pretrain.data.tokenizer import train_tokenizer
        from pretrain.data.tokenizer_summary import summarize

        reading = Reading(args.text_field, args.plain_text)
        path = train_tokenizer(args.inputs, args.output, args.vocab_size, args.model_type,
                               reading)
        for line in summarize(path, args.inputs, reading).lines():  # stderr: stdout the path
            logging.getLogger("pretrain").info("%s", line)
        print(path)
        return 0
    if args.command == "prepare-data":
        from pretrain.data.shards import prepare_command

        print(json.dumps(prepare_command(args.inputs, args.tokenizer, args.output, args.workers,
                                         Reading(args.text_field, args.plain_text),
                                         args.shards, args.shard, args.blend,
                                         args.allow_lossy_tokenizer)))
        return 0
    if args.command == "explain":  # reads the config classes only
        from pretrain.report.config_reference import explain

        print(explain(args.field))
        return 0
    if args.command == "report":  # reads files only: no torch, no process group
        from pretrain.report.run_report import write_report

        print(write_report(args.run_dir, args.output, args.smooth)[-1])
        return 0

    from pretrain.config import load_config

    if args.command in ("train", "eval"):  # one copy of the start-up lines, not one per rank
        console.quiet_other_ranks(launch_rank() == 0, keep_warnings=False)
    path = args.config or arguments.run_folder_config(args, overrides)
    planning = args.command == "train" and args.dry_run
    # the launch's world size, for the commands that build process groups (the dry run asks
    # about its own; the unsharded commands run one process)
    launched = args.command in ("train", "eval") and not planning
    world = int(os.environ.get("WORLD_SIZE", 1))
    # eval reads a checkpoint of any layout: the run's own unless the command names one
    refit = args.command == "eval" and not any(o.startswith("--parallel.") for o in overrides)
    config = load_config(path, overrides, training=args.command == "train",
                         world_size=world if launched and not refit else None,
                         reads_data=args.command in ("train", "eval"))
    if refit:
        from pretrain.config import fit_layout

        config, note = fit_layout(config, world)
        if note and launch_rank() == 0:
            logging.getLogger("pretrain").info(note)
    if planning:
        from pretrain.report.dry_run import LayoutRefused, dry_run
        from pretrain.train.loop import check_before_start

        if launch_rank() == 0:  # under torchrun: one copy, not one per rank
            try:
                print(dry_run(config), flush=True)
            except LayoutRefused as refused:  # the plan up to the layout, then the error
                print(refused.plan, flush=True)
                raise
        # then every check a real start makes before its first step: the plan is shown even
        # where the data is not (a login node), and the exit status says whether a start
        # here would be refused
        check_before_start(config, path)
        return 0
    from pretrain.report.metrics import is_logging_rank, strict_json
    from pretrain.train.loop import TrainingAborted
    from runtime import cpu_compat, parallel

    with cpu_compat.enabled():  # megatron's CUDA bookkeeping on a CPU machine, for this run
        try:
            if args.command == "lm-eval":
                from pretrain.unsharded.lm_eval import run_lm_eval

                print(strict_json(run_lm_eval(config, args.checkpoint, args.tasks.split(","),
                                              args.include_path, args.num_fewshot, args.limit)))
                return 0
            if args.command == "export-hf":
                from pretrain.hf.export import export_hf

                print(strict_json(export_hf(config, args.checkpoint, args.output)))
                return 0
            if args.command == "generate":
                from pretrain.unsharded.generate import Sampling, generate_from_checkpoint

                sampling = Sampling(args.max_tokens, args.temperature, args.top_k, args.top_p,
                                    args.seed)
                for line in generate_from_checkpoint(config, args.checkpoint, args.prompt,
                                                     sampling):
                    print(strict_json(line))
                return 0
            if args.command == "train":
                from pretrain.train.loop import train

                result = train(config, stop, config_path=path)
            else:
                from pretrain.train.evaluate import evaluate_checkpoint

                result = evaluate_checkpoint(config, args.checkpoint)
            if is_logging_rank():  # the rank that holds the loss prints the result, once
                print(strict_json(result))
            if stop is not None and "stopped_at" in result:
                return stop.exit_status
        except TrainingAborted as err:
            report_error(str(err))
            return 3
        finally:
            parallel.destroy()  # NCCL wants its groups torn down before the process exits
    return 0


if __name__ == "__main__":
    sys.exit(main())
