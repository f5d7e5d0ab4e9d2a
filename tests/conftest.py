"""One strict test environment: 4 fake CPU devices for pmap, rank promotion raises.

`ZOO_TEST_PLATFORM=cuda` (or `rocm`, `tpu`) runs the chosen tests on that machine's
accelerator instead (`python -m bench.accelerator` does, with the tests that can use one):
JAX on that platform alone (no silent fall-back to the CPU), no fake devices (a test that
needs four is not for that run), no CPU compiler flags, and float32 matrix products at full
precision, as on a CPU (a GPU's default is TF32, which the suite's float32 tolerances do
not allow).
"""

import gc
import importlib.metadata
import os
import tempfile

TEST_PLATFORM = os.environ.get("ZOO_TEST_PLATFORM", "cpu")
ON_CPU = TEST_PLATFORM == "cpu"
# Before JAX is imported anywhere: simulate 4 devices so multi-device code runs on CPU, and
# compile for speed of compilation, not of the code: with tiny configs XLA's CPU compiler is
# most of the suite's time, and these halve it (JAX's `jax_disable_most_optimizations`: LLVM
# -O0 for each program it compiles; classic loop fusions). What a program computes does not
# depend on them; tolerances are unchanged. A test whose time goes into running many steps
# rather than compiling asks for optimised code with the `optimized_code` fixture below.
# (jaxlib 0.11's XLA has no fusion-emitter switch, and an unknown flag is fatal.)
_JAXLIB = tuple(int(x) for x in importlib.metadata.version("jaxlib").split(".")[:2])
FAST_COMPILE_XLA_FLAGS = ("--xla_cpu_use_fusion_emitters=false" if _JAXLIB < (0, 11) else "")
FAST_COMPILE_ENV = {"JAX_DISABLE_MOST_OPTIMIZATIONS": "1"}
TEST_XLA_FLAGS = f"--xla_force_host_platform_device_count=4 {FAST_COMPILE_XLA_FLAGS}".strip()
if ON_CPU:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + TEST_XLA_FLAGS).strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    for name, value in FAST_COMPILE_ENV.items():     # JAX_DISABLE_MOST_OPTIMIZATIONS=0
        os.environ.setdefault(name, value)            # runs the whole suite optimised
else:
    os.environ["JAX_PLATFORMS"] = TEST_PLATFORM
# The command lines keep compiled executables in the user's cache directory: the ones the
# tests start as processes keep them in a directory of the test session's instead.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="zoo-test-cache-")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
if not ON_CPU:
    jax.config.update("jax_default_matmul_precision", "highest")

# No persistent compilation cache in the test processes: measured over `-m "not slow"`, a
# fifth of the programs were found on disk, but at the suite's optimisation level reading
# one (5 ms) saved nothing over compiling it again, while writing the others cost 3-5 ms
# each: 29 s of the edit loop's 890 worker-seconds lost, none won. The command lines
# the tests start keep theirs (XDG_CACHE_HOME above); tests/test_cli.py tests that cache.


@pytest.fixture
def optimized_code(monkeypatch):
    """For a test whose time goes into running many steps (a run that must learn, a
    benchmark's quick run): its programs, and those of the processes it starts, are compiled
    with XLA's optimisations, which run such a test up to twice as fast as the suite's
    fast-compile default (a program compiled before it by another test is reused as it is)."""
    monkeypatch.setenv("JAX_DISABLE_MOST_OPTIMIZATIONS", "0")
    before = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", False)
    yield
    jax.config.update("jax_disable_most_optimizations", before)


@pytest.fixture(autouse=True)
def _no_process_wide_compile_cache(monkeypatch):
    """A command line run in the test process leaves the process's compilation cache as
    the suite set it (tests/test_cli.py runs them as processes to test the user's cache)."""
    import models
    from models import compile_cache
    monkeypatch.setattr(models, "use_compile_cache", lambda given=None: None)
    monkeypatch.setattr(compile_cache, "_trace_directory", None)   # nor stores programs


@pytest.fixture(autouse=True, scope="module")
def _compiled_programs_per_module():
    """Each test worker lives for the whole suite; the programs one module compiles are
    dropped after it (modules rarely share shapes), so a worker's memory stays bounded (and
    the module's garbage is collected, which the tuned collector below may have left)."""
    yield
    jax.clear_caches()
    gc.collect()


@pytest.fixture(autouse=True, scope="session")
def _prepared_examples_read_once():
    """Each prepared TFDS split's examples are read from disk once per test process, then
    kept: parsing them costs about 15 us an example (20,000-50,000 examples a split, read
    for the tokenizer, the tokens and the labels), and the suite trains hundreds of runs on the
    same few prepared datasets. Keyed on the prepared directory, which names the dataset,
    its config (a local dataset's hashes its files' paths and contents) and version, so a
    changed dataset is read from disk. Runs started as processes read as a user's do.
    Without TFDS (an accelerator's image, running tests that read no dataset) there is
    nothing to keep."""
    import importlib.util
    if importlib.util.find_spec("tensorflow_datasets") is None:
        yield
        return
    from tensorflow_datasets.core.data_sources.array_record import ArrayRecordDataSource

    from train.data.datasets import Dataset
    kept: dict[tuple, dict[int, object]] = {}

    def read_once(method, key_of):
        def read(self, split, indices):
            source = self.split(split)
            if type(source) is not ArrayRecordDataSource:
                return method(self, split, indices)
            indices = [int(i) for i in indices]
            got = kept.setdefault((method.__name__, str(source.dataset_info.data_dir),
                                   str(source.split), key_of(self)), {})
            missing = sorted(set(indices) - got.keys())
            if missing:
                got.update(zip(missing, method(self, split, missing), strict=True))
            return [got[i] for i in indices]
        return read

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Dataset, "_records", read_once(Dataset._records, lambda d: ()))
        patch.setattr(Dataset, "examples", read_once(Dataset.examples, lambda d: d.keys))
        yield


@pytest.fixture
def key():
    return jax.random.key(0)


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """One TFDS data directory per test process, so each builder prepares once."""
    import tensorflow_datasets as tfds
    tfds.disable_progress_bar()
    return str(tmp_path_factory.mktemp("tfds"))


SLOW_TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "slow_tests.txt")


@pytest.hookimpl(tryfirst=True)          # before `-m` deselects by marker
def pytest_collection_modifyitems(items):
    """The tests that slow_tests.txt names (those of 1.5 s or more in a full run, written by
    tests/mark_slow.py) are marked slow, so `pytest -m "not slow"` leaves them out.
    The long tests run first (each worker of `-n 2` starts one), so the many short ones fill
    the gaps instead of leaving one worker alone with a notebook at the end."""
    with open(SLOW_TESTS) as f:
        slow = {line.strip() for line in f if line.strip() and not line.startswith("#")}
    for item in items:
        if item.nodeid in slow:
            item.add_marker(pytest.mark.slow)
    long_first = {"test_notebooks.py": 0, "test_train_loop.py": 1}
    items.sort(key=lambda item: long_first.get(item.path.name, 2))


def pytest_collection_finish(session):
    """Python's cycle collector, tuned for a process that traces many programs: what the
    imports and the collection made is frozen (never scanned again), and the youngest
    generation is collected every 10,000 allocations, not 700. Tracing and lowering make
    and drop many short-lived objects, and at the default threshold the collector scanned
    the test process's millions of objects over and over: measured on tests/test_generate.py
    (-n 0, two runs each), 10% of its wall time (78 s to 70 s). Nothing a test computes
    depends on when unreachable objects are freed."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 10, 10)
