"""``python -m llava_tools.demo.notebook``: run the project's notebook top to bottom and print what
each cell prints (``make notebook``).

The notebook (``notebooks/llava_stateful_sessions.ipynb``) starts its own local TorchServe on the tiny
model and stops it at the end; with ``LLAVA_NOTEBOOK_SAGEMAKER=1`` and AWS credentials it deploys a real
endpoint instead (the notebook's first cells say so). The cells run in a ``python3`` Jupyter kernel
through nbclient (Jupyter's own executor); each code cell's printed output follows its first line as
it finishes, an image as ``[image/png]``. The executed notebook is written to ``--out`` when given.

Exit status: 0 when every cell ran, 1 when a cell raised (its error name and message are printed),
2 for a notebook that is missing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, TextIO

NOTEBOOK = Path(__file__).resolve().parents[3] / "notebooks" / "llava_stateful_sessions.ipynb"

__all__ = ["NOTEBOOK", "cell_text", "main"]


def cell_text(cell: Any) -> str:
    """What a code cell showed, as text: its printed streams, its results' ``text/plain``, an image
    as ``[image/png]`` and an error as ``NAME: message``."""
    parts = []
    for out in cell.get("outputs", []):
        kind = out.get("output_type")
        if kind == "stream":
            parts.append(out.get("text", ""))
        elif kind == "error":
            parts.append(f"{out.get('ename')}: {out.get('evalue')}\n")
        elif kind in ("execute_result", "display_data"):
            data = out.get("data", {})
            parts.append("[image/png]\n" if "image/png" in data else str(data.get("text/plain", "")) + "\n")
    return "".join(parts)


def _printer(out: TextIO) -> Any:
    def on_cell_executed(cell: Any, cell_index: int, **_: Any) -> None:
        if cell.get("cell_type") != "code":
            return
        first = (cell.get("source") or "").strip().splitlines()[:1]
        out.write(f"--- cell {cell_index}: {first[0] if first else ''}\n{cell_text(cell)}")
        out.flush()

    return on_cell_executed


def main(argv: list[str] | None = None, out: TextIO = sys.stdout) -> int:
    """Run the notebook; the exit status is the module docstring's."""
    parser = argparse.ArgumentParser(prog="python -m llava_tools.demo.notebook", description=__doc__.splitlines()[0])
    parser.add_argument("--notebook", type=Path, default=NOTEBOOK, help="the notebook to run (default: the project's)")
    parser.add_argument("--out", type=Path, help="write the executed notebook here (default: nowhere)")
    parser.add_argument("--timeout", type=int, default=300, help="longest one cell may run, seconds (default: 300)")
    args = parser.parse_args(argv)
    if not args.notebook.is_file():
        print(f"no notebook at {args.notebook}", file=sys.stderr)
        return 2
    import nbclient
    import nbformat
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.read(args.notebook, as_version=4)
    client = nbclient.NotebookClient(
        nb,
        kernel_name="python3",
        timeout=args.timeout,
        resources={"metadata": {"path": str(args.notebook.parent)}},
        on_cell_executed=_printer(out),
    )
    failed = False
    try:
        client.execute()
    except CellExecutionError:
        failed = True  # the cell's error was printed with its output
    if args.out:
        nbformat.write(nb, args.out)
    print("the notebook ran to the end" if not failed else "a cell failed: see its output above", file=out)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
