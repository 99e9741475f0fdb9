"""The layout tells the architecture, and these rules keep it so (static import graph of the
daemon node/, the experiment harness lab/ and the CLI cli/).

- the daemon never imports the harness or the CLI: a deployed node runs without them;
- strategies never see the wire: no grpc, protobuf stubs, wire codec, transport or peering internals;
- the transport moves bytes and never imports strategies; it reaches this node's handler only
  through the gate (``transport/gate.py``), so every check is written once for every transport;
- peering speaks domain objects: nothing in it touches protobuf or grpc (serde is the transport's);
- Ray (an optional extra) is imported by the ray launcher alone;
- no import cycles between the daemon's and the harness's modules (TYPE_CHECKING imports count: a
  cycle in types is still one), nor between config and privacy (the config names privacy's
  purposes; privacy reads its knobs through a protocol). The CLI is the top layer and is left out:
  the processes launcher runs the CLI's ``node start`` in each forked daemon, and the CLI's ``run``
  starts the launcher;
- no class over 250 lines in node/ and cli/, counting what it alone mixes in and not the lines a
  formatter wraps: a class that large does several jobs."""

from __future__ import annotations

import ast
import io
import tokenize
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("node", "lab", "cli")  # folders mapped to coterie.<folder> (pyproject's package-dir)
NODE = REPO / "node"
CLI = REPO / "cli"
MAX_CLASS_LINES = 250


def _module(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
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
    for path in (p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")):
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
    return sorted(
        f"{m} -> {d}"
        for m, deps in GRAPH.items()
        if m.startswith(prefix) and m not in allow
        for d in deps
        if d.startswith(forbidden)
    )


def test_the_daemon_never_imports_the_harness_or_the_cli():
    assert _imports("coterie.node", ("coterie.lab", "coterie.cli")) == []


def test_strategies_never_see_the_wire():
    assert (
        _imports(
            "coterie.node.strategies",
            (
                "grpc",
                "coterie.proto",
                "coterie.node.wire",
                "coterie.node.transport",
                "coterie.node.peering",
                "coterie.node.daemon",
            ),
        )
        == []
    )


def test_transport_never_imports_strategies():
    assert _imports("coterie.node.transport", ("coterie.node.strategies", "coterie.node.daemon")) == []


# what only the gate may ask of a PeerHandler (the rest — snapshot, compute, gossip — the gate
# passes on after its checks); a transport module that names one of these skips the gate
HANDLER_ONLY = {"on_handshake", "on_heartbeat", "on_peer_list", "on_indirect_probe", "check_known", "admit", "handler"}


def test_transports_reach_the_handler_only_through_the_gate():
    gate = "coterie.node.transport.gate"
    assert _imports("coterie.node.transport", ("coterie.node.peering.served",)) == []
    bypass = []
    for path in (NODE / "transport").glob("*.py"):
        if _module(path) == gate:
            continue
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.Attribute) and n.attr in HANDLER_ONLY:
                bypass.append(f"{path.name}:{n.lineno} .{n.attr}")
    assert bypass == [], bypass
    for served_by in ("server", "inproc"):  # both serve through it
        assert gate in GRAPH[f"coterie.node.transport.{served_by}"], served_by


def test_config_and_privacy_do_not_import_each_other_both_ways():
    assert _imports("coterie.node.privacy", ("coterie.node.config",)) == []


def _statement_lines(source: str) -> set[int]:
    """The lines of a file that count toward a class's size: all but blank lines and the
    continuation lines of a bracketed expression, so an argument list counts once however the
    formatter wraps it (``ruff format`` explodes a long one a line per argument). Comments and
    docstrings count: they are text a reader reads."""
    skip: set[int] = set()
    depth, start = 0, 0
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.OP and tok.string in "([{":
            if depth == 0:
                start = tok.start[0]
            depth += 1
        elif tok.type == tokenize.OP and tok.string in ")]}":
            depth -= 1
            if depth == 0:
                skip.update(range(start + 1, tok.end[0] + 1))
    lines = source.splitlines()
    return {i for i in range(1, len(lines) + 1) if i not in skip and lines[i - 1].strip()}


@dataclass
class _Class:
    key: str  # "node/x.py: Name"
    node: ast.ClassDef
    size: int  # its own statement lines


def _classes(sources: dict[str, str]) -> list[_Class]:
    found = []
    for rel, src in sources.items():
        counted = _statement_lines(src)
        for n in ast.walk(ast.parse(src)):
            if isinstance(n, ast.ClassDef):
                size = sum(1 for i in range(n.lineno, (n.end_lineno or n.lineno) + 1) if i in counted)
                found.append(_Class(f"{rel}: {n.name}", n, size))
    return found


def _base_names(cls: ast.ClassDef) -> list[str]:
    return [b.id if isinstance(b, ast.Name) else b.attr for b in cls.bases if isinstance(b, ast.Name | ast.Attribute)]


def _sizes_with_mixins(classes: list[_Class]) -> dict[str, int]:
    """Each class's statement lines plus those of every base that it alone inherits (a mixin:
    a class split into parts that share ``self`` is still one class). A base several classes
    share (``Strategy``, ``UnaryCalls``) is an interface or a template, not a part of one of them.
    A name defined twice is left out: a base's name alone cannot say which is meant."""
    by_name: dict[str, list[_Class]] = {}
    for c in classes:
        by_name.setdefault(c.node.name, []).append(c)
    heirs: dict[str, set[str]] = {}
    for c in classes:
        for b in _base_names(c.node):
            heirs.setdefault(b, set()).add(c.key)

    def total(c: _Class, seen: set[str]) -> int:
        n = c.size
        for b in _base_names(c.node):
            if len(by_name.get(b, ())) == 1 and len(heirs[b]) == 1 and b not in seen:
                seen.add(b)
                n += total(by_name[b][0], seen)
        return n

    return {c.key: total(c, {c.node.name}) for c in classes}


def test_no_class_over_250_lines():
    sources = {str(p.relative_to(NODE.parent)): p.read_text() for p in [*NODE.rglob("*.py"), *CLI.rglob("*.py")]}
    classes = _classes(sources)
    sizes = _sizes_with_mixins(classes)
    big = [
        f"{c.key} ({sizes[c.key]} lines with its mixins, {c.size} its own)"
        for c in classes
        if sizes[c.key] > MAX_CLASS_LINES
    ]
    assert big == [], big


def test_the_class_size_rule_counts_mixins_not_shared_bases_nor_wrapping():
    src = (
        "class A:\n"
        + "    x = 1\n" * 200
        + "class B:\n"
        + "    y = f(\n        1,\n        2,\n    )\n" * 100
        + "class C(A, B):\n    pass\n"
        + "class Shared:\n"
        + "    z = 1\n" * 300
        + "class D(Shared):\n    pass\n"
        + "class E(Shared):\n    pass\n"
    )
    sizes = _sizes_with_mixins(_classes({"m.py": src}))
    assert sizes["m.py: C"] == 2 + 201 + 101  # A and B are C's alone; B's wrapped calls count once each
    assert sizes["m.py: D"] == 2  # Shared has two heirs: a base, not a mixin


def test_peering_speaks_domain_objects():
    assert (
        _imports("coterie.node.peering", ("grpc", "coterie.proto", "coterie.node.transport", "coterie.node.daemon"))
        == []
    )


def test_ray_is_an_optional_extra_only_its_launcher_imports():
    ray = sorted(f"{m} -> {d}" for m, deps in GRAPH.items() for d in deps if d == "ray" or d.startswith("ray."))
    assert ray and all(r.startswith("coterie.lab.launch.ray -> ") for r in ray), ray


def test_no_import_cycles():
    graph = {m: deps for m, deps in GRAPH.items() if m.startswith(("coterie.node", "coterie.lab"))}
    modules = set(graph)
    edges = {m: {d for d in deps if d in modules and d != m} for m, deps in graph.items()}
    # a package's __init__ importing its own submodules is not a cycle worth reporting
    edges = {m: {d for d in ds if not (d.startswith(m + "."))} for m, ds in edges.items()}
    cycles, state = [], {}

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for d in sorted(edges[m]):
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d) :] + [d])
            elif d not in state:
                visit(d, stack + [d])
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m, [m])
    assert cycles == [], cycles


def _attrs_of(tree: ast.AST, name: str) -> set[str]:
    """The attributes read off variable ``name`` anywhere in ``tree``."""
    return {
        n.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == name
    }


def test_every_declared_rpc_is_served_gated_and_called_by_every_transport():
    """The table (peering/api.py) is the peer API's unary calls: each has a serde pair matching
    the proto, the gRPC servicer and the in-process client derive it (through the gate's one
    path), every client takes it through one ``call``, and the handler answers it."""
    from coterie.node.peering import api
    from coterie.node.peering.interfaces import PeerHandler
    from coterie.node.peering.served import ServedRequests
    from coterie.node.transport import client, inproc, routing, serde, server
    from coterie.proto.v1 import peer_pb2 as pb

    service = pb.DESCRIPTOR.services_by_name["Peer"]
    unary = {m.name for m in service.methods if not m.client_streaming and not m.server_streaming}
    assert {rpc.name for rpc in api.UNARY} == unary, "a unary RPC of peer.proto is not in the table (or the reverse)"
    named = {n for n in vars(api.UnaryCalls) if not n.startswith("_")} - {"call", "send", "welcomed"}
    for rpc in api.UNARY:
        wire = serde.WIRE[rpc.name]  # its serde pair
        method = service.methods_by_name[rpc.name]
        assert wire.request.DESCRIPTOR is method.input_type and wire.reply.DESCRIPTOR is method.output_type, rpc.name
        assert not hasattr(server.PeerService, rpc.name), f"{rpc.name} is hand-written in the servicer"
    for cls in (client.PeerClient, inproc.InProcClient, routing.RoutingClient):
        assert issubclass(cls, api.UnaryCalls) and "send" in vars(cls), cls
        assert not named & set(vars(cls)), f"{cls.__name__} writes a unary call by hand"
    # the derived servicer method and the in-process call both go through the gate's one path
    for path, fn in ((NODE / "transport" / "server.py", "unary"), (NODE / "transport" / "inproc.py", "send")):
        body = next(
            n
            for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, ast.AsyncFunctionDef | ast.FunctionDef) and n.name == fn
        )
        assert "unary" in _attrs_of(body, "self") | {
            n.attr for n in ast.walk(body) if isinstance(n, ast.Attribute) and n.attr == "unary"
        }, path
    # what the table asks of the handler, the PeerHandler protocol and the node's handler have
    tree = ast.parse((NODE / "peering" / "api.py").read_text())
    asked = _attrs_of(tree, "h") | {
        n.args[0].value
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "answered_by"
    }
    assert asked, "the table asks nothing of the handler?"
    served_attrs = _attrs_of(ast.parse((NODE / "peering" / "served.py").read_text()), "self")  # (set in __init__ too)
    missing = sorted(a for a in asked if not (hasattr(ServedRequests, a) or a in served_attrs))
    assert "on_revocations" in asked and "on_heartbeat" in asked  # (both ways of declaring it are seen)
    typed = _attrs_of(tree, "h")  # what is called on the protocol itself is on it
    assert sorted(a for a in typed if not (hasattr(PeerHandler, a) or a in PeerHandler.__annotations__)) == []
    assert missing == [], missing
