"""Training entry point (``python -m pretrain``): data, loop, checkpoints, evaluation, W&B.

Builds on :mod:`model` (models, schedules, checkpoint format). The command-line interface
arrives with the pretraining work; until then this package only reserves the name.
"""
