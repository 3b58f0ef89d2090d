"""What the suite's child processes import, loaded once in a parent that then forks them.

Importing torch and megatron-core costs ~4 s of CPU per process, more than most of the suite's
child processes spend working. Two parents import them once and fork their children:
tests/zygote.py for ``python -m pretrain`` and multiprocessing's fork server for the ranks
:func:`tests.helpers.spawn` starts (it imports this module by name, so importing it does the
work).

After the imports the collector is told to leave every object so far alone
(``gc.freeze``): a forked child's collections then do not touch, and so copy, the parent's
heap. Only such a parent imports this module. At its own exit the objects are handed back
to the collector: frozen ones are never freed, and Triton's bindings (nanobind) then report
them as leaks on stderr (the fork server's stderr is the test process's).
"""

from __future__ import annotations

import atexit
import gc
import importlib

MODULES = (
    "torch", "numpy", "sentencepiece", "triton",
    "megatron.core", "megatron.core.tensor_parallel", "megatron.core.transformer",
    "megatron.core.models.gpt", "megatron.core.optimizer", "megatron.core.distributed",
    "megatron.core.dist_checkpointing", "megatron.core.pipeline_parallel",
    "megatron.core.datasets.gpt_dataset", "megatron.core.datasets.indexed_dataset",
    "pretrain.build", "pretrain.train.loop", "pretrain.run.checkpoint", "pretrain.optim",
    "pretrain.data.checks", "model.builder",
)

for _name in MODULES:
    importlib.import_module(_name)
gc.freeze()
atexit.register(gc.unfreeze)
