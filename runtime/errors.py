"""The errors a user can cause, each reported as one line naming the field or file, the rule
and the value, with exit status 2 and no traceback (``pretrain.__main__``).

One base class, so an entry point catches every user mistake in one place and lets real bugs
keep their tracebacks; one subclass per kind of input, so a caller (or a test) can tell a bad
config from bad data or a bad checkpoint.
"""

from __future__ import annotations


class UserError(ValueError):
    """A mistake in what the user gave: the message is one line naming it."""


class ConfigError(UserError):
    """A config field or command-line value breaks a rule."""


class DataError(UserError):
    """A corpus, tokenizer or dataset file is missing, damaged or does not fit the config."""


class CheckpointError(UserError):
    """A checkpoint that cannot be read or does not fit the run, or a save that failed."""
