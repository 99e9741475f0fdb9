"""The layout tells the architecture, and these rules keep it so (static import graph of node/).

- strategies never see the wire: no grpc, protobuf stubs, transport or peering internals;
- the transport moves bytes and never imports strategies;
- peering speaks domain objects: nothing in it touches protobuf or grpc (serde is the transport's);
- Ray (an optional extra) is imported by the ray launcher alone;
- no import cycles between modules (TYPE_CHECKING imports count: a cycle in types is still one)."""
from __future__ import annotations

import ast
from pathlib import Path

NODE = Path(__file__).resolve().parents[1] / "node"


def _module(path: Path) -> str:
    rel = path.relative_to(NODE.parent).with_suffix("")
    parts = ["coterie", *rel.parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(mod: str, is_pkg: bool, node: ast.ImportFrom) -> list[str]:
    if node.level == 0:
        base = node.module or ""
    else:
        parts = mod.split(".")
        parts = parts if is_pkg else parts[:-1]
        parts = parts[: len(parts) - (node.level - 1)]
        base = ".".join(parts + ([node.module] if node.module else []))
    return [base] + [f"{base}.{a.name}" for a in node.names]


def import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in NODE.rglob("*.py"):
        mod = _module(path)
        deps: set[str] = set()
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.Import):
                deps.update(a.name for a in n.names)
            elif isinstance(n, ast.ImportFrom):
                deps.update(_resolve(mod, path.name == "__init__.py", n))
        graph[mod] = deps
    return graph


GRAPH = import_graph()


def _imports(prefix: str, forbidden: tuple[str, ...], allow: tuple[str, ...] = ()) -> list[str]:
    return sorted(f"{m} -> {d}" for m, deps in GRAPH.items() if m.startswith(prefix) and m not in allow
                  for d in deps if d.startswith(forbidden))


def test_strategies_never_see_the_wire():
    assert _imports("coterie.node.strategies", ("grpc", "coterie.proto", "coterie.node.transport",
                                                "coterie.node.peering", "coterie.node.daemon")) == []


def test_transport_never_imports_strategies():
    assert _imports("coterie.node.transport", ("coterie.node.strategies", "coterie.node.daemon")) == []


def test_peering_speaks_domain_objects():
    assert _imports("coterie.node.peering", ("grpc", "coterie.proto", "coterie.node.transport",
                                             "coterie.node.daemon")) == []


def test_ray_is_an_optional_extra_only_its_launcher_imports():
    ray = sorted(f"{m} -> {d}" for m, deps in GRAPH.items() for d in deps if d == "ray" or d.startswith("ray."))
    assert ray and all(r.startswith("coterie.node.launch.ray -> ") for r in ray), ray


def test_no_import_cycles():
    modules = set(GRAPH)
    edges = {m: {d for d in deps if d in modules and d != m} for m, deps in GRAPH.items()}
    # a package's __init__ importing its own submodules is not a cycle worth reporting
    edges = {m: {d for d in ds if not (d.startswith(m + ".") )} for m, ds in edges.items()}
    cycles, state = [], {}

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for d in sorted(edges[m]):
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d, stack + [d])
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m, [m])
    assert cycles == [], cycles
