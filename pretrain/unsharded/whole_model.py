"""A checkpoint of any parallel layout as one whole model in this one process.

``generate``, ``lm-eval`` and ``export-hf`` read a checkpoint that may have been written at
TP x PP; megatron's checkpoint format reshards, so each of them runs unsharded, in one
process, on the CPU or one GPU.
"""

from __future__ import annotations

import os
from pathlib import Path

from model.config import ParallelConfig
from pretrain.build import setup, tokenizer_for
from pretrain.config import Config, validate
from pretrain.data.tokenizer import Tokenizer
from pretrain.run.checkpoint import weights_source
from runtime import weights
from runtime.errors import ConfigError


def single_process(config: Config, command: str) -> None:
    """Refuse a launch under torchrun and set the config to the unsharded layout, eager.

    Compiled blocks (``kernels.compile``) are a training setting: these commands run a few
    forwards whose shapes change from call to call (generation grows its sequence a token at
    a time, lm-eval's requests differ in length, export traces once), each of which a
    block compiled for static shapes would compile again, so they run the blocks eager
    whatever the training config says."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != 1:
        raise ConfigError(f"{command} runs in one process (WORLD_SIZE is {world}); start it "
                          "without torchrun")
    config.parallel = ParallelConfig()
    config.kernels.compile = config.kernels.cuda_graphs = False
    validate(config, world_size=1, training=False)


def load_whole(config: Config, checkpoint: str) -> tuple[object, Tokenizer, Path]:
    """(model in eval mode, tokenizer, checkpoint folder) after :func:`single_process`; the
    checkpoint must hold the config's model and tokenizer (checked before loading)."""
    tokenizer = tokenizer_for(config)
    found = weights_source(checkpoint, config)
    [model] = setup(config)
    weights.load([model], found)
    model.eval()
    return model, tokenizer, found
