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
- no class over 250 lines in node/ and cli/, counting the bases it inherits from them: a class that
  large does several jobs, and splitting it into mixins that share ``self`` does not split the jobs."""
from __future__ import annotations

import ast
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
    return sorted(f"{m} -> {d}" for m, deps in GRAPH.items() if m.startswith(prefix) and m not in allow
                  for d in deps if d.startswith(forbidden))


def test_the_daemon_never_imports_the_harness_or_the_cli():
    assert _imports("coterie.node", ("coterie.lab", "coterie.cli")) == []


def test_strategies_never_see_the_wire():
    assert _imports("coterie.node.strategies", ("grpc", "coterie.proto", "coterie.node.wire",
                                                "coterie.node.transport", "coterie.node.peering",
                                                "coterie.node.daemon")) == []


def test_transport_never_imports_strategies():
    assert _imports("coterie.node.transport", ("coterie.node.strategies", "coterie.node.daemon")) == []


# what only the gate may ask of a PeerHandler (the rest — snapshot, compute, gossip — the gate
# passes on after its checks); a transport module that names one of these skips the gate
HANDLER_ONLY = {"on_handshake", "on_heartbeat", "on_peer_list", "on_indirect_probe", "check_known", "admit",
                "handler"}


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


def _own_classes() -> dict[str, ast.ClassDef]:
    """Every class defined in node/ and cli/, by name (a name defined in two places is left out
    as a base: a base's name alone cannot tell them apart)."""
    found: dict[str, list[ast.ClassDef]] = {}
    for path in [*NODE.rglob("*.py"), *CLI.rglob("*.py")]:
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.ClassDef):
                found.setdefault(n.name, []).append(n)
    return {name: defs[0] for name, defs in found.items() if len(defs) == 1}


def _class_lines(cls: ast.ClassDef, own: dict[str, ast.ClassDef], seen: set[str]) -> int:
    """A class's own lines plus those of every base it inherits from node/ or cli/ (each once):
    a class split into mixins that share ``self`` is still one class."""
    lines = cls.end_lineno - cls.lineno + 1  # type: ignore[operator]
    for base in cls.bases:
        name = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else None
        if name is not None and name in own and name not in seen:
            seen.add(name)
            lines += _class_lines(own[name], own, seen)
    return lines


# Over the rule only once their bases count (each under 250 on its own), owned elsewhere and
# still to be split into objects (issue 30, item 2): the list may only shrink. A class on it that
# comes under the rule fails the test below until its entry goes.
OVER_WITH_BASES = {
    "node/transport/client.py: PeerClient",  # SnapshotStreams mixin (transport)
    "node/transport/server.py: PeerService",  # ComputeRpcs mixin (transport)
    "node/peering/network.py: NodeNetwork",  # PeerRequests mixin (the strategies' network)
    "node/learning/torch_learner.py: TorchLearner",  # PerSampleTerms, MixtureEval, TorchState mixins
    "node/strategies/federico.py: FedeRiCo",  # Strategy base (strategies)
    "node/strategies/cobo.py: COBO",
    "node/strategies/l2c.py: MetaL2C",
    "node/strategies/scool.py: SCoolSBM",
    "node/strategies/scool.py: SCoolAttention",
}


def _class_sizes() -> dict[str, int]:
    own = _own_classes()
    return {f"{path.relative_to(NODE.parent)}: {n.name}": _class_lines(n, own, {n.name})
            for path in [*NODE.rglob("*.py"), *CLI.rglob("*.py")]
            for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)}


def test_no_class_over_250_lines_including_what_it_mixes_in():
    sizes = _class_sizes()
    big = [f"{name} ({lines} lines with its bases)" for name, lines in sizes.items()
           if lines > MAX_CLASS_LINES and name not in OVER_WITH_BASES]
    assert big == [], big
    own_lines_over = [name for name in OVER_WITH_BASES if name in sizes and _own_lines(name) > MAX_CLASS_LINES]
    assert own_lines_over == [], own_lines_over  # the list excuses bases, never a class's own size
    fixed = sorted(name for name in OVER_WITH_BASES if sizes.get(name, 0) <= MAX_CLASS_LINES)
    assert fixed == [], f"under the rule now: take them off OVER_WITH_BASES: {fixed}"


def _own_lines(name: str) -> int:
    path, cls = name.split(": ")
    return next(n.end_lineno - n.lineno + 1 for n in ast.walk(ast.parse((REPO / path).read_text()))  # type: ignore[operator]
                if isinstance(n, ast.ClassDef) and n.name == cls)


def test_the_class_size_rule_counts_mixins():
    """The rule above would pass a class that dodges it by splitting into mixins, if it did not
    sum the bases: two 150-line mixins make a 300-line class."""
    body = "\n".join(f"    x{i} = {i}" for i in range(149))
    src = f"class A:\n{body}\n\nclass B:\n{body}\n\nclass C(A, B):\n    pass\n"
    classes = {n.name: n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.ClassDef)}
    assert _class_lines(classes["A"], classes, {"A"}) == 150
    assert _class_lines(classes["C"], classes, {"C"}) == 302


def test_peering_speaks_domain_objects():
    assert _imports("coterie.node.peering", ("grpc", "coterie.proto", "coterie.node.transport",
                                             "coterie.node.daemon")) == []


def test_ray_is_an_optional_extra_only_its_launcher_imports():
    ray = sorted(f"{m} -> {d}" for m, deps in GRAPH.items() for d in deps if d == "ray" or d.startswith("ray."))
    assert ray and all(r.startswith("coterie.lab.launch.ray -> ") for r in ray), ray


def test_no_import_cycles():
    graph = {m: deps for m, deps in GRAPH.items() if m.startswith(("coterie.node", "coterie.lab"))}
    modules = set(graph)
    edges = {m: {d for d in deps if d in modules and d != m} for m, deps in graph.items()}
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
