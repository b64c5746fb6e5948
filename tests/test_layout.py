"""The package's layout as a design rule, checked on the source (every import, those inside functions too):

- no import cycle between modules, and none between subpackages (a lazy import that dodges a cycle at
  load time is still one in the design);
- data flows one way, down the floors: cli -> server, training -> parallel -> engine -> inference ->
  model -> checkpoint, attention -> the root modules (config, tokenizer, _checks, _native). parallel sits above
  the engine (PD disaggregation drives two engines) and below training (FSDP shards a model to train);
- every module imports on its own.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import mini_transformer

PACKAGE = Path(mini_transformer.__file__).parent
ROOT_NAME = "mini_transformer"

# Floors, lowest first. A module may import from its own floor's subpackage and from lower floors only.
FLOORS = [
    {"config", "tokenizer", "_checks", "_native"},
    {"attention", "checkpoint"},
    {"model"},
    {"inference"},
    {"engine"},
    {"parallel"},
    {"training", "server"},
    {"cli"},
]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    parts = parts[:-1] if parts[-1] == "__init__" else parts
    return ".".join((ROOT_NAME, *parts))


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def resolve(current: str, is_package: bool, node: ast.ImportFrom | ast.Import) -> list[str]:
    """The modules of this package an import statement loads (a `from X import name` where X.name is
    a module counts as importing X.name)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == ROOT_NAME]
    if node.level:
        base = current.split(".")
        base = base if is_package else base[:-1]
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    if target.split(".")[0] != ROOT_NAME:
        return []
    found = []
    for alias in node.names:
        child = f"{target}.{alias.name}"
        found.append(child if child in MODULES else target)
    return found


def import_graph() -> dict[str, set[str]]:
    graph = {}
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        edges = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                edges.update(t for t in resolve(name, path.name == "__init__.py", node) if t in MODULES)
        edges.discard(name)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan), each as a sorted list."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
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
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def subpackage(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""  # "" = the package's own __init__


def subpackage_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Subpackage -> subpackages it imports. The top-level __init__ (the public API) re-exports from
    below and is left out, as is an import of a subpackage by itself."""
    out: dict[str, set[str]] = {}
    for src, targets in graph.items():
        a = subpackage(src)
        if not a:
            continue
        out.setdefault(a, set()).update(b for b in map(subpackage, targets) if b and b != a)
    return out


def floor(sub: str) -> int:
    return next(i for i, names in enumerate(FLOORS) if sub in names)


def test_every_subpackage_and_root_module_has_a_floor():
    subs = {subpackage(m) for m in MODULES} - {""}
    missing = sorted(s for s in subs if not any(s in names for names in FLOORS))
    assert not missing, f"give these a floor in FLOORS: {missing}"


def test_no_import_cycle_between_modules():
    found = cycles(import_graph())
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_no_import_cycle_between_subpackages():
    found = cycles(subpackage_graph(import_graph()))
    assert not found, "subpackage cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_imports_go_down_the_floors():
    wrong = [f"{a} (floor {floor(a)}) imports {b} (floor {floor(b)})"
             for a, targets in subpackage_graph(import_graph()).items() for b in targets if floor(b) > floor(a)]
    assert not wrong, "\n".join(wrong)


def test_the_checker_finds_a_cycle_and_an_upward_import():
    """The checker itself, on a made-up graph: a lazy import closing a loop is a cycle."""
    graph = {"p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a"}, "p.d": {"p.a"}}
    assert cycles(graph) == [["p.a", "p.b", "p.c"]]
    tree = ast.parse("def f():\n    from ..model.transformer import TransformerLM\n")
    node = tree.body[0].body[0]
    assert resolve("mini_transformer.checkpoint.hf", False, node) == ["mini_transformer.model.transformer"]


@pytest.mark.parametrize("name", sorted(m for m in MODULES if not m.endswith("__main__")))
def test_every_module_imports(name):
    importlib.import_module(name)
