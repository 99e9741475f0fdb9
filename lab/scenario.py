"""Scenarios: a whole experiment network described in one TOML file, validated before anything starts.

Scenario file (TOML)
====================

.. code-block:: toml

    name = "two-clusters"        # free text, copied into results.json
    description = "..."          # optional
    seed = 0                     # data_seed and init_seed of every node; node i gets seed + i
    nodes = 8                    # number of node daemons, ids n0 .. n7
    rounds = 30                  # rounds every node runs before it reports done
    strategy = ["local", "fedfomo"]   # one name or a list: each runs in turn on identical data
    bootstrap = "chain"          # "chain": n_i knows n_{i-1}; "star": n_i knows n0. Discovery
                                 # (peer exchange) does the rest.
    timeout_s = 1800             # per strategy: give up (and stop every node) after this long

    [strategy_params.fedfomo]    # parameters per strategy name (Strategy.defaults keys)
    M = 5

    [learner]                    # LearnerConfig fields shared by all nodes
    dataset = "mnist1d"
    partition = "label_permutation"
    partition_params = { num_clusters = 2 }
    model = "mlp"

    [node]                       # NodeConfig fields shared by all nodes
    round_interval_s = 0.2
    min_peers = 7                # default: nodes - 1, so round 1 waits for full membership
    start_timeout_s = 120        # default 120

    [[overrides]]                # per-node changes, applied last, in file order
    nodes = [3]                  # node indices (0-based)
    learner.label_noise = 1.0    # any NodeConfig field; dotted keys descend (TOML dotted keys)

    [[overrides]]
    nodes = [7]
    round_interval_s = 2.0       # a slow node
    delay_ms = 50

Own data (docs/own-data.md): ``learner.data = "folder/{node}.npz"`` gives every node its own file;
``{node}`` becomes the node id (n0, n1, ...) and ``{index}`` its index. A relative path is taken
from the scenario file's folder.

The launcher owns these fields and refuses them in ``[node]``/``[learner]``/``[[overrides]]``:
``node_id, state_dir, listen, advertise, admin_listen, peers, strategy, rounds`` and
``learner.num_nodes, learner.node_index, learner.data_seed, learner.init_seed``.

"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from coterie.node.config import ConfigError, NodeConfig, deep_merge, read_toml, validate_config

RESERVED_NODE = ("node_id", "state_dir", "listen", "advertise", "admin_listen", "peers", "strategy", "rounds")
RESERVED_LEARNER = ("num_nodes", "node_index", "data_seed", "init_seed")


class Scenario(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = "scenario"
    description: str = ""
    seed: int = 0
    nodes: int = Field(..., ge=1, le=10_000)  # per backend: launch.MAX_NODES
    rounds: int = Field(..., ge=1)
    strategy: list[str] = Field(default_factory=lambda: ["local"], min_length=1)
    strategy_params: dict[str, dict[str, Any]] = Field(default_factory=dict)
    bootstrap: Literal["chain", "star"] = "chain"
    timeout_s: float = Field(1800.0, gt=0)
    learner: dict[str, Any] = Field(default_factory=dict)
    node: dict[str, Any] = Field(default_factory=dict)
    overrides: list[dict[str, Any]] = Field(default_factory=list)

    @field_validator("strategy", mode="before")
    @classmethod
    def _one_or_list(cls, v: Any) -> Any:
        if isinstance(v, str):
            v = [s.strip() for s in v.split(",") if s.strip()]
        return v

    @field_validator("strategy")
    @classmethod
    def _unique(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError(f"listed twice: {sorted({s for s in v if v.count(s) > 1})}")
        return v


def _check_scenario(sc: Scenario) -> None:
    """Cross-field checks pydantic alone cannot express; messages name the field."""
    for k in RESERVED_NODE + ("learner",):
        if k in sc.node:
            raise ConfigError(
                f"scenario: node.{k} is set by the launcher" + (" (use the [learner] table)" if k == "learner" else "")
            )
    for k in RESERVED_LEARNER:
        if k in sc.learner:
            raise ConfigError(f"scenario: learner.{k} is set by the launcher" + (" (from seed)" if "seed" in k else ""))
    for s in sc.strategy_params:
        if s not in sc.strategy:
            raise ConfigError(f"scenario: strategy_params.{s} given but {s!r} is not in strategy {sc.strategy}")
    for n, ov in enumerate(sc.overrides):
        where = f"overrides[{n}]"
        nodes = ov.get("nodes")
        if (
            not isinstance(nodes, list)
            or not nodes
            or not all(isinstance(i, int) and not isinstance(i, bool) for i in nodes)
        ):
            raise ConfigError(f"scenario: {where}.nodes must be a non-empty list of node indices")
        bad = [i for i in nodes if not 0 <= i < sc.nodes]
        if bad:
            raise ConfigError(f"scenario: {where}.nodes: {bad} out of range 0..{sc.nodes - 1}")
        for k in RESERVED_NODE:
            if k in ov:
                raise ConfigError(f"scenario: {where}.{k} is set by the launcher")
        for k in RESERVED_LEARNER:
            if k in (ov.get("learner") or {}):
                raise ConfigError(f"scenario: {where}.learner.{k} is set by the launcher")


def _check_relays(sc: Scenario) -> None:
    """An outbound-only node (``no_listen``) reserves at its bootstrap peer: that one must be reachable."""

    def no_listen(i: int) -> bool:
        on = bool(sc.node.get("no_listen", False))
        for ov in sc.overrides:
            if i in ov["nodes"] and "no_listen" in ov:
                on = bool(ov["no_listen"])
        return on

    for i in range(sc.nodes):
        b = bootstrap_index(sc, i)
        if no_listen(i) and b is not None and no_listen(b):
            raise ConfigError(
                f"scenario: n{i} is no_listen and so is its bootstrap peer n{b}, which cannot "
                f'relay for it: make n{b} reachable, or use bootstrap = "star" with a reachable n0'
            )


def parse_scenario(
    data: dict[str, Any],
    *,
    strategies: list[str] | None = None,
    seed: int | None = None,
    rounds: int | None = None,
    nodes: int | None = None,
) -> Scenario:
    """Validate a scenario dict, with command-line overrides. Every node config it generates is
    validated too, so a bad learner/node field fails here, before any process starts."""
    data = dict(data)
    for k, v in (("strategy", strategies), ("seed", seed), ("rounds", rounds), ("nodes", nodes)):
        if v is not None:
            data[k] = v
    if strategies is not None:  # a command-line subset: the file's params for the others stay unused
        chosen = strategies.split(",") if isinstance(strategies, str) else list(strategies)
        data["strategy_params"] = {k: v for k, v in (data.get("strategy_params") or {}).items() if k in chosen}
    try:
        sc = Scenario.model_validate(data)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or '<root>'}: {err['msg']}" for err in e.errors())
        raise ConfigError(f"invalid scenario: {problems}") from None
    _check_scenario(sc)
    _check_relays(sc)
    for strat in sc.strategy:
        for i in range(sc.nodes):
            try:
                node_config(
                    sc,
                    strat,
                    i,
                    Path("/nonexistent"),
                    bootstrap=None if bootstrap_index(sc, i) is None else "127.0.0.1:1",
                )
            except ConfigError as e:
                raise ConfigError(f"scenario, node n{i} ({strat}): {e}") from None
    return sc


def load_scenario(path: str | Path, **overrides: Any) -> Scenario:
    return parse_scenario(_data_paths_from(read_toml(path, "scenario"), Path(path).resolve().parent), **overrides)


def _data_paths_from(data: dict[str, Any], base: Path) -> dict[str, Any]:
    """Relative ``learner.data`` paths (shared and per-override) taken from the scenario's folder."""

    def fix(learner: Any) -> Any:
        if (
            isinstance(learner, dict)
            and isinstance(learner.get("data"), str)
            and not Path(learner["data"]).expanduser().is_absolute()
        ):
            return {**learner, "data": str(base / learner["data"])}
        return learner

    data = dict(data)
    data["learner"] = fix(data.get("learner"))
    if isinstance(data.get("overrides"), list):
        data["overrides"] = [
            {**ov, "learner": fix(ov["learner"])} if isinstance(ov, dict) and "learner" in ov else ov
            for ov in data["overrides"]
        ]
    return {k: v for k, v in data.items() if v is not None}


def _own_data_path(data: dict[str, Any], i: int) -> dict[str, Any]:
    """``{node}`` / ``{index}`` in ``learner.data`` made node i's."""
    path = (data.get("learner") or {}).get("data")
    if isinstance(path, str) and ("{node}" in path or "{index}" in path):
        data["learner"] = {**data["learner"], "data": path.replace("{node}", f"n{i}").replace("{index}", str(i))}
    return data


def builtin_scenario(name: str = "demo") -> Path:
    """Path of a scenario shipped inside the package (``coterie.lab/scenarios/<name>.toml``)."""
    p = Path(__file__).with_name("scenarios") / f"{name}.toml"
    if not p.exists():
        raise ConfigError(f"no built-in scenario {name!r}")
    return p


# ------------------------------------------------------------------------------- node configs
def bootstrap_index(sc: Scenario, i: int) -> int | None:
    if i == 0:
        return None
    return i - 1 if sc.bootstrap == "chain" else 0


def node_config(sc: Scenario, strategy: str, i: int, strat_dir: Path, bootstrap: str | None = None) -> NodeConfig:
    """The complete config of node ``i`` for ``strategy``, bootstrapping from the peer address
    ``bootstrap``. Ports are 0: the node binds free ones and reports them in its node.json."""
    # experiments run flat out unless the scenario paces them (NodeConfig's default is for hand-started nodes)
    data: dict[str, Any] = {"min_peers": sc.nodes - 1, "start_timeout_s": 120.0, "round_interval_s": 0.0}
    data = deep_merge(data, sc.node)
    data = deep_merge(
        data,
        {
            "node_id": f"n{i}",
            "state_dir": str(strat_dir / "nodes" / f"n{i}"),
            "listen": "127.0.0.1:0",
            "admin_listen": "127.0.0.1:0",
            "peers": [bootstrap] if bootstrap else [],
            "strategy": strategy,
            "strategy_params": dict(sc.strategy_params.get(strategy, {})),
            "rounds": sc.rounds,
            "seed": data.get("seed", sc.seed) + i,
            "learner": deep_merge(
                sc.learner, {"num_nodes": sc.nodes, "node_index": i, "data_seed": sc.seed, "init_seed": sc.seed}
            ),
        },
    )
    for ov in sc.overrides:
        if i in ov["nodes"]:
            data = deep_merge(data, {k: v for k, v in ov.items() if k != "nodes"})
    return validate_config(_own_data_path(data, i))


def _drop_none(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _drop_none(v) for k, v in obj.items() if v is not None}
    if isinstance(obj, list):
        return [_drop_none(v) for v in obj]
    return obj


def config_toml(cfg: NodeConfig) -> str:
    import tomli_w

    return tomli_w.dumps(_drop_none(cfg.model_dump(mode="json")))


@dataclass
class NodeSpec:
    index: int
    config: NodeConfig
    config_path: Path
    log_path: Path
    bootstrap_from: Path | None = None  # node.json of the node this one bootstraps from
    info: dict[str, Any] = field(default_factory=dict)  # the running node's node.json

    @property
    def node_id(self) -> str:
        return self.config.node_id or f"n{self.index}"

    @property
    def admin_url(self) -> str:
        return self.info.get("admin_url", "")

    @property
    def state_dir(self) -> Path:
        return Path(self.config.state_dir)


@dataclass
class StrategyRun:
    strategy: str
    specs: list[NodeSpec]
    wall_time_s: float
    histories: dict[str, list[dict[str, Any]]]
    node_info: dict[str, dict[str, Any]]
    final_status: dict[str, dict[str, Any] | None]
    notes: list[str] = field(default_factory=list)
    placement: dict[str, Any] | None = None  # where the nodes ran, if the backend says (ray: groups, routes)
