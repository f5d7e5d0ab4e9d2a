"""The notebooks run top to bottom with their default settings, as a user would run them.

Each runs in a fresh Jupyter kernel of this interpreter, in a scratch directory, with the
user's defaults: one CPU device and XLA's normal optimisation (the suite's fake devices and
fast-compile flags are taken out of the kernel's environment). A cell that raises fails the
test, and so does any `assert` a notebook makes about what it shows.
"""

import os
import time

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         "notebooks")
BUDGET_S = 120      # the limit per notebook on 2 CPU cores, with default settings


@pytest.mark.slow
@pytest.mark.parametrize("name", ["attention_masks", "kv_cache_and_scan", "translate_toy",
                                  "pretrained_seq2seq", "masked_lm", "sequence_training"])
def test_notebook_runs_top_to_bottom(name, tmp_path, data_dir, monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("TFDS_DATA_DIR", data_dir)
    monkeypatch.setenv("PYTHONPATH", os.path.dirname(NOTEBOOKS))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(os.path.join(NOTEBOOKS, f"{name}.ipynb"), as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), \
        "notebooks are committed with their outputs stripped"
    start = time.perf_counter()
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    # Reported, not asserted: the suite's other tests share the CPU with this one.
    print(f"{name}: {time.perf_counter() - start:.0f} s (budget {BUDGET_S} s on an idle machine)")
