"""Every notebook in notebooks/ runs top to bottom in a fresh kernel (default model, offline).

The notebooks are committed with their outputs (plots included) so they read on the web; the test
re-executes a copy and fails on any error. To refresh the committed outputs after a change:

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python tests/test_notebooks.py [NAME ...]
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

FOLDER = Path(__file__).resolve().parent.parent / "notebooks"
NAMES = ["01_langchain_rag_swap", "02_llamaindex_query_engine", "03_multiturn_chat", "04_memory"]


def execute(path: Path):
    """Run `path` in a fresh kernel and return the executed notebook (CellExecutionError on a failing cell)."""
    notebook = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    client.execute()
    return notebook


def test_the_notebooks_are_exactly_these():
    assert sorted(p.stem for p in FOLDER.glob("*.ipynb")) == NAMES


@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs_and_is_committed_with_outputs(name: str):
    path = FOLDER / f"{name}.ipynb"
    committed = nbformat.read(path, as_version=4)
    code = [cell for cell in committed.cells if cell.cell_type == "code"]
    assert code and all(cell.get("execution_count") for cell in code), \
        f"{path.name}: commit it executed (python tests/test_notebooks.py {name})"
    execute(path)


if __name__ == "__main__":
    for name in sys.argv[1:] or NAMES:
        target = FOLDER / f"{name}.ipynb"
        nbformat.write(execute(target), target)
        print("executed", target)
