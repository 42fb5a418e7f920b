"""Package layout: what ``import jaxcomm`` loads, the ``jaxcomm`` command's module entry point."""

import subprocess
import sys


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

import ast  # noqa: E402
from pathlib import Path  # noqa: E402

PACKAGE = Path(__file__).resolve().parent.parent / "jaxcomm"

# A module may import from its own layer or lower ones (docs/architecture.md).
LAYERS = {
    "jaxcomm._compat": 0,
    "jaxcomm.layout": 0,
    "jaxcomm.runtime": 0,
    "jaxcomm.phases": 0,
    "jaxcomm.compressors": 1,
    "jaxcomm.state": 2,
    "jaxcomm.collectives": 3,
    "jaxcomm.hierarchical": 4,
    "jaxcomm.backend": 4,
    "jaxcomm.resize": 4,
    "jaxcomm.inspect": 4,
    "jaxcomm.optim": 5,
    "jaxcomm.parallel": 5,
    "jaxcomm.reshard": 6,
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(name: str) -> int | None:
    for prefix in sorted(LAYERS, key=len, reverse=True):
        if name == prefix or name.startswith(prefix + "."):
            return LAYERS[prefix]
    return None


def _imports(path: Path):
    """(imported module, imported names) of every ``jaxcomm`` import in ``path``."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("jaxcomm"):
            names = [a.name for a in node.names]
            if node.module == "jaxcomm":  # from jaxcomm import layout -> module jaxcomm.layout
                for n in names:
                    yield f"jaxcomm.{n}", []
            else:
                yield node.module, names
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("jaxcomm"):
                    yield a.name, []


LIBRARY = sorted(
    p for p in PACKAGE.rglob("*.py") if "cli" not in p.parts and p.name != "__main__.py"
)


def test_every_library_module_has_a_layer():
    missing = [_module_name(p) for p in LIBRARY if p.parent == PACKAGE and p.name != "__init__.py"
               and _layer(_module_name(p)) is None]
    assert not missing, f"add these modules to LAYERS and docs/architecture.md: {missing}"


def test_library_imports_go_down_the_layers_and_never_into_the_cli():
    bad = []
    for path in LIBRARY:
        me = _module_name(path)
        mine = _layer(me)
        for target, _ in _imports(path):
            if target.startswith("jaxcomm.cli"):
                bad.append(f"{me} imports the command-line module {target}")
            elif me != "jaxcomm" and mine is not None:
                theirs = _layer(target)
                if theirs is not None and theirs > mine:
                    bad.append(f"{me} (layer {mine}) imports {target} (layer {theirs})")
    assert not bad, "\n".join(bad)


def test_no_private_name_imported_from_another_module():
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        me = _module_name(path)
        for target, names in _imports(path):
            if target != me:
                bad += [f"{me}: from {target} import {n}" for n in names if n.startswith("_")]
    assert not bad, "\n".join(bad)


def test_no_import_circle_at_module_level():
    graph = {}
    for path in LIBRARY:
        tree = ast.parse(path.read_text())
        deps = set()
        for node in tree.body:  # module level only: function-level imports are deliberate
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(
                "jaxcomm"
            ):
                if node.module == "jaxcomm":
                    deps |= {f"jaxcomm.{a.name}" for a in node.names}
                else:
                    deps.add(node.module)
        graph[_module_name(path)] = deps
    # A package's __init__ re-exports its modules; edges into a package mean its modules.
    state: dict[str, int] = {}

    def visit(node, stack):
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if dep == node or node.startswith(dep + ".") and graph.get(dep) is not None:
                continue  # a module importing its own package's siblings through __init__
            if state.get(dep) == 1:
                raise AssertionError("import circle: " + " -> ".join([*stack, node, dep]))
            if state.get(dep) is None and dep in graph:
                visit(dep, [*stack, node])
        state[node] = 2

    for name in sorted(graph):
        if name not in state and name != "jaxcomm":
            visit(name, [])


def test_only_the_package_has_an_all():
    with_all = [
        _module_name(p) for p in LIBRARY if p != PACKAGE / "__init__.py" and "__all__" in {
            t.id for n in ast.parse(p.read_text()).body if isinstance(n, ast.Assign | ast.AnnAssign)
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
            if isinstance(t, ast.Name)
        }
    ]
    with_all = sorted(with_all)
    assert not with_all, f"export from jaxcomm/__init__.py instead: {with_all}"
