"""How the train command lines (`python -m train`, `python -m train.export`) end on an
exception: one `error:` line for what the user can fix, the traceback for a bug.

    UserError (a config value, an argument, a checkpoint, or one a host callback raised
        inside a step: `models.errors.raise_from_host`), OSError (a path, a full disk,
        a workdir in use)           -> error: MESSAGE                          exit 2
    FloatingPointError (a NaN or Inf loss or state)
                                    -> error: MESSAGE                          exit 1
    anything else                   -> the traceback, then
                                       error: internal error (a bug in jax-transformer-zoo
                                       or a library it uses): TYPE: MESSAGE    exit 1

`--verbose` adds the traceback to the first two.
"""

from __future__ import annotations

import sys
import traceback

from models.errors import UserError, from_host

USAGE, FAILED = 2, 1
INTERNAL = "internal error (a bug in jax-transformer-zoo or a library it uses)"


def report(error: BaseException, *, verbose: bool = False) -> int:
    """Prints `error` as the table above says (on stderr); returns the exit status.

    Call it from an `except` block: the traceback printed is the one being handled.
    """
    error = from_host(error) or error
    if isinstance(error, (UserError, OSError)):
        status, line = USAGE, str(error)
    elif isinstance(error, FloatingPointError):
        status, line = FAILED, str(error)
    else:
        status, line = FAILED, f"{INTERNAL}: {type(error).__name__}: {error}"
        verbose = True
    if verbose:
        traceback.print_exc()
    print(f"error: {line}", file=sys.stderr, flush=True)
    return status
