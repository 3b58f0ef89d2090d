"""Pretraining: ``python -m pretrain <command>`` and everything a run needs around the model.

Imports flow one way (``tests/test_layering.py`` holds it): ``__main__`` -> ``train`` -> ``hf``
-> ``unsharded`` -> ``build`` -> ``run`` -> ``data`` -> ``report`` -> ``optim`` -> ``config``
-> ``paths`` and ``arguments``; nothing imports an entry point or another module's private name.
"""
