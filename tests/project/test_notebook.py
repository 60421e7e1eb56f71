"""notebooks/llava_stateful_sessions.ipynb runs top to bottom locally (tiny model, local TorchServe)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "llava_stateful_sessions.ipynb"


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


def test_make_notebook_s_command_runs_it_and_prints_every_cell(tmp_path):
    """What ``make notebook`` runs (the Makefile's line, as a subprocess): every cell's printed output
    on stdout, rc 0, the executed notebook with the photograph inline; the target asks for Java only
    (the notebook starts TorchServe), not the browser the web page's test needs."""
    pytest.importorskip("nbclient")
    _python3_kernel()
    makefile = (ROOT / "Makefile").read_text()
    target = makefile[makefile.index("\nnotebook:") :].split("\n\n")[0]
    assert "system-deps" not in target.splitlines()[1] and "system_deps.sh demo" in target, target
    (line,) = [x.strip() for x in target.splitlines() if "llava_tools.demo.notebook" in x]
    command = line.replace("$(PY)", sys.executable) + f" --out {tmp_path / 'ran.ipynb'}"
    env = {k: v for k, v in os.environ.items() if k not in ("LLAVA_NOTEBOOK_SAGEMAKER", "LLAVA_MODEL_DIR")}
    env.update(TOKENIZERS_PARALLELISM="false", TMPDIR=str(tmp_path))
    done = subprocess.run(command, shell=True, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    out = done.stdout
    assert out.count("--- cell ") == sum(1 for c in _cells() if c["cell_type"] == "code")
    assert "mode: local TorchServe" in out and "session: ts-seq-" in out and "closed: True" in out
    assert "reused (cached) prompt tokens:" in out and "local server stopped" in out
    assert "[image/png]" in out and out.rstrip().endswith("the notebook ran to the end")
    import nbformat

    ran = nbformat.read(tmp_path / "ran.ipynb", as_version=4)
    images = [
        o
        for cell in ran.cells
        if cell.cell_type == "code"
        for o in cell.outputs
        if o.output_type == "display_data" and "image/png" in o.get("data", {})
    ]
    assert len(images) == 1  # the photograph, shown inline
    assert not [o for c in ran.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]


def test_a_failing_cell_fails_the_run_and_says_why(tmp_path):
    """A cell that raises: rc 1, its error printed under its cell, the later cells not run."""
    nbformat = pytest.importorskip("nbformat")
    _python3_kernel()
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell("print('one')"),
        nbformat.v4.new_code_cell("raise ValueError('the cell broke')"),
        nbformat.v4.new_code_cell("print('never')"),
    ]
    path = tmp_path / "bad.ipynb"
    nbformat.write(nb, path)
    done = subprocess.run(
        [sys.executable, "-m", "llava_tools.demo.notebook", "--notebook", str(path)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert "--- cell 0: print('one')\none\n" in done.stdout
    assert "ValueError: the cell broke" in done.stdout and "never" not in done.stdout


def _cells() -> list:
    import json

    return json.loads(NOTEBOOK.read_text())["cells"]
