"""Package layout: what ``import jaxcomm`` loads, the ``jaxcomm`` command's module entry point,
and the layers of docs/architecture.md (one per top-level module or folder of ``jaxcomm/``)."""

import ast
import subprocess
import sys
from pathlib import Path


def test_import_jaxcomm_loads_nothing_from_the_cli():
    code = (
        "import sys, jaxcomm\n"
        "print(','.join(sorted(m for m in sys.modules if m.startswith('jaxcomm.cli'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_python_m_jaxcomm_is_the_cli():
    out = subprocess.run(
        [sys.executable, "-m", "jaxcomm", "--help"], capture_output=True, text=True, check=True
    )
    assert "bench" in out.stdout and "launch" in out.stdout and "demo" in out.stdout


# -- layering (docs/architecture.md) ---------------------------------------------------------

PACKAGE = Path(__file__).resolve().parent.parent / "jaxcomm"

DOC = PACKAGE.parent / "docs" / "architecture.md"


def _documented_layers() -> dict[str, int]:
    """``{module or folder: layer}`` from the table of docs/architecture.md's "Layers" section
    (rows ``| 2 | `comm/` | ...``): the page is the one place the layers are written down, and
    these tests hold the code to it."""
    section = DOC.read_text().split("## Layers", 1)[1]
    layers = {}
    for row in section.splitlines():
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0].isdigit() and cells[1].startswith("`"):
            path = cells[1].strip("`").removesuffix("/").removesuffix(".py")
            layers[path.replace("/", ".")] = int(cells[0])
    return layers


# One layer per top-level module or folder of jaxcomm/: a module imports only from its own
# layer or lower ones. The package (jaxcomm/__init__.py) sits above them all. A module of a
# folder may have a layer of its own ("comm.axes": every layer reads axis names with it); the
# longest entry that names it counts.
LAYERS = _documented_layers()
# The command line: may import anything, never imported by the library.
COMMAND = ("cli", "__main__")

# A function's own logic (its body without docstring, comments, blank lines and the bodies of
# functions nested in it, which count on their own) stays under this many lines: a longer one
# holds several steps that deserve names. Modules are split by concept, not by length.
MAX_LOGIC_LINES = 80
# Functions over MAX_LOGIC_LINES still to be split ("path::name").
OVER_LIMIT: set[str] = {"cli/launch.py::_run_ranks"}

FILES = sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p) for p in FILES}


def _top(name: str) -> str | None:
    """The top-level module or folder of ``jaxcomm.<top>...`` (``None`` for the package)."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else None


def _layer(name: str) -> int | None:
    """The layer of module ``jaxcomm.<...>``: its longest entry in LAYERS (``None``: the package
    or an unlisted module)."""
    parts = name.split(".")[1:]
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in LAYERS:
            return LAYERS[".".join(parts[:end])]
    return None


LIBRARY = [p for p in FILES if _top(_module_name(p)) not in COMMAND]


def _imports(path: Path, *, module_level: bool = False):
    """(imported module, imported names) of every ``jaxcomm`` import in ``path``.

    ``from jaxcomm.a import b`` names the module ``jaxcomm.a.b`` when that is a module.
    """
    tree = ast.parse(path.read_text())
    nodes = tree.body if module_level else ast.walk(tree)
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("jaxcomm"):
            names = [a.name for a in node.names]
            subs = [n for n in names if f"{node.module}.{n}" in MODULES]
            for n in subs:
                yield f"{node.module}.{n}", []
            if len(subs) < len(names):
                yield node.module, [n for n in names if n not in subs]
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("jaxcomm"):
                    yield a.name, []


def test_every_top_level_module_and_folder_has_a_layer():
    tops = {
        p.stem if p.is_file() else p.name
        for p in PACKAGE.iterdir()
        if (p.suffix == ".py" and p.name != "__init__.py") or (p / "__init__.py").exists()
    }
    missing = sorted(tops - set(LAYERS) - set(COMMAND))
    assert not missing, f"give these a layer in LAYERS and docs/architecture.md: {missing}"


def test_library_imports_go_down_the_layers_and_never_into_the_cli():
    bad = []
    for path in LIBRARY:
        me = _module_name(path)
        mine = _layer(me)
        for target, _ in _imports(path):
            theirs = _layer(target)
            if _top(target) in COMMAND:
                bad.append(f"{me} imports the command-line module {target}")
            elif mine is not None and theirs is not None and theirs > mine:
                bad.append(f"{me} (layer {mine}) imports {target} (layer {theirs})")
    assert not bad, "\n".join(bad)


def test_no_private_name_imported_from_another_module():
    bad = []
    for path in FILES:
        me = _module_name(path)
        for target, names in _imports(path):
            if target != me:
                bad += [f"{me}: from {target} import {n}" for n in names if n.startswith("_")]
    assert not bad, "\n".join(bad)


def _circle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}

    def visit(node, stack):
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return [*stack, node, dep]
            if state.get(dep) is None and dep in graph:
                found = visit(dep, [*stack, node])
                if found:
                    return found
        state[node] = 2
        return None

    for name in sorted(graph):
        if name not in state:
            found = visit(name, [])
            if found:
                return found
    return None


def test_no_import_circle():
    # Every import counts, also inside functions. A package's __init__ imports its own modules,
    # so an edge from a module to its own package (or the root package) is left out.
    graph = {}
    for path in FILES:
        me = _module_name(path)
        graph[me] = {
            t
            for t, _ in _imports(path)
            if t != me and t != "jaxcomm" and not me.startswith(t + ".") and t in MODULES
        }
    circle = _circle(graph)
    assert circle is None, "import circle: " + " -> ".join(circle)


def test_subpackage_inits_only_re_export():
    bad = []
    for path in FILES:
        if path.name != "__init__.py" or path.parent == PACKAGE:
            continue
        for node in ast.parse(path.read_text()).body:
            docstring = isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
            all_ = isinstance(node, ast.Assign) and [
                t.id for t in node.targets if isinstance(t, ast.Name)
            ] == ["__all__"]
            if not (docstring or all_ or isinstance(node, ast.Import | ast.ImportFrom)):
                bad.append(f"{_module_name(path)}, line {node.lineno}")
    assert not bad, "a subpackage's __init__.py holds only imports and __all__: " + str(bad)


def test_only_package_inits_have_an_all():
    with_all = sorted(
        _module_name(p)
        for p in LIBRARY
        if p.name != "__init__.py"
        and "__all__"
        in {
            t.id
            for n in ast.parse(p.read_text()).body
            if isinstance(n, ast.Assign | ast.AnnAssign)
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
            if isinstance(t, ast.Name)
        }
    )
    assert not with_all, f"export from jaxcomm/__init__.py instead: {with_all}"


def _logic_lines(fn: ast.FunctionDef | ast.AsyncFunctionDef, source: list[str]) -> int:
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    nested = {
        line
        for node in ast.walk(fn)
        if node is not fn and isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        for line in range(node.lineno, (node.end_lineno or node.lineno) + 1)
    }
    lines = {
        line
        for stmt in body
        for line in range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1)
    } - nested
    return sum(1 for i in lines if (t := source[i - 1].strip()) and not t.startswith("#"))


def test_no_function_over_the_logic_limit():
    """Library and command line alike; nested functions (optax closures) count on their own."""
    over = []
    for p in FILES:
        source = p.read_text().splitlines()
        rel = p.relative_to(PACKAGE).as_posix()
        for node in ast.walk(ast.parse("\n".join(source))):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            n = _logic_lines(node, source)
            if n > MAX_LOGIC_LINES and f"{rel}::{node.name}" not in OVER_LIMIT:
                over.append(f"{rel}::{node.name} ({n} lines)")
    assert not over, f"functions over {MAX_LOGIC_LINES} lines of logic (split them): {over}"


def test_logic_line_count_skips_docstrings_comments_and_nested_functions():
    source = [
        "def outer():",
        '    """Doc."""',
        "    # a comment",
        "    x = 1",
        "",
        "    def inner():",
        "        return 2",
        "    return x",
    ]
    fn = ast.parse("\n".join(source)).body[0]
    assert isinstance(fn, ast.FunctionDef)
    assert _logic_lines(fn, source) == 2


# -- tests/ mirrors the package ---------------------------------------------------------------

TESTS = Path(__file__).resolve().parent
# Folders with no subpackage of their own: NumPy reference models, multi-process runs (hangs,
# faults, soaks), and the README, docs pages and examples.
TEST_ONLY_FOLDERS = {"reference", "integration", "docs"}


def test_tests_mirror_the_package():
    subpackages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    folders = {
        p.name for p in TESTS.iterdir() if p.is_dir() and not p.name.startswith((".", "__"))
    }
    assert folders - TEST_ONLY_FOLDERS == subpackages, (
        f"one tests/ folder per jaxcomm/ subpackage: missing {sorted(subpackages - folders)}, "
        f"extra {sorted(folders - TEST_ONLY_FOLDERS - subpackages)}"
    )
    # Test files import each other and the reference models as tests.<folder>.<module>.
    no_init = sorted(f for f in folders if not (TESTS / f / "__init__.py").exists())
    assert not no_init, f"add an __init__.py to tests/{no_init[0]}/"
