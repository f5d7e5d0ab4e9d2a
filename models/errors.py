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


def is_int(value) -> bool:
    """An integral number: a Python int or a numpy integer scalar, never a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_positive_int(value, name: str) -> int:
    """`value` as an int >= 1 (numpy integer scalars accepted), else a UserError naming it."""
    if not is_int(value) or value < 1:
        raise UserError(f"{name}={value!r} must be a positive int")
    return int(value)
