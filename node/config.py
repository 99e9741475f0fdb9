"""Node configuration: TOML file < COTERIE_* environment < command-line flags, validated by pydantic.

A bad value fails fast with the offending field named (``ConfigError``)."""
from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .learning.config import LearnerConfig
from .security.ids import node_id_problem

PROTOCOL_VERSION = 1


class ConfigError(ValueError):
    """A configuration problem, with the field(s) at fault in the message."""


class SecurityConfig(BaseModel):
    """Who may talk to this node's peer port. mTLS by default: without certificates a node does
    not start, unless ``insecure`` says plaintext on purpose (logged as a warning)."""
    model_config = ConfigDict(extra="forbid")

    insecure: bool = False  # plaintext peer port, identities unchecked: only where the network is trusted
    cert_dir: Path | None = None  # from `coterie cert issue --out DIR`: ca.pem, node.pem, node.key
    ca: Path | None = None  # explicit files win over cert_dir's
    cert: Path | None = None
    key: Path | None = None
    allow_ids: list[str] | None = None  # only these node ids may connect or be dialled (None: any the CA issued)

    @model_validator(mode="after")
    def _configured(self) -> "SecurityConfig":
        if self.insecure and (self.cert_dir or self.cert or self.key):
            raise ValueError("insecure = true together with certificates: choose one")
        return self


class LimitsConfig(BaseModel):
    """Work one authenticated peer may cause on this node (``peering/admission.py``), and how long
    a stream may take. Refusals are RESOURCE_EXHAUSTED with the limit named."""
    model_config = ConfigDict(extra="forbid")

    requests_per_s: float = Field(40.0, gt=0)  # compute/snapshot/gossip requests, token-bucket rate
    request_burst: float = Field(80.0, ge=1)
    compute_share: float = Field(0.25, gt=0)  # seconds of compute on my data per second, per peer
    compute_burst_s: float = Field(2.0, gt=0)
    max_concurrent: int = Field(3, ge=1)  # requests of one peer in flight at once
    compute_workers: int = Field(2, ge=1)  # threads serving peers' compute (the node's own work has others)
    upload_timeout_s: float = Field(60.0, gt=0)  # a streamed upload must be complete by then
    upload_idle_s: float = Field(10.0, gt=0)  # longest gap between two frames of an upload
    send_timeout_s: float = Field(120.0, gt=0)  # a reply stream to a slow reader is cut after this
    # ... and both deadlines stretch by the payload's size at this rate (a big model on a slow link)
    min_stream_bytes_per_s: float = Field(64 * 1024, gt=0)
    max_push_lag: int = Field(64, ge=1)  # a pushed gradient's target version at most this far behind
    push_norm_factor: float = Field(10.0, gt=1)  # pushes clipped to this × my own recent gradient norm
    max_rpcs: int = Field(512, ge=8)  # all calls in flight on the peer port (gRPC answers RESOURCE_EXHAUSTED)


class NodeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    node_id: str | None = None  # default: kept in the state dir, generated on first start
    state_dir: Path = Path("./coterie-state")
    listen: str = "127.0.0.1:0"  # peer (gRPC) address; port 0 = pick a free one
    advertise: str | None = None  # address peers should dial; default = listen with the bound port
    admin_listen: str = "127.0.0.1:0"  # aiohttp admin API
    peers: list[str] = Field(default_factory=list)  # bootstrap addresses host:port
    labels: dict[str, str] = Field(default_factory=dict)  # free-form, announced in the handshake

    strategy: str = "local"
    strategy_params: dict[str, Any] = Field(default_factory=dict)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    seed: int = 0

    rounds: int | None = Field(None, ge=0)  # stop the round loop after this many (None = forever)
    round_interval_s: float = Field(0.0, ge=0)  # minimum time between round starts
    min_peers: int = Field(0, ge=0)  # wait (bounded by start_timeout_s) for this many before round 1
    start_timeout_s: float = Field(30.0, ge=0)
    heartbeat_interval_s: float = Field(1.0, gt=0)
    suspect_after_s: float = Field(3.0, gt=0)
    dead_after_s: float = Field(8.0, gt=0)
    request_timeout_s: float = Field(30.0, gt=0)
    # largest snapshot/model accepted from a peer; default 4× this node's own model + 1 MiB
    max_model_bytes: int | None = Field(None, gt=0)
    max_gossip_bytes: int = Field(1 << 20, gt=0)
    chunk_bytes: int = Field(1 << 20, ge=1024, le=4 << 20)  # stays under gRPC's 4 MiB default
    delay_ms: float = Field(0.0, ge=0)  # artificial one-way latency added to outgoing calls (testbed)
    faulty: Literal["none", "random", "scale"] = "none"  # bad-actor mode: publish garbage models
    log_level: str = "INFO"
    security: SecurityConfig = Field(default_factory=SecurityConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)

    @field_validator("node_id")
    @classmethod
    def _node_id(cls, v: str | None) -> str | None:
        problem = None if v is None else node_id_problem(v)
        if problem:
            raise ValueError(problem)
        return v

    @field_validator("listen", "admin_listen")
    @classmethod
    def _hostport(cls, v: str) -> str:
        host, sep, port = v.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
            raise ValueError(f"expected host:port, got {v!r}")
        return v

    @field_validator("peers")
    @classmethod
    def _peers(cls, v: list[str]) -> list[str]:
        for p in v:
            cls._hostport(p)
        return v


def _set_path(d: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    for k in keys[:-1]:
        d = d.setdefault(k, {})
    d[keys[-1]] = value


def _env_value(raw: str) -> Any:
    """Env values are JSON when they parse as JSON (numbers, lists, objects), else strings."""
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw.split(",") if "," in raw and not raw.startswith("{") else raw


def env_overrides(environ: dict[str, str] | None = None) -> dict[str, Any]:
    """COTERIE_STRATEGY=fedfomo, COTERIE_LEARNER__LR=0.1 (``__`` descends), COTERIE_PEERS=a:1,b:2."""
    out: dict[str, Any] = {}
    for k, v in (os.environ if environ is None else environ).items():
        path = k[len("COTERIE_"):].lower().replace("__", ".")
        # only config fields: other COTERIE_* variables (COTERIE_CACHE_DIR, ...) belong to others
        if k.startswith("COTERIE_") and path.split(".")[0] in NodeConfig.model_fields:
            value = _env_value(v)
            if path == "peers" and isinstance(value, str):
                value = [value] if value else []
            _set_path(out, path, value)
    return out


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def read_toml(path: str | Path, what: str = "config") -> dict[str, Any]:
    p = Path(path)
    try:
        return tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{what} file {p} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{what} file {p} is not valid TOML: {e}") from None


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None,
                environ: dict[str, str] | None = None) -> NodeConfig:
    data: dict[str, Any] = read_toml(path) if path is not None else {}
    data = deep_merge(data, env_overrides(environ))
    data = deep_merge(data, overrides or {})
    return validate_config(data)


def validate_config(data: dict[str, Any]) -> NodeConfig:
    try:
        return NodeConfig.model_validate(data)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or '<root>'}: {err['msg']}"
                             for err in e.errors())
        raise ConfigError(f"invalid node config: {problems}") from None
