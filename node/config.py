"""Node configuration: TOML file < COTERIE_* environment < command-line flags, validated by pydantic.

The environment layer is pydantic-settings' (prefix ``COTERIE_``, ``__`` descends into nested
fields); the three layers are deep-merged here so the precedence stays flags > env > file.

A bad value fails fast with the offending field named (``ConfigError``)."""

from __future__ import annotations

import difflib
import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import tomllib
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, EnvSettingsSource, SettingsConfigDict
from pydantic_settings.exceptions import SettingsError

from .learning.config import LearnerConfig
from .peering.versions import PROTOCOL_MIN
from .privacy.purposes import PURPOSES
from .security.ids import node_id_problem

PROTOCOL_VERSION = PROTOCOL_MIN  # what a handshake's protocol_version says: the oldest this node speaks
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "WARN", "ERROR", "CRITICAL")


class ConfigError(ValueError):
    """A configuration problem, with the field(s) at fault in the message."""


class PrivacyConfig(BaseModel):
    """What this node lets out about its private data (docs/privacy.md). Everything computed on
    it and sent to a peer (served cross-losses/-gradients, COBO's alignment vector, FedeRiCo's
    pushed gradients) is a sampled Gaussian mechanism: Poisson batch of expected size >= min_batch,
    per-sample clipping, Gaussian noise of noise_multiplier x the clip bound; the ledger
    (privacy-ledger.json in the state dir) composes them with opacus' RDP accountant."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True  # False: exact answers (still purpose-bound, min_batch, never test)
    # σ; 0 = clipping only, no guarantee (ε = ∞). σ = 2 over >= 64 samples puts the same noise on
    # an average as σ = 1 over 32, for ~30% less ε (bench/results/privacy.md)
    noise_multiplier: float = Field(2.0, ge=0)
    grad_clip: float = Field(1.0, gt=0)  # per-sample gradient L2 bound C
    loss_clip: float = Field(5.0, gt=0)  # per-sample loss bound (losses clipped into [0, bound])
    delta: float = Field(1e-5, gt=0, lt=1)  # ε is reported at this δ (keep it << 1/samples)
    budget_epsilon: float = Field(8.0, gt=0)  # total ε; a release that would pass it is refused (inf = no limit)
    peer_budget_epsilon: float = Field(math.inf, gt=0)  # ε released to any one peer (inf = no limit)
    # one peer may take at most a 1/expected_peers share of budget_epsilon, measured where ε adds
    # up (RDP): expected_peers peers releasing what it did would compose to at most the budget. So
    # one peer (a compromised one, say) cannot spend the whole budget and lock every other out.
    expected_peers: int = Field(10, ge=1)
    # releases to one peer: a token bucket of peer_release_burst, refilled at peer_release_rate
    # per second (inf = no limit); one peer cannot spend even its own share in a burst
    peer_release_rate: float = Field(4.0, gt=0)
    peer_release_burst: int = Field(16, ge=1)
    min_batch: int = Field(64, ge=1)  # expected samples behind any answer (whole split if smaller)
    serve_purposes: list[str] | None = None  # None = the purposes of this node's strategy

    @field_validator("serve_purposes")
    @classmethod
    def _known_purposes(cls, v: list[str] | None) -> list[str] | None:
        unknown = sorted(set(v or ()) - set(PURPOSES))
        if unknown:
            raise ValueError(f"unknown purpose(s) {unknown}; known: {sorted(PURPOSES)}")
        return v

    @model_validator(mode="after")
    def _budget_needs_noise(self) -> PrivacyConfig:
        finite = math.isfinite(self.budget_epsilon) or math.isfinite(self.peer_budget_epsilon)
        if self.enabled and self.noise_multiplier == 0 and finite:
            raise ValueError(
                "noise_multiplier = 0 (clipping only) gives no ε guarantee, so no budget "
                "can be kept: set budget_epsilon = inf, or a positive noise_multiplier"
            )
        return self


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
    # revocation list from `coterie cert revoke` (signed by the CA); None: crl.pem in cert_dir if there
    crl: Path | None = None
    reflection: bool = False  # gRPC server reflection on the peer port (grpcurl list); off: less to attack
    # the admin API's bearer token; None: <state_dir>/admin.token, generated (0600) on first start
    admin_token_file: Path | None = None
    # false: the admin API without a token, allowed only on a loopback admin_listen (docs/admin-and-export.md)
    admin_auth: bool = True

    @model_validator(mode="after")
    def _configured(self) -> SecurityConfig:
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
    # snapshot subscriptions served at once, and pull sessions (each: one per peer; 0: none)
    max_watches: int = Field(64, ge=0)


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


class DiscoveryConfig(BaseModel):
    """Collaborator discovery (peering/discovery.py): past ``above`` alive peers a strategy's
    candidates (``peers()``) are the peers it weights most plus a bounded number of new ones a
    round — recommended by its best collaborators, or drawn from its view — instead of everyone."""

    model_config = ConfigDict(extra="forbid")

    above: int = Field(200, ge=0)  # alive peers past which discovery supplies the candidates (0: always)
    candidates: int = Field(8, ge=1)  # peers offered per round
    explore: int = Field(3, ge=0)  # of which never-weighted ones, at least
    recommend: int = Field(5, ge=0)  # ids one "whom do you weight?" answer carries
    per_recommender: int = Field(2, ge=1)  # hints from one peer waiting at once
    # how peers are ranked: "running" (a running score, memory 0.5) or "evidence" (evaluations in
    # which the strategy's weight stood out of the noise against those it did not; keeps a mate
    # the strategy weights in a minority of its evaluations: docs/membership.md)
    ranking: Literal["running", "evidence"] = "running"


class SnapshotsConfig(BaseModel):
    """How snapshots travel (docs/codecs.md): the codecs this node asks for and serves, preferred
    first (each peer pair uses the first of the requester's list the server also speaks; fp32 is
    always understood), and whether a peer's next snapshot may come as a delta against the
    version this node holds of it."""

    model_config = ConfigDict(extra="forbid")

    # q8 + delta by default: 3.8x fewer snapshot bytes than fp32 at the same accuracy on S1–S3
    # (bench/results/codecs.md); fp32 stays in the list, so a peer speaking nothing else still gets it
    codecs: list[str] = Field(default_factory=lambda: ["q8", "fp32"], min_length=1)
    delta: bool = True
    delta_history: int = Field(3, ge=1, le=64)  # most reconstructions kept for deltas (one a reader)
    # MiB of peers' decoded snapshots kept as the bases of their next deltas (a peer without one gets
    # whole snapshots): every peer's of a small model, none of one over 16 MiB (docs/codecs.md)
    bases_mb: float = Field(16, ge=0)

    @field_validator("codecs")
    @classmethod
    def _codecs(cls, v: list[str]) -> list[str]:
        from .wire.codecs import CODECS

        unknown = [c for c in v if c not in CODECS]
        if unknown:
            raise ValueError(f"unknown codec(s) {unknown}; known: {list(CODECS)}")
        if len(set(v)) != len(v):
            raise ValueError(f"codec listed twice in {v}")
        return v


class RelayConfig(BaseModel):
    """Relaying for nodes that cannot be dialled (docs/nat.md)."""

    model_config = ConfigDict(extra="forbid")

    serve: bool = True  # a node with a peer port relays for outbound-only peers, within the budget below
    # relays an outbound-only node (no_listen) reserves at; default: its bootstrap peers (`peers`)
    via: list[str] = Field(default_factory=list)
    max_relays: int = Field(3, ge=1, le=8)  # reservations an outbound-only node holds at once
    max_reservations: int = Field(128, ge=0)  # outbound-only peers one relay serves at once
    max_tunnels_per_peer: int = Field(16, ge=1)  # tunnels open at once per dialer and per relayed node
    max_bytes_per_s: float = Field(64e6, gt=0)  # relayed bytes per second per peer, both directions
    accept_timeout_s: float = Field(5.0, gt=0)  # a relayed node must accept a tunnel within this
    # a node with a peer port asks again this often whether peers can dial it (relays or direct)
    recheck_s: float = Field(300.0, gt=0)

    @field_validator("via")
    @classmethod
    def _via(cls, v: list[str]) -> list[str]:
        for a in v:
            host, sep, port = a.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"relay.via: expected host:port, got {a!r}")
        return v


class HistoryConfig(BaseModel):
    """How much round history the state dir keeps (docs/state-directory.md): history.jsonl holds
    the recent rounds in full and never grows past ``max_bytes``; older rounds are folded into a
    bounded summary (at most 16 blocks) kept in the checkpoint."""

    model_config = ConfigDict(extra="forbid")

    # 16 MiB: ~20,000 rounds in full at 0.6-0.8 KB a round (after a rotation: the newest half);
    # a start reads at most this much
    max_bytes: int = Field(16 << 20, ge=64 << 10)


class ReferenceConfig(BaseModel):
    """The local-only reference (node/local_reference.py): a twin of the model trained on this
    node's own batches alone, compared on the validation split with what the node predicts by
    collaborating; when collaboration is worse beyond that split's noise for ``patience`` checks
    in a row, the node predicts, reports and exports the local model until collaboration is
    better again (docs/never-worse.md)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    # a model up to this many parameters gets a twin trained every round (the built-in MLPs and
    # 1-D CNNs, not the CIFAR CNN); a larger one trains its twin one round in ``large_every``
    shadow_max_params: int = Field(1_000_000, ge=0)
    large_every: int = Field(5, ge=1)
    check_every: int = Field(1, ge=1)  # rounds between two comparisons on the validation split
    # the twin stops training once its validation score has not improved for this many checks
    # (it has learnt what this node can learn alone; 0 = train it every round for ever)
    settle_after: int = Field(5, ge=0)
    patience: int = Field(3, ge=1)  # consecutive checks before backing off, and before returning
    # worse beyond noise (node/collaboration_check.py). rule "paired": the mean per-sample loss
    # difference (collab − local, same validation samples) above z of its standard errors;
    # paired_on: for classification, test the loss, the 0/1 errors or either; pool: checks whose
    # mean differences are averaged (training noise, not sampling noise). rule "unpaired": accuracy
    # below the local one by z standard errors of a difference of two accuracies; a loss
    # (regression) above it by mse_margin × it. rule "auto": paired on the 0/1 errors for
    # classification, unpaired for regression (paired_on is then ignored)
    rule: Literal["paired", "unpaired", "auto"] = "unpaired"
    paired_on: Literal["loss", "accuracy", "either"] = "loss"
    pool: int = Field(1, ge=1)
    z: float = Field(1.0, ge=0)
    mse_margin: float = Field(0.1, ge=0)
    # what the node predicts with, reports and exports while the check above collaborates
    # (node/blend.py): "blend" its collaborative model and the twin — in blend_space "prediction"
    # α·p_collab + (1−α)·p_twin, in "weight" α·θ_collab + (1−α)·θ_twin — α the one of 0,
    # 1/blend_steps, ..., 1 with the lowest validation loss at each check (classification: of
    # those with the highest validation accuracy); "choose": the
    # collaborative model. Backed off, the twin either way. On the audit set over 3 seeds "blend"
    # let 8 real losses through where "choose" let 34 (bench/results/never_worse.md)
    predict: Literal["blend", "choose"] = "blend"
    blend_space: Literal["prediction", "weight"] = "prediction"
    blend_steps: int = Field(10, ge=1)


class NodeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    node_id: str | None = None  # default: kept in the state dir, generated on first start
    state_dir: Path = Path("./coterie-state")
    listen: str = "127.0.0.1:0"  # peer (gRPC) address; port 0 = pick a free one
    advertise: str | None = None  # address peers should dial; default = listen with the bound port
    admin_listen: str = "127.0.0.1:0"  # aiohttp admin API
    peers: list[str] = Field(default_factory=list)  # bootstrap addresses host:port (or relay://R,R/ID)
    # outbound-only: no peer port at all; reached through relays (relay.via, else `peers`): docs/nat.md
    no_listen: bool = False
    relay: RelayConfig = Field(default_factory=RelayConfig)
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
    # a round in one phase longer than this and 10x the longest recent round is reported as stalled
    # (logged with stacks, health flips, systemd's watchdog restarts the node); 0 = never
    round_stall_s: float = Field(600.0, ge=0)
    heartbeat_interval_s: float = Field(1.0, gt=0)  # SWIM protocol period: one member probed per period
    suspect_after_s: float = Field(3.0, gt=0)  # a probe unanswered this long (direct + indirect): suspect
    dead_after_s: float = Field(8.0, gt=0)  # suspicion timeout floor: a suspect not refuting is dead
    membership: MembershipConfig = Field(default_factory=MembershipConfig)
    discovery: DiscoveryConfig = Field(default_factory=DiscoveryConfig)
    request_timeout_s: float = Field(30.0, gt=0)  # cap of every peer call's deadline
    deadline_mult: float = Field(4.0, gt=0)  # per-peer deadline: mult × p99 of its recent latencies,
    deadline_floor_s: float = Field(1.0, gt=0)  # at least this, at most request_timeout_s
    exchange_timeout_s: float = Field(0.0, ge=0)  # a round's exchange phase; 0 = adaptive (see network.py)
    # peers pulled from round after round push their snapshots on a subscription instead (network.py)
    watch_snapshots: bool = True
    # other peers pulled from again get a pull session: one stream, a request and answer per pull
    pull_sessions: bool = True
    snapshots: SnapshotsConfig = Field(default_factory=SnapshotsConfig)
    snapshot_cache_bytes: int = Field(512 << 20, gt=0)  # peers' snapshots held, least recently used evicted
    # largest snapshot/model accepted from a peer; default 4× this node's own model + 1 MiB
    max_model_bytes: int | None = Field(None, gt=0)
    max_gossip_bytes: int = Field(1 << 20, gt=0)
    chunk_bytes: int = Field(1 << 20, ge=1024, le=4 << 20)  # stays under gRPC's 4 MiB default
    delay_ms: float = Field(0.0, ge=0)  # artificial one-way latency added to outgoing calls (testbed)
    faulty: Literal["none", "random", "scale"] = "none"  # bad-actor mode: publish garbage models
    privacy: PrivacyConfig = Field(default_factory=PrivacyConfig)
    reference: ReferenceConfig = Field(default_factory=ReferenceConfig)
    log_level: str = "INFO"
    security: SecurityConfig = Field(default_factory=SecurityConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)

    @field_validator("log_level")
    @classmethod
    def _log_level(cls, v: str) -> str:
        if v.upper() not in LOG_LEVELS:  # unchecked, a typo silently meant INFO
            raise ValueError(f"unknown log level {v!r}; one of {', '.join(LOG_LEVELS)}")
        return v

    @field_validator("node_id")
    @classmethod
    def _node_id(cls, v: str | None) -> str | None:
        problem = None if v is None else node_id_problem(v)
        if problem:
            raise ValueError(problem)
        return v

    # state dir: completed rounds whose checkpoint may still be being written while the next
    # round trains (what a kill -9 can lose); 0 = every round waits for its own checkpoint
    checkpoint_max_unsaved_rounds: int = Field(1, ge=0)
    history: HistoryConfig = Field(default_factory=HistoryConfig)
    reset: bool = False  # start at round 0, moving any old state aside (into reset-<time>/)
    # accept a privacy ledger that is missing or behind the checkpoint: restore it from the
    # checkpoint's copy (logged); without it such a node refuses to start
    reset_privacy_ledger: bool = False

    @model_validator(mode="after")
    def _admin_auth_on_loopback_only(self) -> NodeConfig:
        from .admin_token import is_loopback

        host = self.admin_listen.rpartition(":")[0]
        if not self.security.admin_auth and not is_loopback(host):
            raise ValueError(
                f"security.admin_auth = false with admin_listen {self.admin_listen}: an "
                "admin API without a token may only listen on loopback (127.0.0.1, ::1)"
            )
        return self

    @model_validator(mode="after")
    def _no_listen_has_relays(self) -> NodeConfig:
        if self.no_listen and self.security.insecure:
            raise ValueError(
                "no_listen needs mTLS certificates: relays and peers know an outbound-only node "
                "only by its certificate (security.insecure is set)"
            )
        if self.no_listen and not self.relays():
            raise ValueError(
                "no_listen: no relay to be reached through; set relay.via (--relay) or a "
                "reachable bootstrap peer (host:port) in peers"
            )
        return self

    def relays(self) -> list[str]:
        """The relays an outbound-only node reserves at."""
        from .transport.relay_address import is_relayed

        return (self.relay.via or [p for p in self.peers if not is_relayed(p)])[: self.relay.max_relays]

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
        from .transport.relay_address import is_relayed, parse

        for p in v:
            parse(p) if is_relayed(p) else cls._hostport(p)  # an outbound-only node: relay://R/ID
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
    "COTERIE_ADMIN_TOKEN": "admin API token of `coterie status|peers|weights|history|model`",
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

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_nested_delimiter="__", case_sensitive=False, extra="forbid"
    )


class _EnvSource(EnvSettingsSource):
    """Reads a given mapping (tests, the launcher) instead of os.environ, and keeps the
    comma-separated form of list fields (``COTERIE_PEERS=a:1,b:2``) next to JSON.

    No private API: the source is built through its public constructor and reads the variables
    from ``env_vars``, the public attribute its public methods (``get_field_value``,
    ``explode_env_vars``) consult; the lower-cased keys are what a case-insensitive source
    expects. tests/test_config.py pins this (a given mapping wins over os.environ, nesting,
    JSON, the comma form); pyproject bounds pydantic-settings to the major version tested."""

    def __init__(self, environ: Mapping[str, str]):
        super().__init__(_NodeEnv, case_sensitive=False, env_prefix=ENV_PREFIX, env_nested_delimiter="__")
        self.env_vars = {k.lower(): v for k, v in environ.items() if k.upper().startswith(ENV_PREFIX)}

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
    known = [f.upper() for f in NodeConfig.model_fields] + [k[len(ENV_PREFIX) :] for k in OTHER_ENV]
    out = []
    for key in sorted(environ):
        if not key.upper().startswith(ENV_PREFIX) or key.upper() in OTHER_ENV:
            continue
        head = key[len(ENV_PREFIX) :].split("__")[0].lower()
        if head in NodeConfig.model_fields:
            continue
        near = difflib.get_close_matches(key[len(ENV_PREFIX) :].upper(), known, n=1, cutoff=0.75)
        out.append(
            f"{key} is not a coterie setting and is ignored"
            + (f" (did you mean {ENV_PREFIX}{near[0]}?)" if near else "")
        )
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


def load_config(
    path: str | Path | None = None, overrides: dict[str, Any] | None = None, environ: Mapping[str, str] | None = None
) -> NodeConfig:
    data: dict[str, Any] = read_toml(path) if path is not None else {}
    data = deep_merge(data, env_overrides(environ))
    data = deep_merge(data, overrides or {})
    return validate_config(data)


def validate_config(data: dict[str, Any]) -> NodeConfig:
    try:
        return NodeConfig.model_validate(data)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or '<root>'}: {err['msg']}" for err in e.errors())
        raise ConfigError(f"invalid node config: {problems}") from None
