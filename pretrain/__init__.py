"""Training entry point (``python -m pretrain``): data, loop, checkpoints, evaluation, W&B.

Builds on :mod:`model` (models, schedules, checkpoint format); the commands are in
``pretrain/__main__.py``.
"""
