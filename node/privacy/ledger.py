"""The privacy ledger: every release about this node's data, per peer and in total, on disk.

Everything released about one node's data composes, whoever received it, so the **total** ε is
the guarantee and the budget; the per-peer figures show who spent it (and can be capped, so one
peer cannot use up the node's budget alone). ``charge`` is called *before* the computation and
persists the entry (atomic write, fsync) before it returns: a reply never leaves without its entry
on disk, so after ``kill -9`` the ledger can over-count a release that never left, never
under-count one that did.

File ``privacy-ledger.json`` in the state dir::

    {"format": "coterie-privacy-ledger/2", "sha256": "<over the rest, canonical JSON>",
     "total": {"releases": 12, "steps": [[σ, q, count], ...]},
     "peers": {"n3": {"releases": 4, "steps": [...], "purposes": {"scool-evidence": 4}}}}

δ and the budgets come from the config (a restart may change them; the steps are the record).

The ledger is part of the node's verified state: each checkpoint pins a copy of it (``pin()``,
in the checkpoint's checksummed state), and since a ledger only grows, the file must record at
least every release the pin does (``verify``). A corrupt ledger, a missing one next to a
checkpoint that pins releases, or one rewritten with fewer releases (even with a valid checksum)
stops the node with the file named: starting from less would forget releases. Only an explicit
reset (``--reset-privacy-ledger``, logged) goes on: it moves the bad file aside and restores the
ledger from the checkpoint's pin, the last record known good.

One peer cannot drain the node's budget: it may take at most a 1/``expected_peers`` share of it,
measured where privacy loss adds up (RDP composes linearly in steps: ``expected_peers`` peers
each released what this one was would together stay within the budget), optionally an explicit
ε cap too (``peer_budget``); and its releases are rate-limited (a token bucket per peer:
``peer_rate`` per second, bursts of ``peer_burst``)."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .. import fsutil
from . import accountant

FORMAT = "coterie-privacy-ledger/2"
# an account with folded RDP (``_Account.compact``) is written as /3: a release that does not know
# folds refuses the file (format) instead of reading the counts alone and under-counting
FORMAT_FOLDED = "coterie-privacy-ledger/3"
_OLD_FORMATS = ("coterie-privacy-ledger/1",)  # before the checksum: read once, rewritten as /2
FILE = "privacy-ledger.json"

log = logging.getLogger("coterie.privacy")


class BudgetSpent(Exception):
    """A release would take the total (or one peer's) ε past its budget."""


class ReleaseRateLimited(BudgetSpent):
    """A peer asked for releases faster than its per-peer rate (it may ask again later)."""


class LedgerError(ValueError):
    """A ledger that cannot be trusted (missing, corrupt, or behind its checkpoint); names the file."""


def _checksum(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class _Bucket:
    """A token bucket: ``burst`` releases at once, refilled at ``rate`` per second."""

    __slots__ = ("tokens", "at")

    def __init__(self, burst: float, now: float):
        self.tokens, self.at = burst, now


MAX_STEPS = 64  # distinct (σ, q) an account keeps counts of; the rest folded into its RDP


@dataclass
class _Account:
    """Releases as a count per (σ, q) — RDP of identical releases composes as a count — plus, once
    more than ``MAX_STEPS`` distinct (σ, q) were seen (a peer asking for ever other batch sizes),
    the least used folded into their summed RDP per order (``folded``: orders, values): RDP
    composes by addition, so ε over the fold is the ε over the releases it replaced."""

    steps: dict[tuple[float, float], int] = field(default_factory=dict)
    releases: int = 0
    purposes: dict[str, int] = field(default_factory=dict)
    epsilon: float = 0.0
    folded: tuple[tuple[float, ...], np.ndarray] | None = None
    folded_releases: int = 0

    def history(self) -> list[tuple[float, float, int]]:
        return [(s, q, n) for (s, q), n in self.steps.items()]

    def eps(self, delta: float, step: tuple[float, float] | None = None, scale: int = 1) -> float:
        """ε of this account (after one more release at ``step``), its releases ``scale`` times."""
        steps = dict(self.steps)
        if step is not None:
            steps[step] = steps.get(step, 0) + 1
        folded = None if self.folded is None else (self.folded[0], self.folded[1] * scale)
        return accountant.epsilon([(s, q, n * scale) for (s, q), n in steps.items()], delta, folded)

    def rdp(self, at: tuple[float, ...]) -> np.ndarray:
        """The account's RDP at the orders ``at`` (those of its fold, if any)."""
        return accountant.rdp_of(self.history(), at) + (0.0 if self.folded is None else self.folded[1])

    def covers(self, other: _Account) -> bool:
        """Whether this account records at least every release ``other`` does: count for count
        while neither is folded, else at least its releases and its RDP at every order."""
        if self.releases < other.releases:
            return False
        if self.folded is None and other.folded is None:
            return all(self.steps.get(k, 0) >= n for k, n in other.steps.items())
        at = (self.folded or other.folded)[0]  # type: ignore[index]
        if other.folded is not None and other.folded[0] != at:
            return False  # folded over other orders (another opacus): not comparable, not trusted
        mine, theirs = self.rdp(at), other.rdp(at)
        return bool(np.all(mine >= theirs - 1e-9 * np.abs(theirs)))

    def add(self, sigma: float, q: float, purpose: str, eps: float) -> None:
        self.steps[(sigma, q)] = self.steps.get((sigma, q), 0) + 1
        self.releases += 1
        self.purposes[purpose] = self.purposes.get(purpose, 0) + 1
        self.epsilon = eps
        if len(self.steps) > MAX_STEPS:
            self.compact(MAX_STEPS // 2)

    def compact(self, keep: int) -> None:
        """Fold all but the ``keep`` most used (σ, q) into the RDP fold (ε unchanged)."""
        ranked = sorted(self.steps.items(), key=lambda kv: (-kv[1], kv[0]))
        out = ranked[keep:]
        if not out:
            return
        at = self.folded[0] if self.folded is not None else accountant.orders()
        add = accountant.rdp_of([(s, q, n) for (s, q), n in out], at)
        self.folded = (at, add if self.folded is None else self.folded[1] + add)
        self.folded_releases += sum(n for _, n in out)
        self.steps = dict(ranked[:keep])

    def copy(self) -> _Account:
        return _Account(
            dict(self.steps), self.releases, dict(self.purposes), self.epsilon, self.folded, self.folded_releases
        )

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "releases": self.releases,
            "purposes": dict(self.purposes),
            "steps": [[s, q, n] for (s, q), n in sorted(self.steps.items())],
        }
        if self.folded is not None:
            out["folded"] = {
                "orders": list(self.folded[0]),
                "rdp": [float(x) for x in self.folded[1]],
                "releases": self.folded_releases,
            }
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> _Account:
        steps: dict[tuple[float, float], int] = {}
        for s, q, n in d["steps"]:
            s, q, n = float(s), float(q), int(n)
            if not (s >= 0 and 0 < q <= 1 and n >= 0):
                raise ValueError(f"bad step {[s, q, n]}")
            steps[(s, q)] = steps.get((s, q), 0) + n
        acc = cls(steps, int(d["releases"]), {str(k): int(v) for k, v in d.get("purposes", {}).items()})
        if d.get("folded") is not None:
            f = d["folded"]
            at, values = tuple(float(x) for x in f["orders"]), np.asarray([float(x) for x in f["rdp"]])
            if len(at) != len(values) or not len(at) or np.any(values < 0) or np.any(np.isnan(values)):
                raise ValueError("bad folded RDP")
            acc.folded, acc.folded_releases = (at, values), int(f["releases"])
        if acc.releases != sum(steps.values()) + acc.folded_releases:  # every release is a step
            raise ValueError(
                f"{acc.releases} releases, but its steps and fold count {sum(steps.values()) + acc.folded_releases}"
            )
        return acc


class PrivacyLedger:
    def __init__(
        self,
        state_dir: str | Path,
        *,
        delta: float,
        budget: float = math.inf,
        peer_budget: float = math.inf,
        expected_peers: int = 1,
        peer_rate: float = math.inf,
        peer_burst: int = 1,
        on_change: Callable[[str, str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.path = Path(state_dir) / FILE
        self.delta, self.budget, self.peer_budget = delta, budget, peer_budget
        self.expected_peers = max(1, int(expected_peers))
        self.peer_rate, self.peer_burst = peer_rate, max(1, int(peer_burst))
        self.on_change = on_change or (lambda peer, purpose: None)  # after each recorded release
        self._clock = clock
        self._lock = threading.Lock()
        self.total = _Account()
        self.peers: dict[str, _Account] = {}
        self._buckets: dict[str, _Bucket] = {}
        self.refusals = 0
        self.rate_refusals = 0
        self.refusing = False  # the last release asked for was refused (until one fits again)
        self.found = self.path.exists()  # False: no file (a fresh node, or one deleted)
        if self.found:
            self.total, self.peers = self._parse(fsutil.read_json(self.path), self.path)
        self._recompute()

    @staticmethod
    def _parse(data: Any, where: Path | str, checksummed: bool = True) -> tuple[_Account, dict[str, _Account]]:
        try:
            if not isinstance(data, dict):
                raise ValueError("not a JSON object")
            fmt = data.get("format")
            if fmt in (FORMAT, FORMAT_FOLDED) and checksummed:
                body = {k: v for k, v in data.items() if k != "sha256"}
                if data.get("sha256") != _checksum(body):
                    raise ValueError("checksum mismatch: the file changed after it was written")
            elif fmt not in (FORMAT, FORMAT_FOLDED) and fmt not in _OLD_FORMATS:
                raise ValueError(f"format {fmt!r}, expected {FORMAT!r}")
            total = _Account.from_json(data["total"])
            peers = {str(k): _Account.from_json(v) for k, v in data["peers"].items()}
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise LedgerError(
                f"{where} is corrupt ({e}); it records what this node has released "
                "about its data, so it is never reset silently"
            ) from None
        return total, peers

    def _recompute(self) -> None:
        for acc in [self.total, *self.peers.values()]:
            acc.epsilon = acc.eps(self.delta)

    def _body(self, total: _Account, peers: dict[str, _Account]) -> dict[str, Any]:
        folded = any(a.folded is not None for a in [total, *peers.values()])
        return {
            "format": FORMAT_FOLDED if folded else FORMAT,
            "total": total.to_json(),
            "peers": {k: v.to_json() for k, v in sorted(peers.items())},
        }

    def _save(self) -> None:
        body = self._body(self.total, self.peers)
        fsutil.atomic_write_json(self.path, {**body, "sha256": _checksum(body)})
        self.found = True

    # --- the ledger as verified state ---
    def pin(self) -> dict[str, Any]:
        """What a checkpoint keeps of the ledger: the ledger itself (small: accounts × distinct
        (σ, q)); the file must always cover it."""
        with self._lock:
            return self._body(self.total, self.peers)

    def verify(self, pinned: dict[str, Any] | None, *, checkpoint: str, reset: bool = False) -> None:
        """Check the ledger against the pin of the checkpoint it sits next to; raise LedgerError
        naming the file if it is missing or records fewer releases. With ``reset`` (the
        operator's explicit choice), move the file aside and restore the pin instead, logged."""
        if pinned is None:  # a checkpoint from before ledgers were pinned: nothing to check against
            if not self.found:
                log.warning(
                    "%s: no privacy ledger and no pin in %s (written before ledgers were "
                    "pinned); starting a new ledger",
                    self.path,
                    checkpoint,
                )
            return
        total, peers = self._parse(pinned, f"the ledger pinned in {checkpoint}", checksummed=False)
        problem = None
        if not self.found:
            if total.releases or any(a.releases for a in peers.values()):
                problem = (
                    f"{self.path} is missing, but {checkpoint} records {total.releases} releases "
                    f"of this node's data (ε = {total.eps(self.delta):.3g})"
                )
        elif not self.total.covers(total):
            problem = (
                f"{self.path} records {self.total.releases} releases (ε = {self.total.epsilon:.3g}), "
                f"fewer than the {total.releases} (ε = {total.eps(self.delta):.3g}) "
                f"{checkpoint} pins: it was rewritten or restored from an older copy"
            )
        else:
            short = sorted(p for p, acc in peers.items() if not self.peers.get(p, _Account()).covers(acc))
            if short:
                problem = (
                    f"{self.path} records fewer releases to {', '.join(short[:5])} than {checkpoint} "
                    "pins: it was rewritten or restored from an older copy"
                )
        if problem is None:
            return
        if not reset:
            raise LedgerError(
                f"{problem}. Refusing to start: a node that forgets releases promises more "
                "privacy than it has. Restore the file, or start with --reset-privacy-ledger "
                "to restore the ledger from the checkpoint's copy (releases since then are lost)"
            )
        if self.found:
            aside = self.path.with_name(f"{FILE}.bad-{time.strftime('%Y%m%d-%H%M%S')}")
            self.path.rename(aside)
            log.warning("reset-privacy-ledger: moved %s aside to %s", self.path, aside.name)
        before = self.total.epsilon if self.found else 0.0
        self.total, self.peers = total, peers
        self._recompute()
        self._save()
        log.warning(
            "reset-privacy-ledger: %s; the ledger was restored from %s: ε %.3g -> %.3g, "
            "%d releases (any made after that checkpoint are not counted)",
            problem,
            checkpoint,
            before,
            self.total.epsilon,
            self.total.releases,
        )

    def _take_token(self, peer: str) -> bool:
        if math.isinf(self.peer_rate):
            return True
        now = self._clock()
        b = self._buckets.get(peer)
        if b is None:
            b = self._buckets[peer] = _Bucket(self.peer_burst, now)
        b.tokens = min(self.peer_burst, b.tokens + (now - b.at) * self.peer_rate)
        b.at = now
        if b.tokens < 1:
            return False
        b.tokens -= 1
        return True

    def charge(
        self,
        peer: str,
        purpose: str,
        noise_multiplier: float,
        sample_rate: float,
        enforce: bool = True,
        requested: bool = True,
    ) -> float:
        """Record one release to ``peer`` (σ, q) and return the new total ε; with ``enforce``,
        raise ``BudgetSpent`` instead if it would take the total or the peer past its budget,
        or ``ReleaseRateLimited`` if the peer asks faster than its rate. ``requested=False``: a
        release this node chose to send (a FedeRiCo push, COBO's alignment vector), paced by its
        own rounds — the total and ``peer_budget`` bound it, the per-peer share and rate (which
        stop a peer *asking* the budget away) do not."""
        sigma, q = float(noise_multiplier), float(sample_rate)
        with self._lock:
            acc = self.peers.get(peer) or _Account()
            eps_total = self.total.eps(self.delta, (sigma, q))
            eps_peer = acc.eps(self.delta, (sigma, q))
            if enforce and eps_total > self.budget:
                self.refusals += 1
                self.refusing = True
                raise BudgetSpent(
                    f"privacy budget spent: this node has released ε = {self.total.epsilon:.3g} "
                    f"of its budget {self.budget:g} (δ = {self.delta:g}); one more "
                    f"release would make it {eps_total:.3g}"
                )
            if enforce and eps_peer > self.peer_budget:
                self.refusals += 1
                raise BudgetSpent(
                    f"privacy budget spent: {peer} has been released ε = {acc.epsilon:.3g} "
                    f"of the per-peer budget {self.peer_budget:.3g} (δ = {self.delta:g})"
                )
            k = self.expected_peers
            if enforce and requested and k > 1 and math.isfinite(self.budget):
                eps_share = acc.eps(self.delta, (sigma, q), scale=k)
                if eps_share > self.budget:
                    self.refusals += 1
                    raise BudgetSpent(
                        f"privacy budget spent: {peer} has had its share of this node's budget "
                        f"(1/{k} of ε = {self.budget:g}: {k} peers released what it has would "
                        f"compose to ε = {eps_share:.3g}); it has been released ε = {acc.epsilon:.3g}"
                    )
            if enforce and requested and not self._take_token(peer):
                self.rate_refusals += 1
                raise ReleaseRateLimited(
                    f"release rate: {peer} asks for more than {self.peer_rate:g} "
                    f"releases/s (bursts of {self.peer_burst}); ask again later"
                )
            self.refusing = False
            total, new = self.total.copy(), acc.copy()
            total.add(sigma, q, purpose, eps_total)
            new.add(sigma, q, purpose, eps_peer)
            old = self.total, self.peers.get(peer)
            self.total, self.peers[peer] = total, new
            try:
                self._save()  # before the release is even computed: see the module docstring
            except BaseException:  # not on disk: not released, and not counted as if it were
                self.total = old[0]
                if old[1] is None:
                    self.peers.pop(peer, None)
                else:
                    self.peers[peer] = old[1]
                raise
        self.on_change(peer, purpose)
        return eps_total

    def epsilon(self, peer: str | None = None) -> float:
        if peer is None:
            return self.total.epsilon
        acc = self.peers.get(peer)
        return acc.epsilon if acc else 0.0

    def spent(self) -> bool:
        return self.total.epsilon >= self.budget

    def view(self) -> dict[str, Any]:
        with self._lock:
            return {
                "epsilon": self.total.epsilon,
                "delta": self.delta,
                "budget_epsilon": self.budget,
                "peer_budget_epsilon": self.peer_budget,
                "budget_left": max(0.0, self.budget - self.total.epsilon),
                "releases": self.total.releases,
                "purposes": dict(self.total.purposes),
                "expected_peers": self.expected_peers,
                "peer_release_rate": self.peer_rate,
                "peer_release_burst": self.peer_burst,
                "budget_refusals": self.refusals,
                "rate_refusals": self.rate_refusals,
                "refusing": self.refusing,
                "peers": {
                    k: {"epsilon": v.epsilon, "releases": v.releases, "purposes": dict(v.purposes)}
                    for k, v in sorted(self.peers.items())
                },
            }
