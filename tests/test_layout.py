"""The package layout: who imports whom, and the one SageMaker header contract with the client's copy."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CORE = REPO / "handler" / "llava_sessions"
TOOLS = REPO / "handler" / "llava_tools"
CLIENT = REPO / "client" / "llava_client"


def imported_packages(folder: Path) -> dict[str, set[str]]:
    """Top-level packages each module of ``folder`` imports (absolute imports; relative ones stay inside)."""
    out: dict[str, set[str]] = {}
    for path in sorted(folder.glob("*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
        out[path.name] = names
    return out


@pytest.mark.parametrize(
    ("folder", "forbidden"),
    [
        (CORE, {"llava_tools", "llava_client"}),
        (CLIENT, {"llava_sessions", "llava_tools", "llava_handler"}),
        (TOOLS, {"llava_handler"}),
    ],
)
def test_no_module_imports_across_the_boundary(folder: Path, forbidden: set[str]) -> None:
    crossing = {
        name: sorted(found & forbidden) for name, found in imported_packages(folder).items() if found & forbidden
    }
    assert crossing == {}


def llava_packages_loaded_by(code: str) -> str:
    """Run ``code`` in a fresh interpreter; return the sorted top-level ``llava*`` packages it loaded."""
    report = "; print(sorted({m.split('.')[0] for m in sys.modules if m.startswith('llava')}))"
    out = subprocess.run(
        [sys.executable, "-c", "import sys; " + code + report],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return out.stdout.strip()


def test_the_worker_loads_the_core_only() -> None:
    """What TorchServe's worker imports through llava_handler.py is the core package, nothing of the tools."""
    loaded = llava_packages_loaded_by("sys.path.insert(0, 'handler'); import llava_handler")
    assert loaded == "['llava_handler', 'llava_sessions']"


def test_the_client_installs_and_imports_without_the_server() -> None:
    loaded = llava_packages_loaded_by(
        "import importlib, pkgutil, llava_client; "
        "[importlib.import_module(m.name) for m in pkgutil.walk_packages(llava_client.__path__, 'llava_client.')]"
    )
    assert loaded == "['llava_client']"


def test_the_client_copy_of_the_header_contract_equals_the_server_one() -> None:
    import llava_client
    from llava_client import _transport
    from llava_sessions import contract

    assert _transport.SESSION_ID_HEADER == contract.SESSION_ID_HEADER
    assert _transport.NEW_SESSION_ID_HEADER == contract.NEW_SESSION_ID_HEADER
    assert _transport.CLOSED_SESSION_ID_HEADER == contract.CLOSED_SESSION_ID_HEADER
    assert _transport.NEW_SESSION_LITERAL == contract.NEW_SESSION_LITERAL
    value = contract.session_header_value("ts-seq-1", 1_700_000_000)
    session_id, expires = llava_client.parse_session_header(value)
    assert session_id == "ts-seq-1" and int(expires.timestamp()) == 1_700_000_000


def test_the_header_contract_is_written_once_on_the_server() -> None:
    """Only contract.py spells the SageMaker header names and NEW_SESSION among the server's modules."""
    literals = (
        "X-Amzn-SageMaker-Session-Id",
        "X-Amzn-SageMaker-New-Session-Id",
        "X-Amzn-SageMaker-Closed-Session-Id",
        '"NEW_SESSION"',
    )
    spelled = {}
    for path in [*CORE.glob("*.py"), *TOOLS.glob("*.py")]:
        if path.name == "contract.py":
            continue
        code_only = ast.unparse(ast.parse(path.read_text()))  # docstrings stay, comments go
        tree = ast.parse(code_only)
        strings = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
        docs = {
            ast.get_docstring(n, clean=False)
            for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        }
        found = [lit for lit in literals for s in strings if s not in docs and lit.strip('"') == s]
        if found:
            spelled[path.name] = found
    assert spelled == {}


def test_the_design_doc_names_every_module_of_both_packages() -> None:
    design = (REPO / "docs" / "design.md").read_text()
    modules = [p.name for folder in (CORE, TOOLS) for p in sorted(folder.glob("*.py")) if p.name != "__init__.py"]
    assert [m for m in modules if f"`{m}`" not in design] == []
