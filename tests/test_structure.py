"""The floor plan holds: no import cycles, rooms import only downstream rooms, no reaching into
private names of other modules, transformers internals only in model/, no patching of engine
internals in benchmarks. Checked on the source (ast), so a violation fails here, not at run time."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("kvboost_engine", "kvboost_tools", "kvboost_integrations")

# room -> rooms it may import (besides itself and the base modules errors/config/paths/instrument)
ROOMS = {
    "kv": set(),
    "model": {"kv.geometry"},
    "weights": {"model"},
    "constrained": set(),
    "request": {"kv", "model", "constrained"},
    "native": {"model", "weights"},
}
BASE = {"errors", "config", "paths", "instrument"}


def modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


def imports(name: str, path: Path) -> list[tuple[str, list[str]]]:
    """(imported module, names) for every import in the file, at any depth, resolved to absolute."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            found.append((module, [alias.name for alias in node.names]))
    return found


def internal_edges() -> dict[str, set[str]]:
    known = modules()
    graph: dict[str, set[str]] = {name: set() for name in known}
    for name, path in known.items():
        for module, names in imports(name, path):
            for target in [f"{module}.{n}" for n in names] + [module]:
                if target in known and target != name:
                    graph[name].add(target)
                    break
    return graph


def test_no_import_cycles():
    graph = internal_edges()
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):                                   # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    # a package __init__ importing its own submodules is not a cycle worth reporting
    cycles = [c for c in cycles if not all(m.startswith(c[0]) for m in c)]
    assert cycles == []


def room_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "kvboost_engine" and len(parts) > 2 else None


def test_rooms_import_only_downstream_rooms():
    wrong = []
    for name, targets in internal_edges().items():
        room = room_of(name)
        if room not in ROOMS:
            continue
        for target in targets:
            if not target.startswith("kvboost_engine."):
                wrong.append((name, target))
                continue
            inner = target.removeprefix("kvboost_engine.")
            other = room_of(target)
            allowed = other == room or inner in BASE or other in ROOMS[room] or inner in ROOMS[room]
            if not allowed:
                wrong.append((name, target))
    assert wrong == []


def test_the_engine_does_not_import_tools_integrations_or_benchmarks():
    for name, path in modules().items():
        if name.startswith("kvboost_engine"):
            for module, _ in imports(name, path):
                assert not module.startswith(("kvboost_tools", "kvboost_integrations", "benchmarks")), (name, module)


def test_no_private_names_imported_across_modules():
    wrong = []
    for name, path in modules().items():
        for module, names in imports(name, path):
            if module.startswith(PACKAGES):
                wrong += [(name, module, n) for n in names if n.startswith("_") and n != "__version__"]
    assert wrong == []


def test_transformers_internals_only_in_the_model_room():
    wrong = []
    for name, path in modules().items():
        for module, _ in imports(name, path):
            if module.startswith("transformers.") and not name.startswith("kvboost_engine.model."):
                wrong.append((name, module))
    assert wrong == []


def test_benchmarks_do_not_patch_engine_internals():
    pattern = re.compile(r"(engine|parts|cache|adapter|forward|runner)\w*\.\w+\s*=(?!=)|\._parts\b|setattr\(")
    offenders = []
    for path in (ROOT / "benchmarks").rglob("*.py"):
        if "tests" in path.parts:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line) and "config._attn_implementation" not in line:
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert offenders == []


def test_modules_stay_small():
    """Modules under about 300 lines (the ones over say why in their docstring: 'long because')."""
    long = [f"{p.relative_to(ROOT)} ({n})" for p in ROOT.glob("kvboost_*/**/*.py")
            if (n := len(p.read_text().splitlines())) > 320 and "long because" not in p.read_text()[:2000]]
    assert long == []
