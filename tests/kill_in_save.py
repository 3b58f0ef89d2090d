"""``python -m tests.kill_in_save [--background] STEP ARGS...``: ``python -m pretrain ARGS...``,
SIGKILLed in the middle of step STEP's checkpoint save, to test that a crash during a save
loses nothing. Without ``--background``: after megatron wrote the tensors, before the
checkpoint is complete. With it (for run.async_save): by the forked writer of that save, once
it has written its files, so the training process dies while its background write is in
flight (before every rank's write is confirmed and the checkpoint completed). The hooks live
here, in the tests, not in the save path."""

from __future__ import annotations

import os
import signal
import sys

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync


def kill_after_save(folder: str) -> None:
    save = dist_checkpointing.save

    def save_then_die(state, directory, *args, **kwargs):
        result = save(state, directory, *args, **kwargs)
        if os.path.basename(directory) == folder:
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    dist_checkpointing.save = save_then_die  # pretrain.run.checkpoint calls it through the module


def kill_from_background_writer(folder: str) -> None:
    trainer = os.getpid()
    write = FileSystemWriterAsync.write_preloaded_data_multithread

    def write_then_kill(transforms, use_msc, rank, buckets, results_queue):
        write(transforms, use_msc, rank, buckets, results_queue)
        in_folder = any(os.path.basename(os.path.dirname(b[0])) == folder for b in buckets)
        if os.getpid() != trainer and in_folder:  # the forked writer, not a foreground save
            os.kill(trainer, signal.SIGKILL)

    # megatron binds the writer's function when it plans a save, so patching the class suffices
    FileSystemWriterAsync.write_preloaded_data_multithread = staticmethod(write_then_kill)


def main(step: int, argv: list[str], background: bool = False) -> int:
    folder = f".step_{step:08d}.tmp"
    (kill_from_background_writer if background else kill_after_save)(folder)
    from pretrain.__main__ import main as pretrain_main

    return pretrain_main(argv)


if __name__ == "__main__":
    background = sys.argv[1] == "--background"
    args = sys.argv[2:] if background else sys.argv[1:]
    sys.exit(main(int(args[0]), args[1:], background))
