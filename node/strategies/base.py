"""The strategy interface and the peer view a strategy gets from its node.

A strategy decides whom to learn from and how much. It never sees gRPC: it asks its
``PeerNetwork`` (implemented by the daemon) for snapshots, cross-losses and cross-gradients, and
gets ``None`` back when a peer is slow, dead or refuses — it must then carry on without it.

This is the contract third-party strategies (entry point group ``coterie.strategies``,
``registry.py``) are written against; docs/extending.md spells it out.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, TypeVar

import numpy as np

from ..learning.learner import Learner, Params

T = TypeVar("T")


@dataclass
class PeerSnapshot:
    """A peer's published model, as cached by this node."""

    node_id: str
    version: int
    round: int
    params: Params
    extras: dict[str, Params] = field(default_factory=dict)  # e.g. {"delta": Δθ} if published
    sha256: str = ""


@dataclass
class GradientReply:
    grad: Params | None  # None when the request asked for an inner product instead
    loss: float
    n: int
    inner_product: float | None = None


@dataclass
class PushedGradient:
    sender: str
    version: int  # the snapshot version of *this* node the sender differentiated
    grad: Params


class PeerNetwork(Protocol):
    """What the node offers a strategy. All calls are bounded by the node's request timeout and
    return None for a peer that is slow, dead, refuses or answers nonsense. Call them from the
    strategy's coroutines only (the node's event loop). What is computed on a peer's data
    (cross_loss, cross_gradient) comes back DP-noised and charged to that peer's privacy budget;
    it names a ``purpose`` the peer serves (privacy/purposes.py, ``privacy.serve_purposes``)."""

    node_id: str

    def peers(self) -> list[str]:
        """Peers currently alive (never self), sorted."""

    def known_peers(self) -> list[str]:
        """Every peer ever seen, dead ones included."""

    def true_cluster(self, node_id: str) -> int | None:
        """Ground-truth cluster a node announced (evaluation and the oracle baseline only)."""

    def cached(self, peer: str) -> PeerSnapshot | None:
        """Latest snapshot of ``peer`` already held, without network traffic."""

    async def pull(
        self, peer: str, *, min_round: int | None = None, wait_s: float | None = None, lazy: bool = False
    ) -> PeerSnapshot | None:
        """Latest snapshot of ``peer`` (from cache if its version did not change).

        Round-aligned exchange (for synchronous algorithms): with ``min_round``, a snapshot of
        round >= min_round; the peer holds the request open up to ``wait_s`` (default: the
        request timeout) until it publishes that round. None if it does not in time: the strategy
        proceeds without that peer, as for a dead one.

        ``lazy`` (for a strategy that only adds the model into its own, D-PSGD): the tensors may
        be left as the payload carried them, checked like any (architecture, finite values) but
        decoded only by ``Learner.add_to_params``, a chunk at a time into the live model — no
        decoded copy of the peer's model exists. Use them for nothing else; they are not cached."""

    def release(self, peer: str) -> None:
        """Let go of the snapshot of ``peer`` held for ``cached`` and compute references: a
        strategy that has used it up (D-PSGD, once averaged in) frees its memory now instead of
        holding a copy of every peer's model until the next pull replaces it."""

    async def cross_loss(
        self,
        peer: str,
        params: Params | None = None,
        *,
        purpose: str,
        split: str | None = None,
        max_samples: int | None = None,
        reduction: str = "mean",
    ) -> tuple[float, int] | None:
        """Loss of ``params`` (default: my current published model) on ``peer``'s data.
        ``purpose`` names the strategy step (``privacy/purposes.py``); it fixes the split, and
        the peer answers over at least its minimum batch, with privacy noise by default."""

    async def cross_gradient(
        self,
        peer: str,
        params: Params | None = None,
        *,
        purpose: str,
        split: str | None = None,
        max_samples: int | None = None,
        reduction: str = "mean",
        align_with: Params | None = None,
    ) -> GradientReply | None:
        """Gradient of ``params`` on ``peer``'s data. With ``align_with`` the peer returns only
        ⟨its gradient, align_with⟩ and hands that value to its own strategy (COBO)."""

    async def private_gradient(
        self, peer: str, params: Params, *, purpose: str, max_samples: int | None = None
    ) -> Params | None:
        """Gradient of ``params`` on *my* data as it may be sent to ``peer`` (FedeRiCo's push,
        COBO's alignment vector): privatised and charged to my privacy ledger; None once my
        privacy budget is spent."""

    async def push_gradient(self, peer: str, version: int, grad: Params, *, purpose: str = "federico-push") -> bool:
        """Send a (weighted) gradient for ``peer``'s snapshot ``version`` (FedeRiCo M-step);
        ``grad`` must come from ``private_gradient``."""

    def drain_pushed(self) -> list[PushedGradient]:
        """Gradients peers pushed to me since the last call."""

    def releases_noised(self) -> bool:
        """Whether what this node releases about its data (``private_gradient``, the cross-losses
        and -gradients it serves) carries DP noise (privacy on, σ > 0) or is withheld (its own
        files hold fewer than ``privacy.min_batch`` samples): a strategy may then prefer evidence
        that needs no release (FedeRiCo's ``peer_term = "auto"``)."""

    async def gossip(self, peer: str, key: str, payload: dict[str, Any]) -> dict[str, Any] | None:
        """Send a small msgpack-able payload (vectors as lists or float32 ndarrays); get the peer's
        strategy's reply for the same key (e.g. its Ω row, its encoder)."""


async def gather_bounded(calls: dict[str, Awaitable[T | None]]) -> dict[str, T]:
    """Run peer calls concurrently; keep the ones that answered (not None, no exception)."""
    keys = list(calls)
    results = await asyncio.gather(*calls.values(), return_exceptions=True)
    return {k: r for k, r in zip(keys, results, strict=True) if r is not None and not isinstance(r, BaseException)}


@dataclass
class RoundReport:
    train_loss: float | None = None
    contacted: list[str] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)  # strategy-specific figures for results


class Strategy(ABC):
    """One node's collaboration strategy. Subclasses register by ``name``.

    ``run_round`` does the whole round: local training (through ``self.learner``, CPU work via
    ``await self.compute(fn, ...)``), peer selection, exchange and the update of the live model.
    The node then publishes the model with ``published_extras()`` and persists ``state_dict()``.

    Built as ``cls(node_id, learner, network, params, seed=...)``; ``params`` must be keys of
    ``defaults``, and a key of ``choices`` one of its values; the node then calls
    ``plan_run(rounds)`` (its planned length) before the first round. ``run_round``, the ``on_*`` hooks,
    ``weights`` and ``state_dict`` run on the node's event loop (never block it; the hooks may run
    while ``run_round`` awaits); ``evaluate`` runs in a worker thread. Randomness from ``self.rng``
    only (reproducible runs).
    """

    name: ClassVar[str]
    defaults: ClassVar[dict[str, Any]] = {}
    # Set by the node (``publishing.publish_now``): publish the live model now, as this round's
    # snapshot, and get the published tensors (read-only views of the buffer peers are served
    # from), or None (not finite: the round's end publishes as usual). None where the node offers
    # none (a test harness): a strategy then keeps its own copy.
    publish_now: Callable[[], Awaitable[Params | None]] | None = None
    choices: ClassVar[dict[str, tuple[Any, ...]]] = {}  # parameters that take one of a few values

    def __init__(
        self, node_id: str, learner: Learner, network: PeerNetwork, params: dict[str, Any] | None = None, seed: int = 0
    ):
        unknown = set(params or {}) - set(self.defaults)
        if unknown:
            raise ValueError(
                f"strategy {self.name!r}: unknown parameter(s) {sorted(unknown)}; known: {sorted(self.defaults)}"
            )
        self.p = {**self.defaults, **(params or {})}
        for key, allowed in self.choices.items():
            if self.p[key] not in allowed:
                raise ValueError(f"strategy {self.name!r}: {key} must be one of {list(allowed)}, not {self.p[key]!r}")
        self.node_id = node_id
        self.learner = learner
        self.net = network
        self.rng = np.random.default_rng(seed)
        self.planned_rounds: int | None = None  # set by ``plan_run``; None = no planned end

    def plan_run(self, rounds: int | None) -> None:
        """The node tells its strategy how many rounds it will run in all (``NodeConfig.rounds``,
        counted from round 1, so a resumed node passes the same number); None = until stopped.
        A schedule the paper states as a share of the run (COBO's warm phase: "the first 0.2 % of
        the iterations") is fitted to it; the default is a node running forever. Called once,
        after construction and before the first round (not a constructor argument: third-party
        factories are called as ``(node_id, learner, network, params, seed=...)``)."""
        if rounds is not None and (isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 0):
            raise ValueError(
                f"strategy {self.name!r}: planned rounds must be a non-negative integer or None, not {rounds!r}"
            )
        self.planned_rounds = rounds

    @staticmethod
    async def compute(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run CPU/GPU-heavy learner work off the event loop (heartbeats keep flowing)."""
        return await asyncio.to_thread(fn, *args, **kwargs)

    @abstractmethod
    async def run_round(self, rnd: int) -> RoundReport: ...

    @abstractmethod
    def weights(self) -> dict[str, float]:
        """This node's collaborator-weight row w_i·, keyed by node id, self included."""

    def shared_params(self) -> Params | None:
        """The model to publish, when it is not the live one (None = the live model). D-PSGD in
        adapt-then-combine form shares its trained model but keeps the neighbourhood average."""
        return None

    def published_extras(self) -> dict[str, Params]:
        """Named tensor groups to publish with the snapshot (e.g. {"delta": Δθ})."""
        return {}

    def public_state(self) -> dict[str, Any]:
        """JSON-able view of the strategy's own state (affinity P, EMA losses, α, Ω...)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: JSON-able values, tensors/ndarrays/bytes anywhere inside.
        Return copies (clone tensors): the checkpoint is written from it while the next round
        runs, so it must not change under the writer."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None

    def on_published(self, params: Params) -> None:
        """The node published: ``params`` are the published model's tensors (read-only views of
        the encoded snapshot the node serves). A strategy that keeps the model it shares may hold
        these instead of its own copy, so the node holds that model once."""
        return None

    def on_diverged(self) -> None:
        """The node rolled the live model back to the round's start (a non-finite model or loss,
        ``learning/guard.py``): forget what was derived from the diverged one."""
        return None

    def prediction_members(self) -> list[tuple[str, float, Params]] | None:
        """The models this node predicts with, when that is a mixture Σ_k w_k p(y|x; θ_k):
        (node id, weight, params) of the members ``evaluate`` last scored, weights summing to 1.
        None (the default) = it predicts with its own model. The node checkpoints the members so
        ``coterie model export`` writes what the node reports (node/modelfile.py)."""
        return None

    def evaluate(self) -> dict[str, float]:
        """Test metrics of how this node predicts (default: its own model)."""
        r = self.learner.evaluate("test")
        out = {"test_loss": r.loss}
        if r.accuracy is not None:
            out["test_acc"] = r.accuracy
        return out

    # --- served side: hooks the node calls when a peer's request concerns the strategy ---
    def on_gossip(self, peer: str, key: str, payload: dict[str, Any]) -> dict[str, Any] | None:
        """Answer a peer's gossip for ``key``; None = not understood."""
        return None

    def on_alignment(self, peer: str, inner_product: float) -> None:
        """A peer computed ⟨∇f_peer(z), ∇f_me(z)⟩ with me (COBO): update my w_{me,peer}."""
        return None
