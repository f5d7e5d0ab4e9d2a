"""JAX's persistent compilation cache: compile once per machine, not once per process.

    import models
    models.use_compile_cache()      # before the first jitted call; the command lines do it

Every new process compiles its jitted functions again (the decode loop, beam search, a
train step: seconds each). With the cache on, a process finds the executables an earlier
one compiled for the same program, shapes, backend and JAX version on disk, and loads them
instead. `python -m decode` and `python -m train` turn it on by default in the user's cache
directory (`$XDG_CACHE_HOME/jax-transformer-zoo/xla`, else `~/.cache/...`); `--no-compile-
cache` and `--config.compile_cache=false` turn it off.

Tracing is kept too: a process that turned the cache on stores the programs it traces for
decoding in `trace_directory()`, a folder inside the cache directory, so that a later
process neither traces nor lowers them again (`decode.trace_cache` says what the stored
programs are keyed on and when a call is not stored).

JAX's own settings win: a cache directory already chosen (the `JAX_COMPILATION_CACHE_DIR`
environment variable, or `jax.config.update("jax_compilation_cache_dir", ...)`) is used as
it is, and so is a minimum compile time set by `JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS`;
without one, every executable is cached, small ones included (a decode call's argument
checks compile a few, and they add up).
"""

from __future__ import annotations

import os
import sys

import jax

APP = "jax-transformer-zoo"
TRACES = "traces"           # the folder of stored programs inside the cache directory

_trace_directory: str | None = None


def default_directory() -> str:
    """The user's cache directory for the project's compiled executables."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, APP, "xla")


def use_compile_cache(given: str | None = None) -> str | None:
    """Turns JAX's persistent compilation cache on and returns its directory.

    Args:
        given: where to keep the executables (default `default_directory()`); a
            directory JAX's own settings already chose is kept instead.

    Returns:
        The directory in use, or None when it cannot be created (a warning on stderr says
        why; everything then compiles as without the cache).
    """
    global _trace_directory
    directory = jax.config.jax_compilation_cache_dir
    if not directory:
        directory = default_directory() if given is None else given
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as e:
            print(f"warning: no compilation cache: cannot create {directory} ({e.strerror})",
                  file=sys.stderr)
            return None
        jax.config.update("jax_compilation_cache_dir", directory)
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    if "://" not in directory:                 # a local folder (JAX also takes gs://...)
        _trace_directory = os.path.join(directory, TRACES)
    return directory


def trace_directory() -> str | None:
    """Where this process stores traced programs: None until `use_compile_cache` turned
    the cache on (in a local folder)."""
    return _trace_directory
