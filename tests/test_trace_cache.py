"""decode.trace_cache: a decoding call's program stored once per machine gives the same
arrays as tracing it, is used without tracing, is keyed on what decides it, and is never
used where it could be wrong (traced or sharded arguments, a mesh, a damaged file)."""

import functools
import os

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import decode
from decode import trace_cache
from models import compile_cache
from models.errors import UserError
from tests.helpers import fns, tiny

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14]]


@functools.cache
def setup(arch):
    f = fns(tiny(arch))
    prompts, lengths = decode.pad_prompts(PROMPTS)
    return f.model, f.init(), prompts, lengths


@pytest.fixture
def fresh_environment():
    """The hashed source read again after the test (which points it elsewhere)."""
    trace_cache._environment.cache_clear()
    yield
    trace_cache._environment.cache_clear()


@pytest.fixture
def stored(tmp_path, monkeypatch):
    """The trace cache on, in a fresh directory, with nothing held in this process."""
    directory = tmp_path / "traces"
    monkeypatch.setattr(compile_cache, "_trace_directory", str(directory))
    monkeypatch.setattr(trace_cache, "_calls", {})
    monkeypatch.setattr(trace_cache, "_refused", set())
    return directory


def _files(directory) -> list[str]:
    return sorted(os.listdir(directory)) if os.path.isdir(directory) else []


def _assert_same(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


CALLS = [
    ("decoder_only", decode.generate, dict(max_new_tokens=5, temperature=0.8, top_p=0.9,
                                            banned_ids=(4,), no_repeat_ngram_size=2,
                                            rng=jax.random.key(1))),
    ("encoder_decoder", decode.beam_search, dict(max_new_tokens=5, beam_size=3)),
]


@pytest.mark.parametrize("arch, call, options", CALLS)
def test_a_stored_program_gives_the_same_arrays_and_is_not_traced_again(
        stored, monkeypatch, arch, call, options):
    model, params, prompts, lengths = setup(arch)
    args, static = call.arguments(model, params, prompts, lengths, **options)
    traced = call.computation(*args, **static)
    first = call(model, params, prompts, lengths, **options)        # traced, then stored
    _assert_same(first, traced)
    assert len(_files(stored)) == 1 and _files(stored)[0].startswith(call.__name__ + "-")
    # A new process: nothing held in memory, and the computation must not run.
    monkeypatch.setattr(trace_cache, "_calls", {})

    def not_traced(*args, **kwargs):
        raise AssertionError("traced again")

    _assert_same(trace_cache.call(call.__name__, not_traced, args, static), traced)


def test_the_key_holds_the_shapes_the_static_values_the_options_and_the_source(
        stored, monkeypatch, tmp_path, fresh_environment):
    model, params, prompts, lengths = setup("decoder_only")

    def path(prompts=prompts, lengths=lengths, max_new_tokens=4, temperature=0.5):
        args, static = decode.generate.arguments(
            model, params, prompts, lengths, max_new_tokens=max_new_tokens,
            temperature=temperature, rng=jax.random.key(0))
        return trace_cache._key("generate", args, static).path(str(stored))

    first = path()
    assert path() == first                                      # the same call, the same key
    assert path(temperature=0.7) == first                       # a traced value: the same
    others = {path(max_new_tokens=3),                           # a static value
              path(prompts[:1], lengths[:1])}                   # a shape
    with jax.default_matmul_precision("highest"):               # a JAX option in effect
        others.add(path())
    assert first not in others and len(others) == 3
    # The project's source: one byte changed in a traced package is a new key.
    package = tmp_path / "package"
    package.mkdir()
    (package / "layer.py").write_text("x = 1\n")
    monkeypatch.setattr(trace_cache, "_PACKAGES", (*trace_cache._PACKAGES, str(package)))
    trace_cache._environment.cache_clear()
    before = path()
    (package / "layer.py").write_text("x = 2\n")
    trace_cache._environment.cache_clear()
    assert path() != before


def test_traced_and_sharded_calls_and_meshes_are_not_stored(stored):
    model, params, prompts, lengths = setup("decoder_only")
    inside = jax.jit(lambda p: decode.generate(model, p, prompts, lengths,
                                               max_new_tokens=3).tokens)(params)
    assert _files(stored) == []
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    replicated = jax.device_put(params, NamedSharding(mesh, P()))
    spread = decode.generate(model, replicated, prompts, lengths, max_new_tokens=3)
    assert _files(stored) == []
    with jax.set_mesh(mesh):
        decode.generate(model, params, prompts, lengths, max_new_tokens=3)
    assert _files(stored) == []
    np.testing.assert_array_equal(inside, spread.tokens)


def test_a_model_class_of_your_own_is_not_stored(stored):
    """Its code is not in the key, so a changed method would not be seen."""
    model, params, prompts, lengths = setup("decoder_only")
    mine = type("MyDecoder", (type(model),), {})(model.config)
    decode.generate(mine, params, prompts, lengths, max_new_tokens=2)
    assert _files(stored) == []


def test_a_damaged_file_is_a_miss_and_is_written_again(stored, monkeypatch):
    model, params, prompts, lengths = setup("decoder_only")
    want = decode.generate(model, params, prompts, lengths, max_new_tokens=3)
    (path,) = _files(stored)
    (stored / path).write_bytes(b"not a program")
    monkeypatch.setattr(trace_cache, "_calls", {})
    _assert_same(decode.generate(model, params, prompts, lengths, max_new_tokens=3), want)
    monkeypatch.setattr(trace_cache, "_calls", {})
    assert (stored / path).read_bytes() != b"not a program"
    _assert_same(decode.generate(model, params, prompts, lengths, max_new_tokens=3), want)


def test_a_program_export_cannot_keep_runs_as_usual_and_user_errors_pass_through(
        stored, monkeypatch):
    model, params, prompts, lengths = setup("decoder_only")
    args, static = decode.generate.arguments(model, params, prompts, lengths, max_new_tokens=2)
    want = decode.generate.computation(*args, **static)

    def refuse(fn):
        raise ValueError("a custom call export does not keep")

    with monkeypatch.context() as m:
        m.setattr(jax.export, "export", refuse)
        _assert_same(decode.generate(model, params, prompts, lengths, max_new_tokens=2), want)
    assert _files(stored) == [] and len(trace_cache._refused) == 1

    def user_mistake(*args, **kwargs):
        raise UserError("named by the model")

    with pytest.raises(UserError, match="named by the model"):
        trace_cache.call("generate", user_mistake, *decode.generate.arguments(
            model, params, prompts, lengths, max_new_tokens=1))
    assert _files(stored) == []


def test_the_cache_is_off_unless_the_compile_cache_is_on():
    """The suite's processes (conftest) and a library user who never called
    models.use_compile_cache store nothing."""
    assert compile_cache.trace_directory() is None
    model, params, prompts, lengths = setup("decoder_only")
    decode.generate(model, params, prompts, lengths, max_new_tokens=2)
    assert not trace_cache._calls and not trace_cache._refused
