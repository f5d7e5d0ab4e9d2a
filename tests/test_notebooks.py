"""The notebooks run top to bottom, as a user would run them, with smaller budgets.

Each runs in a fresh Jupyter kernel of this interpreter, in a scratch directory, with one CPU
device as a user has (the suite's fake devices are taken out of the kernel's environment).
A notebook is a test of its text and its code, so two things are changed that neither its
code nor its assertions depend on:
- the suite's fast-compile flags: XLA's optimisation level changes how long compiling takes
  (most of a tiny notebook's time), not what a cell computes;
- `SMALLER`: a notebook's parameter cell (its first code cell) sets its budget, and the test
  runs a cell of smaller values right after it. Every name given must be assigned in that
  cell, so a renamed parameter fails here instead of being silently ignored.
A cell that raises fails the test, and so does any `assert` a notebook makes about what it
shows (masked_lm's "trained below chance" keeps its default budget for that reason).
"""

import ast
import os
import time

import nbformat
import pytest
from nbclient import NotebookClient

from tests.conftest import FAST_COMPILE_XLA_FLAGS

NOTEBOOKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         "notebooks")
BUDGET_S = 120      # the limit per notebook on 2 CPU cores, with default settings

# Smaller budgets, as Python source: each line assigns a name of the parameter cell.
SMALLER = {
    "translate_toy": "NUM_TRAIN_STEPS = 20\nBATCH_SIZE = 4",
    "kv_cache_and_scan": "LENGTHS = (32, 256)\nREPEATS = 1\nNO_CACHE_STEPS = 4",
    "sequence_training": "BASE_STEPS = 10\nBUDGET_S = 0.5\nSLICE_S = 0.5\nTEST_PAIRS = 4",
    "post_training": "CHAT_STEPS = 4\nDPO_STEPS = 4\nGRPO_STEPS = 4",
}


def assigned_names(source: str) -> set[str]:
    """The names a cell's top-level statements assign."""
    return {target.id for node in ast.parse(source).body if isinstance(node, ast.Assign)
            for target in node.targets if isinstance(target, ast.Name)}


def with_smaller_budget(nb, smaller: str | None):
    """`nb` with the cell `smaller` right after its parameter cell (as it is for None)."""
    if smaller is None:
        return nb
    code = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    params = nb.cells[code[0]]
    unknown = assigned_names(smaller) - assigned_names(params.source)
    assert not unknown, f"{sorted(unknown)} are not set by the notebook's parameter cell"
    nb.cells.insert(code[0] + 1, nbformat.v4.new_code_cell(smaller))
    return nb


def test_a_smaller_budget_follows_the_parameter_cell_and_names_only_its_names():
    def notebook():
        return nbformat.v4.new_notebook(cells=[
            nbformat.v4.new_markdown_cell("# title"),
            nbformat.v4.new_code_cell("STEPS = 300  # a budget\nDIR = 'x'"),
            nbformat.v4.new_code_cell("print(STEPS)")])

    assert [c.source for c in with_smaller_budget(notebook(), "STEPS = 3").cells] == [
        "# title", "STEPS = 300  # a budget\nDIR = 'x'", "STEPS = 3", "print(STEPS)"]
    with pytest.raises(AssertionError, match=r"\['STEPZ'\] are not set"):
        with_smaller_budget(notebook(), "STEPZ = 3")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["attention_masks", "kv_cache_and_scan", "translate_toy",
                                  "pretrained_seq2seq", "masked_lm", "sequence_training",
                                  "post_training"])
def test_notebook_runs_top_to_bottom(name, tmp_path, data_dir, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", FAST_COMPILE_XLA_FLAGS)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("TFDS_DATA_DIR", data_dir)
    monkeypatch.setenv("PYTHONPATH", os.path.dirname(NOTEBOOKS))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(os.path.join(NOTEBOOKS, f"{name}.ipynb"), as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), \
        "notebooks are committed with their outputs stripped"
    start = time.perf_counter()
    NotebookClient(with_smaller_budget(nb, SMALLER.get(name)), timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    # Reported, not asserted: the suite's other tests share the CPU with this one.
    print(f"{name}: {time.perf_counter() - start:.0f} s")
