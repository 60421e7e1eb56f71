"""notebooks/llava_stateful_sessions.ipynb runs top to bottom locally (tiny model, local TorchServe)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "llava_stateful_sessions.ipynb"


def _python3_kernel() -> None:
    """Make sure a ``python3`` kernel spec exists (ipykernel ships one; install it into the venv if not)."""
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        KernelSpecManager().get_kernel_spec("python3")
        return
    except NoSuchKernel:
        pass
    done = subprocess.run(
        [sys.executable, "-m", "ipykernel", "install", "--sys-prefix", "--name", "python3"],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"no python3 Jupyter kernel and `ipykernel install --sys-prefix` failed: {done.stderr[-500:]}")


def test_notebook_runs_locally(monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    _python3_kernel()
    monkeypatch.delenv("LLAVA_NOTEBOOK_SAGEMAKER", raising=False)  # never touch AWS from a test
    monkeypatch.delenv("LLAVA_MODEL_DIR", raising=False)
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        nb, kernel_name="python3", timeout=180, resources={"metadata": {"path": str(NOTEBOOK.parent)}}
    )
    client.execute()

    outputs = {}
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            text = "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")
            outputs[i] = text
            assert not [o for o in cell.outputs if o.output_type == "error"], cell.source
    everything = "\n".join(outputs.values())
    assert "mode: local TorchServe" in everything
    assert "session: ts-seq-" in everything and "closed: True" in everything
    assert "reused (cached) prompt tokens:" in everything and "local server stopped" in everything
    images = [
        o
        for cell in nb.cells
        if cell.cell_type == "code"
        for o in cell.outputs
        if o.output_type == "display_data" and "image/png" in o.get("data", {})
    ]
    assert len(images) == 1  # the photograph, shown inline
    assert os.environ.get("LLAVA_NOTEBOOK_SAGEMAKER") is None
