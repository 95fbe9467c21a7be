"""The notebooks in notebooks/ run top to bottom in a fresh kernel of this interpreter.

Each notebook checks its own numbers against a second path through the library (scores against
the prefill distribution, a jitted vmap against the batched call, a min-p loop at min_p = 1
against greedy generation, a hand-written layer loop against `hidden_states`); a failed assert
fails the cell and the test. Here we also check that the figures were drawn and that the stored
notebooks carry no outputs.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
NAMES = ["quickstart.ipynb", "functional_api.ipynb"]
KERNEL = "rjax-test-python"
TIMEOUT_S = 900  # per cell; CPU compiles on a loaded 2-core machine


@pytest.fixture(scope="module")
def kernel_env(tmp_path_factory, smollm2_path):
    """A kernelspec that starts this very interpreter, found through JUPYTER_PATH, so the test
    needs no kernel registered on the machine (a fresh CI box has only .venv)."""
    from ipykernel.kernelspec import write_kernel_spec

    root = tmp_path_factory.mktemp("jupyter")
    spec = write_kernel_spec(root / "kernels" / KERNEL)
    kernel_json = Path(spec) / "kernel.json"
    data = json.loads(kernel_json.read_text())
    assert data["argv"][0] == sys.executable, data["argv"]
    data["display_name"] = "rjax tests"
    kernel_json.write_text(json.dumps(data))
    return root


def _image_count(nb) -> int:
    return sum("image/png" in out.get("data", {}) for cell in nb.cells if cell.cell_type == "code"
               for out in cell.outputs)


def _text(nb) -> str:
    parts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            parts.append(out.get("text", ""))
            parts.append(out.get("data", {}).get("text/plain", ""))
    return "\n".join(parts)


@pytest.mark.parametrize("name", NAMES)
def test_notebook_is_stored_without_outputs(name):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    nbformat.validate(nb)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{name} cell {i} has stored outputs"


# What each notebook must show besides running: (figures drawn, strings in its output).
EXPECTED = {
    "quickstart.ipynb": (2, ["llama.cpp chunks:  PPL =", "strided windows:   PPL =", "messages in the history"]),
    "functional_api.ipynb": (1, ["KVCache(", "jit(vmap(...)):", "vmap over prompts:", "NotDifferentiableError:",
                                 "after a step along the gradient", "max |own loop - rjax|"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs(name, kernel_env, monkeypatch):
    monkeypatch.setenv("JUPYTER_PATH", str(kernel_env))
    # Non-interactive: figures are rendered with Agg into PNG outputs (plain "Agg" would make
    # plt.show() a no-op and leave nothing to check).
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=TIMEOUT_S, kernel_name=KERNEL,
                                     resources={"metadata": {"path": str(NOTEBOOKS)}})
    client.execute()  # raises CellExecutionError, with the cell and traceback, on any error
    images, strings = EXPECTED[name]
    assert _image_count(nb) == images, f"{name}: expected {images} figures, got {_image_count(nb)}"
    text = _text(nb)
    for s in strings:
        assert s in text, f"{name}: {s!r} not in the output"
