"""``python -m tests.kill_in_save [--background] [--signal NAME] STEP ARGS...``: ``python -m
pretrain ARGS...``, hit by a signal in the middle of step STEP's checkpoint save, to test that a
crash or a stop during a save loses nothing and leaves nothing running. Without
``--background``: after megatron wrote the tensors, before the checkpoint is complete. With it
(for run.async_save): from the forked writer of that save, once it has written its files, so
the signal comes while its background write is in flight (before every rank's write is
confirmed and the checkpoint completed).

The signal (``--signal``): ``SIGKILL`` (the default) kills the training process alone;
``SIGTERM`` and ``SIGINT`` go to the whole process group, as slurm and a terminal send them;
``SIGINT-twice`` is a user pressing Ctrl-C twice, a little more than a second apart, while the
save (or the writer, which then goes on as a long write would) is still at work. The hooks live
here, in the tests, not in the save path."""

from __future__ import annotations

import os
import signal
import sys
import time

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

from pretrain.run.stop import SAME_PRESS_S


def send(name: str, trainer: int) -> None:
    if name == "SIGKILL":
        os.kill(trainer, signal.SIGKILL)
    elif name == "SIGINT-twice":
        os.killpg(os.getpgrp(), signal.SIGINT)
        time.sleep(SAME_PRESS_S + 0.2)
        os.killpg(os.getpgrp(), signal.SIGINT)
        time.sleep(120)  # still writing: the second press must end the run without waiting
    else:
        os.killpg(os.getpgrp(), signal.Signals[name])


def signal_after_save(folder: str, name: str) -> None:
    save = dist_checkpointing.save

    def save_then_signal(state, directory, *args, **kwargs):
        result = save(state, directory, *args, **kwargs)
        if os.path.basename(directory) == folder:
            send(name, os.getpid())
        return result

    dist_checkpointing.save = save_then_signal  # pretrain.run.checkpoint calls it so


def signal_from_background_writer(folder: str, name: str) -> None:
    trainer = os.getpid()
    write = FileSystemWriterAsync.write_preloaded_data_multithread

    def write_then_signal(transforms, use_msc, rank, buckets, results_queue):
        write(transforms, use_msc, rank, buckets, results_queue)
        in_folder = any(os.path.basename(os.path.dirname(b[0])) == folder for b in buckets)
        if os.getpid() != trainer and in_folder:  # the forked writer, not a foreground save
            send(name, trainer)

    # megatron binds the writer's function when it plans a save, so patching the class suffices
    FileSystemWriterAsync.write_preloaded_data_multithread = staticmethod(write_then_signal)


def main(step: int, argv: list[str], background: bool = False, name: str = "SIGKILL") -> int:
    folder = f".step_{step:08d}.tmp"
    (signal_from_background_writer if background else signal_after_save)(folder, name)
    from pretrain.__main__ import main as pretrain_main

    return pretrain_main(argv)


if __name__ == "__main__":
    args, options = sys.argv[1:], {"--background": False, "--signal": "SIGKILL"}
    while args[0] in options:  # this wrapper's options come first, pretrain's after STEP
        flag = args.pop(0)
        options[flag] = True if flag == "--background" else args.pop(0)
    sys.exit(main(int(args[0]), args[1:], options["--background"], options["--signal"]))
