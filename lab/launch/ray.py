"""The ``ray`` backend of ``coterie run``: groups of in-process nodes as Ray actors across a Ray
cluster (Ray is an optional extra: ``pip install 'coterie[ray]'``).

Placement. The scenario's nodes are cut into G contiguous groups (n0..n3 | n4..n7 | ...): by
default one per alive Ray node that has ``cpus`` CPUs to give (``--groups`` asks for more or
fewer). Group k is one actor (``NodeGroup``), pinned to Ray node k mod R with a hard node-affinity,
holding ``cpus`` CPUs of it.

Inside an actor. What the ``inproc`` backend does in its one process: every node of the group on
one event loop, one compute thread pool, the dataset pool loaded once. Each node runs on the
routing transport (``transport/routing.py``): it serves real gRPC on the Ray node's IP (port 0)
and its calls to a node of the same actor go through memory, every other call over gRPC — the
mTLS-capable transport a real network uses. Each node's calls and bytes by route are reported.

Start-up. All actors are created and warmed in parallel (imports, dataset pool, partition), then
started group by group: a node's bootstrap peer always has a lower index (chain: i-1, star: 0), so
with contiguous groups every address a group needs is known by the time it starts.

Files. Node configs (with the addresses the nodes really had), state dirs and ``results.json``
have the layout of the other backends. An actor writes its nodes' state dirs at the path the
driver names (``DIR/<strategy>/nodes/n{i}``: on this machine, or a filesystem the cluster
shares, the driver's own files) and hands every node's history, ``node.json`` and final status
back at the end; the driver writes the ones it cannot see (an actor on another machine) into
its own ``DIR/<strategy>/nodes/``, so results.json is assembled as for every backend. Logs of a
group: ``DIR/<strategy>/logs/ray-g{k}.log`` on the actor's machine. Placement, the Ray node and
process of each group and every node's route counters go into results.json as ``placement``.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coterie.node.config import ConfigError
from coterie.node.fsutil import atomic_write_json

from ..scenario import NodeSpec, Scenario, StrategyRun, bootstrap_index, config_toml, node_config
from .common import LauncherError, LiveView, NodeProgress, collect, fresh_strategy_dir, network_done, read_history

RAY_MISSING = "the ray backend needs Ray, which is not installed: pip install 'coterie[ray]'"
STOP_TIMEOUT_S = 60.0  # a group's nodes stopping (each finishes its round): then the actor is killed


def ray_problem() -> str | None:
    """None if Ray can be imported (checked without importing it: that takes a second)."""
    return None if importlib.util.find_spec("ray") is not None else RAY_MISSING


def import_ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise ConfigError(f"{RAY_MISSING} ({e})") from None
    return ray


@contextlib.contextmanager
def ray_session(address: str | None = None) -> Iterator[Any]:
    """Connected to a Ray cluster for the duration: ``address`` as ``ray.init`` takes it (None: the
    cluster in ``RAY_ADDRESS``, else a new local one; "auto": the one running on this machine).
    A session this call opened is closed again; one already open is used as it is."""
    ray = import_ray()
    if ray.is_initialized():
        yield ray
        return
    try:
        # nodes log to files; Ray's own worker output would tear through the live view
        ray.init(address=address, log_to_driver=False, configure_logging=False)
    except Exception as e:  # ConnectionError, RuntimeError, ValueError...: all "no cluster there"
        where = address or os.environ.get("RAY_ADDRESS") or "a new local instance"
        raise LauncherError(
            f"cannot connect to Ray ({where}): {type(e).__name__}: "
            f"{str(e).strip().splitlines()[0] if str(e).strip() else e}"
        ) from None
    try:
        yield ray
    finally:
        ray.shutdown()


# ------------------------------------------------------------------------------------- placement
@dataclass
class Group:
    index: int
    ray_node: str  # Ray node id the actor is pinned to
    host: str  # that node's address, as Ray knows it
    nodes: list[int]  # node indices, contiguous


def plan(n: int, ray_nodes: list[dict[str, Any]], groups: int | None = None, cpus: float = 1.0) -> list[Group]:
    """Cut nodes 0..n-1 into contiguous groups over the alive Ray nodes (as ``ray.nodes()`` lists
    them) with ``cpus`` CPUs each; LauncherError when they do not fit."""
    usable = sorted(
        (r for r in ray_nodes if r.get("Alive") and float(r.get("Resources", {}).get("CPU", 0)) >= cpus),
        key=lambda r: (str(r.get("NodeManagerAddress")), str(r["NodeID"])),
    )
    if not usable:
        raise LauncherError(
            f"no alive Ray node has {cpus:g} CPU(s) for a group of nodes ({len(ray_nodes)} Ray node(s) in the cluster)"
        )
    g = min(groups or len(usable), n)
    if g < 1:
        raise LauncherError(f"groups must be at least 1 (got {groups})")
    per_node: dict[str, int] = {}
    for k in range(g):
        nid = usable[k % len(usable)]["NodeID"]
        per_node[nid] = per_node.get(nid, 0) + 1
    for r in usable:
        need = per_node.get(r["NodeID"], 0) * cpus
        if need > float(r["Resources"]["CPU"]):
            raise LauncherError(
                f"{g} groups of {cpus:g} CPU(s) do not fit: Ray node {r['NodeManagerAddress']} "
                f"has {r['Resources']['CPU']:g} CPUs for {per_node[r['NodeID']]} of them"
            )
    base, extra = divmod(n, g)
    out, start = [], 0
    for k in range(g):
        size = base + (1 if k < extra else 0)
        r = usable[k % len(usable)]
        out.append(Group(k, r["NodeID"], str(r.get("NodeManagerAddress", "?")), list(range(start, start + size))))
        start += size
    return out


def prepare(sc: Scenario, strategy: str, out_dir: Path, placement: list[Group]) -> list[NodeSpec]:
    """Every node's config for ``strategy`` as the inproc backend makes them (its membership timing
    included); listen address and bootstrap peer are filled in by the node's actor."""
    from .inproc import membership_timing
    from .processes import with_certificate

    strat_dir = fresh_strategy_dir(out_dir, strategy)
    group_of = {i: g.index for g in placement for i in g.nodes}
    specs = []
    for i in range(sc.nodes):
        cfg = node_config(sc, strategy, i, strat_dir)
        cfg = cfg.model_copy(update=membership_timing(cfg, sc.nodes))
        # groups talk gRPC to each other: mTLS, each node a certificate of the run's throwaway CA
        cfg = with_certificate(cfg, strat_dir / "pki")
        path = strat_dir / "configs" / f"n{i}.toml"
        path.write_text(config_toml(cfg))
        specs.append(NodeSpec(i, cfg, path, strat_dir / "logs" / f"ray-g{group_of[i]}.log"))
    return specs


def certificate_files(cfg: Any) -> dict[str, str] | None:
    """A node's certificate directory as {file name: PEM text}, for an actor on a machine that may
    not see the driver's files (the CA key never leaves the driver)."""
    d = cfg.security.cert_dir
    if d is None:
        return None
    from coterie.node.security.pki import CA_CERT, NODE_CERT, NODE_KEY

    return {name: (Path(d) / name).read_text() for name in (CA_CERT, NODE_CERT, NODE_KEY)}


def _local_certs(config: dict[str, Any], files: dict[str, str] | None) -> dict[str, Any]:
    """``config`` with its certificate directory present on this machine: the driver's path when
    it is visible here (one machine, a shared filesystem), else the shipped files written to a
    private temp dir (key 0600)."""
    sec = dict(config.get("security") or {})
    if not files or not sec.get("cert_dir") or Path(sec["cert_dir"]).is_dir():
        return config
    import tempfile

    d = Path(tempfile.mkdtemp(prefix=f"coterie-{config.get('node_id')}-certs-"))
    for name, text in files.items():
        f = d / name
        f.write_text(text)
        if name.endswith(".key"):
            f.chmod(0o600)
    return {**config, "security": {**sec, "cert_dir": str(d)}}


# -------------------------------------------------------------------------------- the actor
class GroupError(RuntimeError):
    """A group's failure, with the group and its machine named (what the driver reports)."""


class NodeGroup:
    """A group of nodes in one process (made a Ray actor by ``ray.remote(NodeGroup)``): the
    inproc backend's event loop and thread pool, each node on a routing transport."""

    def __init__(
        self,
        group: int,
        configs: list[dict[str, Any]],
        bootstraps: list[int | None],
        log_path: str,
        threads: int | None = None,
        certs: dict[str, dict[str, str]] | None = None,
    ):
        from coterie.node.config import validate_config

        self.group, self.log_path = group, log_path
        self.configs = [validate_config(_local_certs(c, (certs or {}).get(c.get("node_id", "")))) for c in configs]
        self.bootstraps = bootstraps
        self.threads = threads
        self.nodes: list[Any] = []
        self.transports: list[Any] = []
        self.pool: ThreadPoolExecutor | None = None
        self.logs: Any = None
        self.where = f"group {group} on {socket.gethostname()} (pid {os.getpid()})"

    def _fail(self, what: str, e: BaseException) -> GroupError:
        return GroupError(f"{self.where}: {what}: {type(e).__name__}: {e}; see {self.log_path}")

    def whereabouts(self) -> dict[str, Any]:
        import ray

        return {
            "group": self.group,
            "host": socket.gethostname(),
            "ip": ray.util.get_node_ip_address(),
            "pid": os.getpid(),
            "ray_node": ray.get_runtime_context().get_node_id(),
            "nodes": [c.node_id for c in self.configs],
        }

    async def warm(self) -> dict[str, Any]:
        """Imports, the dataset pool and the partition, once for the group, before any node starts."""
        from coterie.node.learning.torch_learner import build_learner

        from .inproc import _NodeLogs, default_threads

        Path(self.log_path).parent.mkdir(parents=True, exist_ok=True)
        self.logs = _NodeLogs(Path(self.log_path), self.configs[0].log_level).__enter__()
        self.pool = ThreadPoolExecutor(max_workers=self.threads or default_threads(), thread_name_prefix="compute")
        asyncio.get_running_loop().set_default_executor(self.pool)
        try:
            await asyncio.to_thread(build_learner, self.configs[0].learner)
        except Exception as e:
            raise self._fail("loading the data failed", e) from None
        return self.whereabouts()

    async def start(self, addresses: dict[int, str]) -> dict[int, str]:
        """Start the group's nodes, bootstrapping from ``addresses`` (node index → peer address)
        or from a node of this group; return the addresses of this group's nodes."""
        import ray

        from coterie.node.daemon import Node
        from coterie.node.transport.inproc import InProcNetwork
        from coterie.node.transport.routing import RoutingTransport

        ip = ray.util.get_node_ip_address()
        host = f"[{ip}]" if ":" in ip else ip
        switchboard = InProcNetwork()
        mine: dict[int, str] = {}
        for cfg, b in zip(self.configs, self.bootstraps, strict=True):
            index = cfg.learner.node_index
            peer = None if b is None else mine.get(b, addresses.get(b))
            if b is not None and peer is None:
                raise GroupError(f"{self.where}: node {cfg.node_id}'s bootstrap peer n{b} has no address yet")
            cfg = cfg.model_copy(update={"listen": f"{host}:0", "peers": [peer] if peer else []})
            try:
                transport = RoutingTransport.from_config(switchboard, cfg)
                node = Node(cfg, transport=transport, admin=False)
                self.nodes.append(node)
                self.transports.append(transport)
                await node.start()
            except (OSError, ValueError, RuntimeError) as e:
                raise self._fail(f"node {cfg.node_id} could not start", e) from None
            mine[index] = node.address
            await asyncio.sleep(0)  # let the nodes already up serve while the rest start
        return mine

    async def progress(self) -> list[dict[str, Any]]:
        out = []
        for node in self.nodes:
            died = None
            if not node.healthy():
                task = node._round_task
                died = (
                    repr(task.exception())
                    if task is not None and task.done() and not task.cancelled()
                    else "its round loop is not running"
                )
            out.append({"round": node.round, "done": node.done, "acc": node.last_eval.get("test_acc"), "died": died})
        return out

    async def finish(self) -> dict[str, Any]:
        """Stop every node; each node's final status, history, node.json, config and routes."""
        statuses = [node.status() for node in self.nodes]
        await self.stop()
        out = {}
        for node, status, t in zip(self.nodes, statuses, self.transports, strict=True):
            state = Path(node.cfg.state_dir)
            try:
                info = json.loads((state / "node.json").read_text())
            except (OSError, ValueError):
                info = {}
            out[node.node_id] = {
                "status": status,
                "history": read_history(state / "history.jsonl"),
                "node_json": info,
                "config": node.cfg.model_dump(mode="json"),
                "routes": t.stats.as_dict(),
            }
        return {**self.whereabouts(), "results": out}

    async def stop(self) -> None:
        for node in self.nodes:
            try:
                await node.stop()
            except Exception:  # one node's failing stop must not keep the others running
                pass
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None
        if self.logs is not None:
            self.logs.__exit__(None, None, None)
            self.logs = None


# ------------------------------------------------------------------------------- the driver
def _get(ray: Any, refs: Any, what: str, timeout: float) -> Any:
    """``ray.get`` with Ray's failures as one-line LauncherErrors."""
    try:
        return ray.get(refs, timeout=max(1.0, timeout))
    except ray.exceptions.GetTimeoutError:
        raise LauncherError(f"{what}: no answer from the Ray actors within {timeout:.0f}s") from None
    except ray.exceptions.RayTaskError as e:
        cause = getattr(e, "cause", None) or e
        raise LauncherError(f"{what}: {cause}") from None
    except ray.exceptions.RayActorError as e:
        raise LauncherError(f"{what}: a group's actor died: {str(e).strip().splitlines()[0]}") from None


def _write_back(spec: NodeSpec, got: dict[str, Any]) -> None:
    """A node's files into the driver's run directory: its effective config (with the addresses
    it had), and its history and node.json when its actor ran where the driver cannot see."""
    from coterie.node.config import validate_config

    spec.config = validate_config(got["config"])
    spec.config_path.write_text(config_toml(spec.config))
    state = spec.state_dir
    state.mkdir(parents=True, exist_ok=True)
    if not (state / "history.jsonl").exists():
        (state / "history.jsonl").write_text("".join(json.dumps(e) + "\n" for e in got["history"]))
    if not (state / "node.json").exists() and got["node_json"]:
        atomic_write_json(state / "node.json", got["node_json"])


def run_strategy(
    sc: Scenario,
    strategy: str,
    out_dir: Path,
    *,
    console: Any = None,
    groups: int | None = None,
    cpus: float = 1.0,
    threads: int | None = None,
    poll_interval_s: float = 0.5,
) -> StrategyRun:
    """Run one strategy's network on the connected Ray cluster (``ray_session``) to completion."""
    ray = import_ray()
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    placement = plan(sc.nodes, ray.nodes(), groups, cpus)
    specs = prepare(sc, strategy, out_dir, placement)
    progress = [NodeProgress() for _ in specs]
    actor_cls = ray.remote(NodeGroup)
    t0 = time.time()
    deadline = time.monotonic() + sc.timeout_s
    left = lambda: deadline - time.monotonic()  # noqa: E731
    actors = [
        actor_cls.options(
            num_cpus=cpus,
            name=None,
            max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=g.ray_node, soft=False),
        ).remote(
            g.index,
            [specs[i].config.model_dump(mode="json") for i in g.nodes],
            [bootstrap_index(sc, i) for i in g.nodes],
            str(specs[g.nodes[0]].log_path),
            threads,
            {specs[i].config.node_id: certificate_files(specs[i].config) for i in g.nodes},
        )
        for g in placement
    ]
    view = LiveView(console, strategy, specs, sc.rounds) if console else None
    finished = False
    try:
        where = _get(ray, [a.warm.remote() for a in actors], "starting the groups", left())
        addresses: dict[int, str] = {}
        for g, actor in zip(placement, actors, strict=True):
            addresses.update(_get(ray, actor.start.remote(addresses), f"starting group {g.index}", left()))
        if view:
            view.__enter__()
        while True:
            reports = _get(ray, [a.progress.remote() for a in actors], "polling the groups", left())
            for g, report in zip(placement, reports, strict=True):
                for i, r in zip(g.nodes, report, strict=True):
                    if r["died"]:
                        raise LauncherError(
                            f"node {specs[i].node_id} (group {g.index}): {r['died']} at round "
                            f"{r['round']}/{sc.rounds}; see {specs[i].log_path} on {where[g.index]['host']}"
                        )
                    progress[i].observe(r["round"], r["done"], r["acc"])
            if network_done(strategy, specs, progress, view, deadline, sc.timeout_s):
                break
            time.sleep(poll_interval_s)
        done = _get(ray, [a.finish.remote() for a in actors], "stopping the groups", max(left(), STOP_TIMEOUT_S))
        finished = True
    finally:
        if view:
            view.__exit__()
        if not finished:  # a failure or Ctrl-C: stop what runs (its logs end cleanly), then kill
            with contextlib.suppress(Exception):
                ray.get([a.stop.remote() for a in actors], timeout=STOP_TIMEOUT_S)
        for a in actors:
            with contextlib.suppress(Exception):
                ray.kill(a)
    wall = time.time() - t0
    routes = {}
    for g, got in zip(placement, done, strict=True):
        for i in g.nodes:
            node = got["results"][specs[i].node_id]
            _write_back(specs[i], node)
            progress[i].update(node["status"])
            routes[specs[i].node_id] = node["routes"]
    run = collect(strategy, specs, sc.rounds, wall, progress)
    run.placement = {
        "groups": [{k: got[k] for k in ("group", "host", "ip", "pid", "ray_node", "nodes")} for got in done],
        "routes": routes,
    }
    return run
