"""The import graph between kvserve's rooms (its packages and top-level modules) has no circle:
every `from kvserve.X import ...` / `import kvserve.X`, at module level or inside a function,
read from the sources with `ast`."""

from __future__ import annotations

import ast
from pathlib import Path

import kvserve

ROOT = Path(kvserve.__file__).parent


def _module_name(path: Path) -> str:
    parts = ("kvserve", *path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.startswith("kvserve"):
            names |= {f"kvserve.{a.name}" for a in node.names} if node.module == "kvserve" else {node.module}
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names if a.name.startswith("kvserve.")}
    return names


def _room(module: str) -> str:
    """kvserve.engine.scheduler -> engine; kvserve.config -> config (a top-level module is its own room)."""
    return module.split(".")[1] if "." in module else module


def module_graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
    return {m: {t for t in _imported(ast.parse(p.read_text())) if t in modules or t.rsplit(".", 1)[0] in modules}
            for m, p in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in list(graph):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_circle_between_rooms():
    rooms: dict[str, set[str]] = {}
    for module, targets in module_graph().items():
        rooms.setdefault(_room(module), set()).update(_room(t) for t in targets if _room(t) != _room(module))
    assert cycles(rooms) == []


def test_the_graph_sees_lazy_imports():
    """A function-level import counts as much as a module-level one (llm.py starts tensor-parallel
    ranks through an import inside _ranks; config.py imports model.quant at the top)."""
    graph = module_graph()
    assert "kvserve.distributed.tensor_parallel" in graph["kvserve.llm"]
    assert "kvserve.model.quant" in graph["kvserve.config"]
