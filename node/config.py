"""Node configuration: TOML file < COTERIE_* environment < command-line flags, validated by pydantic.

The environment layer is pydantic-settings' (prefix ``COTERIE_``, ``__`` descends into nested
fields); the three layers are deep-merged here so the precedence stays flags > env > file.

A bad value fails fast with the offending field named (``ConfigError``)."""
from __future__ import annotations

import difflib
import json
import os
import tomllib
from pathlib import Path
from typing import Any, Literal, Mapping, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, EnvSettingsSource, SettingsConfigDict
from pydantic_settings.exceptions import SettingsError

from .learning.config import LearnerConfig

PROTOCOL_VERSION = 1


class ConfigError(ValueError):
    """A configuration problem, with the field(s) at fault in the message."""


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
    # minimum time between round starts. Not 0: a hand-started node on a small model otherwise runs
    # 5-10 rounds a second, each with a checkpoint and a history line; 1 s keeps disk writes and
    # peer traffic modest. The launcher (`coterie run`/`demo`) and tests set 0 to run flat out.
    round_interval_s: float = Field(1.0, ge=0)
    min_peers: int = Field(0, ge=0)  # wait (bounded by start_timeout_s) for this many before round 1
    start_timeout_s: float = Field(30.0, ge=0)
    heartbeat_interval_s: float = Field(1.0, gt=0)
    suspect_after_s: float = Field(3.0, gt=0)
    dead_after_s: float = Field(8.0, gt=0)
    request_timeout_s: float = Field(30.0, gt=0)
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


# COTERIE_* variables that are not node settings: read by the CLI, the dataset cache, CI and the testbed
OTHER_ENV = {
    "COTERIE_CONFIG": "config file of `coterie node start`",
    "COTERIE_ADMIN": "default admin URL of `coterie status|peers|weights|history`",
    "COTERIE_LOG_FORMAT": "node log format (text or json)",
    "COTERIE_CACHE_DIR": "where generated datasets are cached",
    "COTERIE_SKIP_TESTBED": "CI: skip the docker testbed",
    "COTERIE_IMAGE": "testbed: image name",
    "COTERIE_BASE": "testbed: base image",
}
ENV_PREFIX = "COTERIE_"


class _NodeEnv(NodeConfig, BaseSettings):
    """NodeConfig's fields as pydantic-settings sees them; only its EnvSettingsSource is used,
    so the file and flag layers (and their precedence) stay ours."""
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, env_nested_delimiter="__",
                                      case_sensitive=False, extra="forbid")


class _EnvSource(EnvSettingsSource):
    """Reads a given mapping (tests, the launcher) instead of os.environ, and keeps the
    comma-separated form of list fields (``COTERIE_PEERS=a:1,b:2``) next to JSON."""

    def __init__(self, environ: Mapping[str, str]):
        self._environ = environ
        super().__init__(_NodeEnv)

    def _load_env_vars(self) -> Mapping[str, str | None]:
        return {k.lower(): v for k, v in self._environ.items() if k.upper().startswith(ENV_PREFIX)}

    def decode_complex_value(self, field_name: str, field: FieldInfo, value: Any) -> Any:
        try:
            return super().decode_complex_value(field_name, field, value)
        except ValueError:
            if get_origin(field.annotation) is list and isinstance(value, str):
                return [v.strip() for v in value.split(",") if v.strip()]
            raise


def _json_leaves(v: Any) -> Any:
    """Exploded ``A__B__C=2`` values under a free-form dict arrive as text: read them as JSON when
    they parse (numbers, booleans, lists), as ``--set`` does."""
    if isinstance(v, dict):
        return {k: _json_leaves(x) for k, x in v.items()}
    if isinstance(v, str):
        try:
            return json.loads(v)
        except json.JSONDecodeError:
            return v
    return v


def _decode_free_form(model: type[BaseModel], data: dict[str, Any]) -> dict[str, Any]:
    out = dict(data)
    for name, value in data.items():
        field = model.model_fields.get(name)
        if field is None or not isinstance(value, dict):
            continue
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out[name] = _decode_free_form(ann, value)
        elif get_origin(ann) is dict and get_args(ann)[1:] == (Any,):
            out[name] = _json_leaves(value)
    return out


def env_overrides(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The node settings in the environment, as a nested dict (pydantic-settings' EnvSettingsSource):
    COTERIE_STRATEGY=fedfomo, COTERIE_LEARNER__LR=0.1 (``__`` descends, also into free-form dicts:
    COTERIE_LEARNER__PARTITION_PARAMS__NUM_CLUSTERS=2), COTERIE_PEERS=a:1,b:2 or a JSON list.
    Other COTERIE_* variables are not settings (see ``unknown_env``)."""
    environ = os.environ if environ is None else environ
    try:
        data = _EnvSource(environ)()
    except SettingsError as e:
        raise ConfigError(f"environment: {e}") from None
    return _decode_free_form(NodeConfig, data)


def unknown_env(environ: Mapping[str, str] | None = None) -> list[str]:
    """One warning per COTERIE_* variable that is neither a setting nor one of OTHER_ENV: a
    misspelled variable would otherwise be ignored without a word."""
    environ = os.environ if environ is None else environ
    known = [f.upper() for f in NodeConfig.model_fields] + [k[len(ENV_PREFIX):] for k in OTHER_ENV]
    out = []
    for key in sorted(environ):
        if not key.upper().startswith(ENV_PREFIX) or key.upper() in OTHER_ENV:
            continue
        head = key[len(ENV_PREFIX):].split("__")[0].lower()
        if head in NodeConfig.model_fields:
            continue
        near = difflib.get_close_matches(key[len(ENV_PREFIX):].upper(), known, n=1, cutoff=0.75)
        out.append(f"{key} is not a coterie setting and is ignored"
                   + (f" (did you mean {ENV_PREFIX}{near[0]}?)" if near else ""))
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
                environ: Mapping[str, str] | None = None) -> NodeConfig:
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
