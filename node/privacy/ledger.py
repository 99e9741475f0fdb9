"""The privacy ledger: every release about this node's data, per peer and in total, on disk.

Everything released about one node's data composes, whoever received it, so the **total** ε is
the guarantee and the budget; the per-peer figures show who spent it (and can be capped, so one
peer cannot use up the node's budget alone). ``charge`` is called *before* the computation and
persists the entry (atomic write, fsync) before it returns: a reply never leaves without its entry
on disk, so after ``kill -9`` the ledger can over-count a release that never left, never
under-count one that did.

File ``privacy-ledger.json`` in the state dir::

    {"format": "coterie-privacy-ledger/1",
     "total": {"releases": 12, "steps": [[σ, q, count], ...]},
     "peers": {"n3": {"releases": 4, "steps": [...], "purposes": {"scool-evidence": 4}}}}

δ and the budgets come from the config (a restart may change them; the steps are the record).
A corrupt ledger stops the node with the file named: starting from zero would forget releases."""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .. import fsutil
from . import accountant

FORMAT = "coterie-privacy-ledger/1"
FILE = "privacy-ledger.json"


class BudgetSpent(Exception):
    """A release would take the total (or one peer's) ε past its budget."""


@dataclass
class _Account:
    steps: dict[tuple[float, float], int] = field(default_factory=dict)
    releases: int = 0
    purposes: dict[str, int] = field(default_factory=dict)
    epsilon: float = 0.0

    def history(self) -> list[tuple[float, float, int]]:
        return [(s, q, n) for (s, q), n in self.steps.items()]

    def with_step(self, sigma: float, q: float) -> list[tuple[float, float, int]]:
        """The history as it would be after one more release at (σ, q)."""
        steps = dict(self.steps)
        steps[(sigma, q)] = steps.get((sigma, q), 0) + 1
        return [(s, r, n) for (s, r), n in steps.items()]

    def add(self, sigma: float, q: float, purpose: str, eps: float) -> None:
        self.steps[(sigma, q)] = self.steps.get((sigma, q), 0) + 1
        self.releases += 1
        self.purposes[purpose] = self.purposes.get(purpose, 0) + 1
        self.epsilon = eps

    def to_json(self) -> dict[str, Any]:
        return {"releases": self.releases, "purposes": dict(self.purposes),
                "steps": [[s, q, n] for (s, q), n in sorted(self.steps.items())]}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "_Account":
        steps: dict[tuple[float, float], int] = {}
        for s, q, n in d["steps"]:
            s, q, n = float(s), float(q), int(n)
            if not (s >= 0 and 0 < q <= 1 and n >= 0):
                raise ValueError(f"bad step {[s, q, n]}")
            steps[(s, q)] = steps.get((s, q), 0) + n
        return cls(steps, int(d["releases"]), {str(k): int(v) for k, v in d.get("purposes", {}).items()})


class PrivacyLedger:
    def __init__(self, state_dir: str | Path, *, delta: float, budget: float = math.inf,
                 peer_budget: float = math.inf, on_change: Callable[[str, str], None] | None = None):
        self.path = Path(state_dir) / FILE
        self.delta, self.budget, self.peer_budget = delta, budget, peer_budget
        self.on_change = on_change or (lambda peer, purpose: None)  # after each recorded release
        self._lock = threading.Lock()
        self.total = _Account()
        self.peers: dict[str, _Account] = {}
        self.refusals = 0
        self.refusing = False  # the last release asked for was refused (until one fits again)
        self._load()

    def _load(self) -> None:
        if not self.path.exists():
            return
        data = fsutil.read_json(self.path)
        try:
            if data.get("format") != FORMAT:
                raise ValueError(f"format {data.get('format')!r}, expected {FORMAT!r}")
            self.total = _Account.from_json(data["total"])
            self.peers = {str(k): _Account.from_json(v) for k, v in data["peers"].items()}
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"{self.path} is corrupt ({e}); it records what this node has released "
                             "about its data, so it is never reset silently") from None
        for acc in [self.total, *self.peers.values()]:
            acc.epsilon = accountant.epsilon(acc.history(), self.delta)

    def _save(self) -> None:
        fsutil.atomic_write_json(self.path, {
            "format": FORMAT, "total": self.total.to_json(),
            "peers": {k: v.to_json() for k, v in sorted(self.peers.items())}})

    def charge(self, peer: str, purpose: str, noise_multiplier: float, sample_rate: float,
               enforce: bool = True) -> float:
        """Record one release to ``peer`` (σ, q) and return the new total ε; with ``enforce``,
        raise ``BudgetSpent`` instead if it would take the total or the peer past its budget."""
        sigma, q = float(noise_multiplier), float(sample_rate)
        with self._lock:
            acc = self.peers.get(peer) or _Account()
            eps_total = accountant.epsilon(self.total.with_step(sigma, q), self.delta)
            eps_peer = accountant.epsilon(acc.with_step(sigma, q), self.delta)
            if enforce and eps_total > self.budget:
                self.refusals += 1
                self.refusing = True
                raise BudgetSpent(f"privacy budget spent: this node has released ε = {self.total.epsilon:.3g} "
                                  f"of its budget {self.budget:g} (δ = {self.delta:g}); one more "
                                  f"release would make it {eps_total:.3g}")
            if enforce and eps_peer > self.peer_budget:
                self.refusals += 1
                raise BudgetSpent(f"privacy budget spent: {peer} has been released ε = {acc.epsilon:.3g} "
                                  f"of the per-peer budget {self.peer_budget:g} (δ = {self.delta:g})")
            self.refusing = False
            self.total.add(sigma, q, purpose, eps_total)
            acc.add(sigma, q, purpose, eps_peer)
            self.peers[peer] = acc
            self._save()  # before the release is even computed: see the module docstring
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
            return {"epsilon": self.total.epsilon, "delta": self.delta,
                    "budget_epsilon": self.budget, "peer_budget_epsilon": self.peer_budget,
                    "budget_left": max(0.0, self.budget - self.total.epsilon),
                    "releases": self.total.releases, "purposes": dict(self.total.purposes),
                    "budget_refusals": self.refusals, "refusing": self.refusing,
                    "peers": {k: {"epsilon": v.epsilon, "releases": v.releases, "purposes": dict(v.purposes)}
                              for k, v in sorted(self.peers.items())}}
