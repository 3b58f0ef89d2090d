"""The errors a user can cause, each reported as one line naming the field or file, the rule
and the value, with exit status 2 and no traceback (``pretrain.__main__``).

One base class, so an entry point catches every user mistake in one place and lets real bugs
keep their tracebacks; one subclass per kind of input, so a caller (or a test) can tell a bad
config from bad data or a bad checkpoint. Checks that do not depend on each other are run
together (:class:`Findings`), so that several mistakes known at once are reported at once:
one :class:`ConfigErrors`, one line each.
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


class ConfigErrors(ConfigError):
    """Several mistakes found in one pass over a config, one line each: a user fixes them all
    at once instead of meeting them one run at a time. ``errors`` holds them, in the order
    the checks found them; the message is their lines. Built from a message, as a caller
    that rewords an error builds its class again (``type(err)(f"cell x: {err}")``), each
    line is one error."""

    def __init__(self, errors: list[UserError] | str) -> None:
        if isinstance(errors, str):
            errors = [ConfigError(line) for line in errors.splitlines()]
        self.errors = list(errors)
        super().__init__("\n".join(str(error) for error in self.errors))


def error_lines(message: str) -> str:
    """``error: LINE`` for each line of ``message``: how every entry point prints a user's
    mistake (several config errors are several lines, each its own ``error:``)."""
    return "\n".join(f"error: {line}" for line in str(message).splitlines() or [""])


class Findings:
    """The mistakes of independent checks, collected so that all of them are reported.

    ``check(rule, ...)`` runs one check, which raises at its first failure as every check
    does; a :class:`UserError` it raises is kept and the next check runs. Leaving the
    ``with`` block raises what was kept: nothing, the one error as it was raised (its class
    and one line, as before any collecting), or :class:`ConfigErrors` with all of them. A
    check that reads what an earlier one checks runs only when that one passed: ``check``
    says whether it did."""

    def __init__(self) -> None:
        self.errors: list[UserError] = []

    def __enter__(self) -> Findings:
        return self

    def __exit__(self, kind, _value, _traceback) -> None:
        if kind is None:
            self.raise_found()

    def add(self, error: UserError) -> None:
        self.errors.extend(error.errors if isinstance(error, ConfigErrors) else [error])

    def check(self, rule, *args, **kwargs) -> bool:
        """Run ``rule(*args, **kwargs)``; False (its error kept) when it raised a UserError."""
        try:
            rule(*args, **kwargs)
        except UserError as error:
            self.add(error)
            return False
        return True

    def require(self, ok: bool, message: str) -> bool:
        """One rule: a :class:`ConfigError` line kept unless ``ok``; returns ``ok``."""
        if not ok:
            self.errors.append(ConfigError(message))
        return ok

    def raise_found(self) -> None:
        if len(self.errors) == 1:
            raise self.errors[0]
        if self.errors:
            raise ConfigErrors(self.errors)
