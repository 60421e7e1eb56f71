"""The package layout: who imports whom, and the one SageMaker header contract with the client's copy."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CORE = REPO / "handler" / "llava_sessions"
TOOLS = REPO / "handler" / "llava_tools"
CLIENT = REPO / "client" / "llava_client"


def imported_packages(folder: Path) -> dict[str, set[str]]:
    """Top-level packages each module of ``folder`` imports (absolute imports; relative ones stay inside)."""
    out: dict[str, set[str]] = {}
    for path in sorted(folder.rglob("*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
        out[str(path.relative_to(folder))] = names
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
    from llava_sessions.wire import contract

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
    for path in [*CORE.rglob("*.py"), *TOOLS.rglob("*.py")]:
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


def test_the_architecture_is_a_one_page_map_of_every_package() -> None:
    """docs/architecture.md is the newcomer's one page: at most 250 lines and 3,000 words, naming every
    sub-package of the core and the tools (the modules' own docstrings are the module list); the
    decisions and the numbers live in docs/decisions/ and benchmarks/results/, each indexed."""
    architecture = (REPO / "docs" / "architecture.md").read_text()
    packages = [f"{p.parent.name}/" for folder in (CORE, TOOLS) for p in sorted(folder.glob("*/__init__.py"))]
    assert [p for p in packages if p not in architecture] == []
    assert len(architecture.splitlines()) <= 250 and len(architecture.split()) <= 3000
    for folder in (REPO / "docs" / "decisions", REPO / "benchmarks" / "results"):
        index = (folder / "README.md").read_text()
        assert [
            p.name for p in sorted(folder.glob("*.md")) if p.name != "README.md" and f"]({p.name})" not in index
        ] == []


def test_every_decision_record_has_its_date_status_context_decision_and_consequences() -> None:
    """A decision record (docs/decisions/) is one decision in one shape (issue 61): its date and status,
    then why (context), what (decision) and what follows (consequences), with its measurement where one
    decided it; and no diary: no session narration, no commit hash as a date."""
    shape = re.compile(
        r"\A# .+\n\n- Date: \d{4}-\d{2}-\d{2}.*\n- Status: .+\n\n## Context\n.+\n## Decision\n.+\n## Consequences\n",
        re.S,
    )
    records = sorted(p for p in (REPO / "docs" / "decisions").glob("*.md") if p.name != "README.md")
    assert len(records) >= 50
    assert [p.name for p in records if not shape.match(p.read_text())] == []
    diary = re.compile(r"\b(this session|next session|that day|a miss of mine|we tried|I )\b")
    assert [p.name for p in records if diary.search(p.read_text())] == []


# ------------------------------------------------------------------ the core's import graph
#: The two dialects: neither imports the other (what both need sits below them).
DIALECTS = ("native", "chat")
#: The engine and what it stands on: a request's way down reaches them and never comes back up; none
#: of these imports the wire, a dialect, the service or the wiring.
BELOW_THE_WIRE = ("engine", "model", "sessions", "sampling")
#: The core's top level keeps at most this many modules beside its sub-packages.
MAX_TOP_LEVEL_MODULES = 8


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts) or "__init__"


def _is_module(name: str, root: Path) -> bool:
    base = root / name.replace(".", "/")
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def core_import_graph(
    root: Path = CORE, *, typing_too: bool = False, package: str = "llava_sessions"
) -> dict[str, set[str]]:
    """Run-time imports between the core's modules (imports under ``if TYPE_CHECKING:`` are types
    only: edges only with ``typing_too``). Importing a module of another package also runs that
    package's ``__init__``: an edge too."""
    graph: dict[str, set[str]] = {}
    for path in sorted(root.rglob("*.py")):
        me = _module_name(path, root)
        package = me.split(".") if path.name == "__init__.py" and me != "__init__" else me.split(".")[:-1]
        tree = ast.parse(path.read_text())
        typing_only = {
            id(n)
            for node in ast.walk(tree)
            if not typing_too and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)
        }
        edges: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in typing_only or not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.split(".")[0] == package:
                target = node.module.removeprefix(package).lstrip(".") or "__init__"
            else:
                continue
            subs = [f"{target}.{a.name}" if target else a.name for a in node.names]
            found = [t for t in subs if _is_module(t, root)] or [target]
            for t in found:
                edges.add(t)
                top = t.split(".")[0]
                if "." in t and top != me.split(".")[0]:
                    edges.add(top)  # the other package's __init__ runs first
        graph[me] = edges - {me}
    return graph


#: The core's floors, one sub-package (or plain top-level module) each, lowest first: a module imports
#: (at run time) only from lower floors or its own package. Plain data, then what the model stands on,
#: the model, the sessions' state, the engine, the wire, the two dialects side by side, the service,
#: the replicas, the wiring.
FLOORS: list[set[str]] = [
    {"errors", "config", "results", "metrics", "conversation"},
    {"sampling", "images", "video"},
    {"model"},
    {"sessions"},
    {"engine"},
    {"wire"},
    {"native", "chat"},
    {"service"},
    {"replicas"},
    {"worker"},
    {"__init__"},
]


def test_no_core_package_imports_up_a_floor() -> None:
    """Issue 45 item 5: between the core's sub-packages every import goes down a floor of
    :data:`FLOORS` (``model/templating.py`` imported ``sessions/conversation.py``, one floor up:
    the conversation's plain data now sits at the bottom, beside the results)."""
    floor = {name: i for i, names in enumerate(FLOORS) for name in names}
    graph = core_import_graph()
    assert sorted({m.split(".")[0] for m in graph} - set(floor)) == [], "a package without a floor"
    up = sorted(
        f"{a} -> {b}"
        for a, targets in graph.items()
        for b in targets
        if a.split(".")[0] != b.split(".")[0] and floor[b.split(".")[0]] >= floor[a.split(".")[0]]
    )
    assert up == []


def test_the_dialects_do_not_import_each_other_and_nothing_below_imports_the_wire() -> None:
    graph = core_import_graph(typing_too=True)
    crossing = [
        f"{a} -> {b}"
        for a, targets in graph.items()
        for b in targets
        for mine, other in ((DIALECTS[0], DIALECTS[1]), (DIALECTS[1], DIALECTS[0]))
        if a.split(".")[0] == mine and b.split(".")[0] == other
    ]
    assert crossing == []
    upward = {"wire", "service", "replicas", "worker", *DIALECTS}
    assert [
        f"{a} -> {b}"
        for a, targets in graph.items()
        for b in targets
        if a.split(".")[0] in BELOW_THE_WIRE and b.split(".")[0] in upward
    ] == []
    assert "chat.serving" in graph["service"] and "native.serving" in graph["service"]  # the check sees them


def test_the_core_top_level_stays_small() -> None:
    modules = sorted(p.name for p in CORE.glob("*.py") if p.name != "__init__.py")
    assert len(modules) <= MAX_TOP_LEVEL_MODULES, modules


def test_the_import_check_finds_a_cycle_and_a_hidden_import(tmp_path: Path) -> None:
    pkg = tmp_path / "core"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "a.py").write_text("from .b import x\n")
    (pkg / "b.py").write_text("def f():\n    from .a import y  # hidden in a function\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..d import T\nfrom .. import a\n"
    )
    (pkg / "d.py").write_text("from .sub import c\n")
    graph = core_import_graph(pkg)
    assert graph["a"] == {"b"} and graph["b"] == {"a"} and graph["sub.c"] == {"a"}  # types only: not an edge
    assert graph["d"] == {"sub.c", "sub"}  # importing sub.c runs sub/__init__ too
    assert cycles(graph) == [["a", "b", "a"]]  # the hidden import closes a cycle


def test_the_dialects_results_and_conversation_import_no_torch() -> None:
    modules = [
        f"llava_sessions.{name}"
        for name in (
            "native.protocol",
            "native.responses",
            "chat.protocol",
            "chat.messages",
            "chat.command",
            "chat.responses",
            "wire.framing",
            "wire.inbound",
            "images",
            "video",
            "results",
            "conversation",
            "sessions.ledger",
            "sessions.budget",
            "sampling.params",
        )
    ]
    code = f"import sys, {', '.join(modules)}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"


def test_session_fields_change_only_through_the_session_and_the_store() -> None:
    """No module but sessions/session.py and sessions/store.py assigns a field of a Session (``session.kv_cache = ...``)."""
    from dataclasses import fields

    from llava_sessions.sessions.session import Session

    names = {f.name for f in fields(Session)}
    edits = []
    for path in sorted(CORE.rglob("*.py")):
        if path.relative_to(CORE).as_posix() in ("sessions/session.py", "sessions/store.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            for t in targets:
                if isinstance(t, ast.Attribute) and t.attr in names and ast.unparse(t.value).endswith("session"):
                    edits.append(f"{path.relative_to(CORE)}:{node.lineno} {ast.unparse(t)}")
    assert edits == []


#: 500 lines a module and 50 a function (its code, the docstring aside) in the core; 60 a function in
#: the tools and the client: sizes a reader can hold.
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 50
MAX_TOOL_FUNCTION_LINES = 60


def oversized(folder: Path, max_function_lines: int) -> list[str]:
    """Modules of ``folder`` over :data:`MAX_MODULE_LINES` and functions over ``max_function_lines``."""
    big = []
    for path in sorted(folder.rglob("*.py")):
        text = path.read_text()
        if len(text.splitlines()) > MAX_MODULE_LINES:
            big.append(f"{path.relative_to(folder)}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            body = node.body
            has_doc = isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant)
            start = body[1].lineno if has_doc and len(body) > 1 else body[0].lineno
            assert node.end_lineno is not None
            if node.end_lineno - start + 1 > max_function_lines:
                big.append(f"{path.relative_to(folder)}:{node.lineno} {node.name}")
    return big


def test_core_modules_and_functions_stay_small() -> None:
    assert oversized(CORE, MAX_FUNCTION_LINES) == []


@pytest.mark.parametrize("folder", [TOOLS, CLIENT], ids=["tools", "client"])
def test_tool_and_client_modules_and_functions_stay_small(folder: Path) -> None:
    assert oversized(folder, MAX_TOOL_FUNCTION_LINES) == []


def private_imports(folder: Path) -> list[str]:
    """``from <module> import _name`` of another module's private names, in ``folder``'s modules (a
    package's private module itself, ``from . import _chat``, is its own to import)."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module not in ("__future__", None):
                found += [
                    f"{path.relative_to(folder)}: {node.module} {a.name}"
                    for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")
                ]
    return found


@pytest.mark.parametrize("folder", [CORE, TOOLS, CLIENT], ids=["core", "tools", "client"])
def test_no_module_imports_another_modules_private_names(folder: Path) -> None:
    assert private_imports(folder) == []


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import cycle a depth-first walk of ``graph`` meets, each as the modules on it."""
    found: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def walk(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                found.append([*stack[stack.index(nxt) :], nxt])
            elif nxt in graph and not state.get(nxt):
                walk(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if not state.get(node):
            walk(node)
    return found


@pytest.mark.parametrize("root", [CORE, TOOLS, CLIENT], ids=["core", "tools", "client"])
def test_no_import_cycle_type_only_imports_counted(root: Path) -> None:
    """Helpers get the few collaborators they use, never the object that made them: no module
    imports one that imports it back, even for type hints only."""
    graph = core_import_graph(root, typing_too=True, package=root.name)
    assert graph and cycles(graph) == []


def test_the_cycle_check_sees_a_type_only_cycle(tmp_path: Path) -> None:
    pkg = tmp_path / "core"
    pkg.mkdir()
    (pkg / "a.py").write_text("from .b import x\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import y\n")
    assert cycles(core_import_graph(pkg)) == []
    assert cycles(core_import_graph(pkg, typing_too=True)) == [["a", "b", "a"]]


def test_only_the_store_books_a_sessions_memory() -> None:
    """The ledger follows each session through its own methods (``on_change``): no module calls the
    store's ledger update, and memory is taken only through the store's allocator API."""
    calls = []
    for path in sorted(CORE.rglob("*.py")):
        if path.relative_to(CORE).as_posix() in ("sessions/store.py", "sessions/ledger.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("_sync", "sync", "set_usage", "reserve"):
                calls.append(f"{path.relative_to(CORE)}:{node.lineno} {node.attr}")
    assert calls == []


def test_only_the_steps_plan_gets_device_memory() -> None:
    """Scheduler rule 10: device memory is made room for only where a step executes its plan (a
    chunk's start grant, a rebuilt batch's, the pages of a step launched ahead: async scheduling),
    never at admission, an answer's start or a batch build;
    admission may only ask whether room can be made (``can_allocate``)."""
    sites = []
    for path in sorted(CORE.rglob("*.py")):
        if path.relative_to(CORE).parts[0] == "sessions":
            continue  # the store and the ledger implement the allocator
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Attribute) and node.attr == "allocate" and _is_store(node.value):
                    sites.append(f"{path.relative_to(CORE).as_posix()}:{fn.name}")
    assert sorted(set(sites)) == [
        "engine/executor.py:_ahead_room",
        "engine/executor.py:_batch_room",
        "engine/executor.py:_before_tokens",
    ]


def _is_store(node: ast.expr) -> bool:
    """Whether ``node`` names the session store (``store``, ``self.store``, ``x._store``)."""
    name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""
    return name.lstrip("_") == "store"


def test_a_requests_way_through_the_wire_keeps_the_layouts_goal(tmp_path: Path) -> None:
    """``benchmarks/trace_request.py`` on the tiny model (every call recorded with ``sys.setprofile``):
    a chat turn with an image and a native ``generate`` each pass at most 13 of the worker's files
    on the wire's way down (body read, validated, images fetched and keyed, the engine's API called)
    and at most 12 on its way back (the frames written), and no call returns into a module the request
    already left. (13 down since ``image_key``, plain data, left the HTTP fetcher for ``conversation.py``.)"""
    out = tmp_path / "trace.json"
    run = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "trace_request.py"), "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(out.read_text())
    assert set(report) == {"chat turn with an image", "native generate"}
    for name, way in report.items():
        assert "llava_handler.py" in way["down"] and "llava_sessions/wire/framing.py" in way["back"], name
        assert len(way["down"]) <= 13, (name, way["down"])
        assert len(way["back"]) <= 12, (name, way["back"])
        assert way["calls_back_up"] == 0, name


#: The tools' top level keeps at most this many modules beside its sub-packages (issue 45 item 5).
MAX_TOOL_TOP_LEVEL_MODULES = 6


def test_the_tools_have_a_sub_package_per_tool_and_the_tests_mirror_the_packages() -> None:
    """A sub-package per tool (the server and its proxy, the local endpoint, deploy, the demos, the
    tiny-model builder), the helpers they share beside them; every test in the folder of the package
    it tests (``core/``, ``tools/``, ``client/``; ``project/`` for the repository's own checks; ``gpu/``
    for what only a GPU runs)."""
    top = sorted(p.name for p in TOOLS.glob("*.py"))
    packages = sorted(p.name for p in TOOLS.iterdir() if (p / "__init__.py").is_file())
    assert len(top) <= MAX_TOOL_TOP_LEVEL_MODULES, top
    assert packages == ["compile_cache", "demo", "deploy", "local_endpoint", "serve", "tiny_model"]
    tests = REPO / "tests"
    assert sorted(p.name for p in tests.glob("test_*.py")) == [], "a test outside the packages' folders"
    folders = sorted(p.name for p in tests.iterdir() if p.is_dir() and list(p.glob("test_*.py")))
    assert folders == ["client", "core", "gpu", "project", "tools"]
