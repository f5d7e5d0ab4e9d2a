"""Trace once per machine: decoding programs stored beside the compiled executables.

    models.use_compile_cache()        # the command lines do it; so does bench.compile_cache
    decode.generate(model, params, prompts, lengths, max_new_tokens=8)   # stored, or reused

JAX's persistent compilation cache spares a second process the compilation of a decoding
call, not its Python tracing: every process traces the model again (its three calls into
Flax, each parameter's shape check, the loop) and lowers the program before the cache can
find the executable, about 0.5 s for the small encoder-decoder `make demo` trains. With
the cache on, `call` stores the program the first process traces (`jax.export`: the
lowered StableHLO and its input and output trees) in `models.compile_cache.
trace_directory()`, and a later process with the same key runs the stored program: no
tracing, no lowering of the model; JAX's cache then finds its executable. The outputs are
the same arrays, bit for bit.

The key is a sha256 of everything the traced program depends on:

    the project's source (every .py file of the `models` and `decode` packages)
    Python's version and those of jax, jaxlib, flax, numpy and ml_dtypes
    JAX's configuration as it is in effect (each option's value, context managers included)
    the backend and its devices' kinds
    the call's name, the model (its config, in full), the static keywords
    each traced argument's tree, shape, dtype, weak type and memory kind

A call runs as it always did (traced, and nothing stored) when: the cache is off (the
default for a library user, and the test suite's), an argument is traced (inside your own
`jit`, `grad` or `vmap`), an array spans several devices, a mesh is in effect (a
`jax.sharding` mesh, `models.axes.sharded_activations`), a model's class is not one of
`models` (a subclass of your own: its code is not in the key), a static value has no
stable description (a repr naming an address), or `jax.export` cannot keep the program.
A stored file that cannot be read is a miss and is written again. What the key cannot see
is code changed while a process runs (a function of `models` or `decode` monkeypatched):
turn the cache off for that (`--no-compile-cache`).

On CPU, calling a stored program first initialises JAX's LAPACK kernels, which imports
scipy (about 0.15 s, once per process): most of what a second process's first call still
costs besides reading its executable.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import os
import pickle
import sys
from collections.abc import Callable

import flax.linen as nn
import jax
import numpy as np

import models
from models import axes, compile_cache
from models.atomic import temporary_name
from models.errors import UserError

FORMAT = 1                       # of the stored files: a new one never reads an older one
_SUFFIX = ".exported"            # (never "-cache": JAX's own files in that directory)
_LIBRARIES = ("jax", "jaxlib", "flax", "numpy", "ml_dtypes")
# The packages whose code runs while a decoding call is traced.
_PACKAGES = (os.path.dirname(os.path.abspath(models.__file__)),
             os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class _Key:
    """What decides a call's traced program besides the source and the libraries."""

    name: str
    model: object
    static: tuple
    tree: object
    leaves: tuple                 # each traced array's (type, weak type, memory kind)
    config: tuple                 # JAX's options in effect
    description: str              # name, model, static keywords and tree, as text

    def path(self, directory: str) -> str:
        h = hashlib.sha256(_environment())
        h.update(repr((self.description, self.leaves, self.config)).encode())
        return os.path.join(directory, f"{self.name}-{h.hexdigest()}{_SUFFIX}")


# In this process: key -> the stored program's jitted call; keys `jax.export` refused.
_calls: dict[_Key, Callable] = {}
_refused: set[_Key] = set()


def call(name: str, computation: Callable, args: tuple, static: dict):
    """`computation(*args, **static)`, through the stored program when there is one.

    Args:
        name: the public call's name ("generate"), part of the key.
        computation: the jitted computation, a function of the `decode` package (its
            source is in the key, and `name` names it).
        args: `(model, *traced)`: the model (static) and the traced arguments.
        static: the static keywords.
    """
    directory = compile_cache.trace_directory()
    key = None if directory is None else _key(name, args, static)
    if key is None or key in _refused:
        return computation(*args, **static)
    run = _calls.get(key)
    if run is None:
        exported = _stored(key.name, key.path(directory), computation, args, static)
        if exported is None:
            _refused.add(key)
            return computation(*args, **static)
        run = _calls[key] = jax.jit(exported.call)
    return run(*args[1:])


def _key(name: str, args: tuple, static: dict) -> _Key | None:
    """What decides the traced program besides the source and the libraries, as a
    hashable value; None where the call cannot be stored (see the module docstring)."""
    model, *traced = args
    leaves, tree = jax.tree.flatten(traced)
    described = []
    for x in leaves:
        if isinstance(x, jax.core.Tracer) or not isinstance(x, (jax.Array, np.ndarray,
                                                                 np.generic)):
            return None
        if isinstance(x, jax.Array) and len(x.sharding.device_set) != 1:
            return None
        aval = jax.typeof(x)
        described.append((str(aval), bool(getattr(aval, "weak_type", False)),
                          str(getattr(getattr(x, "sharding", None), "memory_kind", None))))
    modules = [m for m in (model, *static.values()) if isinstance(m, nn.Module)]
    if _mesh_in_effect() or not all(_ours(type(m)) for m in modules):
        return None
    config = _configuration()
    static_items = tuple(sorted(static.items()))
    text = repr((name, model, static_items, str(tree)))
    if config is None or " at 0x" in text:
        return None
    return _Key(name, model, static_items, tree, tuple(described), config, text)


def _ours(cls: type) -> bool:
    """Whether `cls` is defined in a hashed package (a model class of your own is not: its
    code is not in the key)."""
    module = sys.modules.get(cls.__module__)
    path = os.path.abspath(getattr(module, "__file__", None) or "/")
    return any(path.startswith(root + os.sep) for root in _PACKAGES)


def _mesh_in_effect() -> bool:
    if not jax.sharding.get_abstract_mesh().empty or axes._ACTIVE.get() is not None:
        return True
    try:                                     # the older `with mesh:` context
        from jax._src import mesh as mesh_lib
        return not mesh_lib.thread_resources.env.physical_mesh.empty
    except (ImportError, AttributeError):
        return True


def _configuration() -> tuple | None:
    """Every JAX option's value in effect here (a context manager's included), or None
    where this JAX does not list them."""
    try:
        from jax._src.config import config_states
        return tuple((name, repr(state.value)) for name, state in sorted(config_states.items()))
    except (ImportError, AttributeError):
        return None


@functools.cache
def _environment() -> bytes:
    """The source of the traced packages, the libraries and the devices, hashed."""
    h = hashlib.sha256(f"format {FORMAT}; python {sys.version}".encode())
    for library in _LIBRARIES:
        try:
            version = importlib.metadata.version(library)
        except importlib.metadata.PackageNotFoundError:
            version = "none"
        h.update(f"; {library} {version}".encode())
    for root in _PACKAGES:
        for folder, dirs, files in os.walk(root):
            dirs.sort()
            for file in sorted(f for f in files if f.endswith(".py")):
                path = os.path.join(folder, file)
                with open(path, "rb") as f:
                    source = f.read()
                h.update(f"; {os.path.relpath(path, root)} {len(source)} ".encode())
                h.update(source)
    devices = jax.devices()
    h.update(f"; {jax.default_backend()} {[d.device_kind for d in devices]}".encode())
    return h.digest()


def _stored(name: str, path: str, computation, args: tuple, static: dict):
    """The program `name` stored at `path`: read, or traced, exported and written; None
    where `jax.export` cannot keep it."""
    try:
        with open(path, "rb") as f:
            exported = pickle.load(f)
        if isinstance(exported, jax.export.Exported):
            return exported
    except Exception:     # none yet, or a damaged or foreign file: a miss, written below
        pass
    model, *traced = args

    def program(*traced):
        return computation(model, *traced, **static)

    program.__name__ = program.__qualname__ = name          # as JAX's logs name it
    try:
        exported = jax.export.export(jax.jit(program))(*traced)
    except UserError:
        raise
    except Exception:           # a program export cannot keep (a custom call it does not
        return None             # hold stable, ...): the call runs as usual, and re-raises
    exported = dataclasses.replace(exported, _get_vjp=None)   # a local function: no pickle
    _write(path, pickle.dumps(exported, protocol=pickle.HIGHEST_PROTOCOL))
    return exported


_warned: list[str] = []


def _write(path: str, data: bytes) -> None:
    """`path` holds `data`, or nothing new (a warning once, as the compile cache's)."""
    tmp = temporary_name(path)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        if not _warned:
            _warned.append(path)
            print(f"warning: no stored decoding programs: cannot write {path} ({e.strerror})",
                  file=sys.stderr)
