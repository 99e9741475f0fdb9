"""Node configuration: TOML file < COTERIE_* environment < command-line flags, validated by pydantic.

A bad value fails fast with the offending field named (``ConfigError``)."""
from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .learning.config import LearnerConfig

PROTOCOL_VERSION = 1


class ConfigError(ValueError):
    """A configuration problem, with the field(s) at fault in the message."""


class MembershipConfig(BaseModel):
    """SWIM membership (Das et al. 2002; HashiCorp memberlist). The protocol period is the node's
    ``heartbeat_interval_s``: each period one member is probed. A member that answers neither the
    direct ping nor any of the ``indirect_probes`` helpers within ``suspect_after_s`` is suspect;
    a suspect that does not refute within the suspicion timeout is dead. The timeout is
    ``dead_after_s`` (at least ``suspicion_mult`` × log10(N+1) periods) once ``indirect_probes``
    further members confirm the suspicion, up to ``suspicion_max_mult`` times that with one."""
    model_config = ConfigDict(extra="forbid")

    indirect_probes: int = Field(3, ge=0)  # k members asked to ping a member that missed a ping
    probe_timeout_s: float = Field(0.5, gt=0)  # direct-ping deadline floor (grows with observed RTT)
    suspicion_mult: float = Field(4.0, ge=0)
    suspicion_max_mult: float = Field(6.0, ge=1)  # one accuser alone: the timeout × this (Lifeguard)
    retransmit_mult: float = Field(4.0, gt=0)  # each piggybacked update goes out mult × log10(N+1) times
    max_piggyback: int = Field(8, ge=1)  # membership updates per message
    push_pull_interval_s: float = Field(10.0, gt=0)  # full view swapped with one member this often
    handshakes_per_period: int = Field(4, ge=1)  # new addresses and dead members contacted per period
    max_candidates: int = Field(512, ge=1)  # addresses learned from peers waiting for a handshake
    max_candidates_per_source: int = Field(128, ge=1)  # ... of which one peer may have told us
    candidate_attempts: int = Field(3, ge=1)  # failed handshakes before an address is forgotten
    forget_failed_s: float = Field(600.0, ge=0)  # a forgotten address is not taken up again for this long
    reconnect_min_s: float = Field(1.0, gt=0)  # dead members: first reconnect attempt after this,
    reconnect_max_s: float = Field(60.0, gt=0)  # then doubling up to this
    idle_channel_s: float = Field(120.0, gt=0)  # client channels unused this long are closed


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
    heartbeat_interval_s: float = Field(1.0, gt=0)  # SWIM protocol period: one member probed per period
    suspect_after_s: float = Field(3.0, gt=0)  # a probe unanswered this long (direct + indirect): suspect
    dead_after_s: float = Field(8.0, gt=0)  # suspicion timeout floor: a suspect not refuting is dead
    membership: MembershipConfig = Field(default_factory=MembershipConfig)
    request_timeout_s: float = Field(30.0, gt=0)  # cap of every peer call's deadline
    deadline_mult: float = Field(4.0, gt=0)  # per-peer deadline: mult × p99 of its recent latencies,
    deadline_floor_s: float = Field(1.0, gt=0)  # at least this, at most request_timeout_s
    exchange_timeout_s: float = Field(0.0, ge=0)  # a round's exchange phase; 0 = adaptive (see network.py)
    snapshot_cache_bytes: int = Field(512 << 20, gt=0)  # peers' snapshots held, least recently used evicted
    max_model_bytes: int = Field(1 << 31, gt=0)  # largest snapshot/model accepted from a peer
    max_gossip_bytes: int = Field(1 << 20, gt=0)
    chunk_bytes: int = Field(1 << 20, ge=1024, le=4 << 20)  # stays under gRPC's 4 MiB default
    delay_ms: float = Field(0.0, ge=0)  # artificial one-way latency added to outgoing calls (testbed)
    faulty: Literal["none", "random", "scale"] = "none"  # bad-actor mode: publish garbage models
    log_level: str = "INFO"

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
