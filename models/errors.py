"""The project's error for a user's mistake, and the integer checks everything builds on.

This module imports nothing of the project, so every module may use it.

    raise UserError(f"max_new_tokens={n!r} must be a positive int")

`UserError` is what a user can fix: a bad argument, config value, input or file. Its
message names the value and the limit it breaks. The command lines print it as one
`error:` line and exit with status 2; any other exception is a bug in the project (or in a
library under it) and keeps its traceback (exit status 1). It subclasses `ValueError`, so
code that catches `ValueError` catches it too.
"""

from __future__ import annotations

import numbers


class UserError(ValueError):
    """A mistake the user can fix (an argument, a config value, an input, a file),
    named with its value and the limit it breaks."""


# UserErrors raised in host callbacks (`jax.pure_callback`) inside compiled computations,
# which reach the caller wrapped in JAX's runtime error.
_FROM_HOST: list[UserError] = []


def raise_from_host(error: UserError):
    """Raises `error` from a host callback, keeping it for `from_host`: a command line that
    catches JAX's runtime error around it reports it as the user's mistake."""
    _FROM_HOST.append(error)
    raise error


def from_host(error: BaseException) -> UserError | None:
    """The UserError a host callback raised (`raise_from_host`) when `error` is the error
    JAX raised around it (its message holds the callback's); None otherwise."""
    if isinstance(error, UserError) or not _FROM_HOST:
        return None
    last = _FROM_HOST[-1]
    _FROM_HOST.clear()
    return last if str(last) in str(error) else None


def is_int(value) -> bool:
    """An integral number: a Python int or a numpy integer scalar, never a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_positive_int(value, name: str) -> int:
    """`value` as an int >= 1 (numpy integer scalars accepted), else a UserError naming it."""
    if not is_int(value) or value < 1:
        raise UserError(f"{name}={value!r} must be a positive int")
    return int(value)
