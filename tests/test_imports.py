"""Modules import in one direction (docs/design.md): no posbench module reaches itself through
the posbench modules it imports, counting imports inside functions, and counting every module
of a registry package (encodings, data, evaluations) as imported by its __init__."""
import ast
from pathlib import Path

import posbench

ROOT = Path(posbench.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports() -> dict:
    """module -> the posbench modules it imports anywhere in its file (TYPE_CHECKING aside)."""
    names = {module_name(p): p for p in ROOT.rglob("*.py")}
    graph = {}
    for name, path in names.items():
        tree = ast.parse(path.read_text())
        checking = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                    and ast.unparse(node.test) == "TYPE_CHECKING" for n in ast.walk(node)}
        found = set()
        for node in ast.walk(tree):
            if id(node) in checking:
                continue
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                # `from package import module` imports the module; of a name, the package
                found |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in names
                          else node.module for a in node.names}
        graph[name] = {m for m in found if m in names and m != name}
        if "pkgutil.iter_modules" in path.read_text():  # a package that imports its modules
            graph[name] |= {m for m in names if m.rpartition(".")[0] == name}
    return graph


def test_no_import_cycles():
    graph = imports()
    assert "posbench.config" in graph and "posbench.runs.run" in graph
    state, path = {}, []

    def visit(module):
        state[module] = "open"
        path.append(module)
        for dep in sorted(graph[module]):
            if state.get(dep) == "open":
                cycle = path[path.index(dep):] + [dep]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep)
        path.pop()
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module)


# the layers, bottom up (docs/design.md): a module imports modules of its own layer or below;
# "posbench" is the package's __init__ alone (the public API), the conf package holds YAML only
LAYERS = [("posbench.core", "posbench.conf"), ("posbench.attention",),
          ("posbench.encodings", "posbench.data"), ("posbench.model",), ("posbench.evaluations",),
          ("posbench.config",), ("posbench.runs",), ("posbench.reports",),
          ("posbench.reproduce",),
          ("posbench",), ("posbench.cli",)]
# the packages whose __init__ imports nothing, so that importing one module of theirs pulls no
# other in (posbench.attention sits below the encodings, which import its span and temperature)
BARE_PACKAGES = ("posbench.core", "posbench.attention", "posbench.model", "posbench.runs",
                 "posbench.reports")


def layer(module: str):
    for rank, packages in enumerate(LAYERS):
        if any(module == p or p != "posbench" and module.startswith(p + ".") for p in packages):
            return rank
    return None


def test_layers_import_downwards():
    graph = imports()
    unplaced = sorted(m for m in graph if layer(m) is None)
    assert not unplaced, f"modules in no layer of LAYERS: {unplaced}"
    climbs = [f"{m} -> {d}" for m in sorted(graph) for d in sorted(graph[m]) if layer(d) > layer(m)]
    assert not climbs, "imports that climb a layer: " + ", ".join(climbs)
    assert all(graph[p] == set() for p in BARE_PACKAGES), {p: graph[p] for p in BARE_PACKAGES}
