"""SIGHUP: the config file read again, and what can change in a running node applied at once.

Live: the log level, the seed peers (``peers``), the per-peer request and compute budgets
(``limits``: what ``Admission`` meters) and the relay budget (``relay``: what this node grants the
outbound-only peers it relays for). Every other field is part of what the node was built from
(its model, data, strategy, ports, certificates, privacy ledger): a change to one is reported as
needing a restart, never half-applied. A config that does not load or validate is refused whole,
its problem named, and the node carries on under the config it runs. The outcome is logged and
shown in /status as ``reload``."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from .config import ConfigError, NodeConfig
from .peering.admission import Admission
from .peering.membership import Membership
from .stall_watch import StallWatch

log = logging.getLogger("coterie.node")

ADMISSION_FIELDS = ("requests_per_s", "request_burst", "compute_share", "compute_burst_s", "max_concurrent")
RELAY_BUDGET_FIELDS = ("max_reservations", "max_tunnels_per_peer", "max_bytes_per_s", "accept_timeout_s")
LIVE = {
    "log_level",
    "peers",
    "round_stall_s",
    *(f"limits.{f}" for f in ADMISSION_FIELDS),
    *(f"relay.{f}" for f in RELAY_BUDGET_FIELDS),
}


def flatten(cfg: NodeConfig) -> dict[str, Any]:
    """Every setting by its dotted name (lists are one value: ``peers`` is replaced whole)."""
    out: dict[str, Any] = {}

    def walk(prefix: str, v: Any) -> None:
        if isinstance(v, dict):
            for k, x in v.items():
                walk(f"{prefix}{k}.", x)
        else:
            out[prefix[:-1]] = v

    walk("", cfg.model_dump(mode="json"))
    return out


def changed(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    return sorted(k for k in old.keys() | new.keys() if old.get(k, None) != new.get(k, None))


class Running(Protocol):
    """What a reload changes in a running node (``daemon.Node``)."""

    cfg: NodeConfig
    membership: Membership
    admission: Admission
    transport: Any  # retune_relay(cfg), where the transport relays (grpc_transport.py)
    node_id: str
    address: str
    round: int
    reload_outcome: dict[str, Any] | None
    stall_watch: StallWatch  # (service.py: a stalled round stops the systemd watchdog's pings)


class Reloader:
    """Reloads ``node``'s config from ``load`` (the file, environment and flags it was started
    with). ``running``: the config the node was started from, before the node added its own
    labels to it."""

    def __init__(self, node: Running, load: Callable[[], NodeConfig] | None, running: NodeConfig):
        self.node, self.load = node, load
        self.in_effect = flatten(running)  # what the node runs now: started with, plus what reloads applied
        self.last: dict[str, Any] | None = None  # the last outcome, for /status

    async def reload(self) -> dict[str, Any]:
        outcome: dict[str, Any] = {"at": time.time(), "applied": [], "needs_restart": [], "error": None}
        self.last = outcome
        if self.load is None:
            outcome["error"] = "this node was not started from a config it can read again"
            log.error("reload refused: %s", outcome["error"])
            return outcome
        try:  # reading and validating is off the loop: a slow disk does not stall the heartbeats
            new = await asyncio.to_thread(self.load)
        except (ConfigError, OSError, ValueError) as e:  # OSError: a file it may no longer read
            outcome["error"] = str(e) if isinstance(e, ConfigError) else f"config file: {e}"
            log.error("reload refused, the node keeps running on its current config: %s", outcome["error"])
            return outcome
        now = flatten(new)
        fields = changed(self.in_effect, now)
        live = [f for f in fields if f in LIVE]
        outcome["needs_restart"] = [f for f in fields if f not in LIVE]
        if "peers" in live and self.node.cfg.no_listen and new.relays() != self.node.cfg.relays():
            outcome["needs_restart"].append("relays (an outbound-only node reserves at its peers)")
        for f, ok in self._apply(new, live).items():
            (outcome["applied"] if ok else outcome["needs_restart"]).append(f)
            if ok:
                self.in_effect[f] = now[f]
        log.log(
            logging.WARNING if outcome["needs_restart"] else logging.INFO,
            "config reloaded: applied %s; needs a restart to take effect: %s",
            ", ".join(outcome["applied"]) or "nothing",
            ", ".join(outcome["needs_restart"]) or "nothing",
        )
        return outcome

    def _apply(self, new: NodeConfig, live: list[str]) -> dict[str, bool]:
        """Each live field changed -> whether it now holds in the running node."""
        node, cfg, done = self.node, self.node.cfg, {}
        if "log_level" in live:
            root = logging.getLogger()
            root.setLevel(new.log_level.upper())
            logging.getLogger("httpx").setLevel(max(logging.WARNING, root.level))  # as configure_logging
            cfg.log_level = new.log_level
            done["log_level"] = True
        if "peers" in live:
            node.membership.handshakes.set_bootstrap(new.peers)
            cfg.peers = list(new.peers)
            done["peers"] = True
        if "round_stall_s" in live:
            node.stall_watch.retune(new.round_stall_s)
            cfg.round_stall_s = new.round_stall_s
            done["round_stall_s"] = True
        limits = [f for f in live if f.startswith("limits.")]
        if limits:
            cfg.limits = cfg.limits.model_copy(update={f: getattr(new.limits, f) for f in ADMISSION_FIELDS})
            node.admission.retune(cfg.limits)
            done.update(dict.fromkeys(limits, True))
        relay = [f for f in live if f.startswith("relay.")]
        if relay:
            budget = cfg.relay.model_copy(update={f: getattr(new.relay, f) for f in RELAY_BUDGET_FIELDS})
            retune = getattr(node.transport, "retune_relay", None)  # a transport that relays
            ok = retune is not None and retune(cfg.model_copy(update={"relay": budget}))
            if ok:
                cfg.relay = budget
            done.update(dict.fromkeys(relay, bool(ok)))
        return done
