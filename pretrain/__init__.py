"""Pretraining: ``python -m pretrain <command>`` and everything a run needs around the model.

Imports flow one way (a test holds it): ``__main__`` -> ``train`` -> ``hf`` -> ``unsharded``
-> ``run`` -> ``data`` -> ``report`` -> ``build``/``config``/``paths``; nothing here imports
an entry point or another module's private name.
"""
