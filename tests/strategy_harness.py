"""In-process network for strategy tests: real torch learners, real tensors, every peer call
routed directly to the other node's learner or strategy (no gRPC, no sleeps).

``ToyLearner`` implements the Learner ABC: a tiny MLP (or softmax regression) on Gaussian class
blobs shared by every node, where each cluster of nodes relabels the classes with its own
permutation ("label-permuted clusters"). ``InProcessNetwork`` implements the PeerNetwork protocol;
gossip payloads and replies go through a msgpack round trip, so what a strategy sends must be
msgpack-able, as over the real wire.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import threading
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import msgpack
import numpy as np
import torch
from torch import nn

from coterie.node.learning.learner import EvalResult, Learner, Params, TrainResult
from coterie.node.persistence import pack_state, unpack_state
from coterie.node.privacy.purposes import purpose as purpose_table
from coterie.node.strategies.base import GradientReply, PeerSnapshot, PushedGradient, Strategy

Reduction = Literal["mean", "sum"]  # what Learner.loss / gradient take

torch.set_num_threads(1)


# --------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------


def make_partition(
    num_nodes: int = 6,
    num_clusters: int = 2,
    dim: int = 8,
    num_classes: int = 4,
    n_train: int = 64,
    n_val: int = 32,
    n_test: int = 64,
    noise: float = 1.0,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """Clusters are contiguous blocks of nodes (0,1,2 | 3,4,5 for 6 nodes, 2 clusters). Class c has
    mean μ_c (shared); cluster k maps class c to label π_k(c), π_0 = identity, π_k a derangement
    for k > 0, so clusters disagree on every label."""
    rng = np.random.default_rng(seed)
    means = rng.normal(0, 2.0, size=(num_classes, dim))
    perms = [np.arange(num_classes)]
    for _ in range(1, num_clusters):
        while True:
            p = rng.permutation(num_classes)
            if np.all(p != np.arange(num_classes)) and all(np.any(p != q) for q in perms):
                perms.append(p)
                break
    per = num_nodes // num_clusters
    shards = []
    for i in range(num_nodes):
        k = min(i // per, num_clusters - 1)
        split = {}
        for name, n in (("train", n_train), ("val", n_val), ("test", n_test)):
            c = rng.integers(num_classes, size=n)
            x = means[c] + noise * rng.normal(size=(n, dim))
            split[name] = (torch.tensor(x, dtype=torch.float32), torch.tensor(perms[k][c], dtype=torch.long))
        shards.append({"cluster": k, "data": split})
    return shards


# --------------------------------------------------------------------------------------------
# Learner
# --------------------------------------------------------------------------------------------


class ToyLearner(Learner):
    def __init__(
        self,
        data: dict[str, tuple[torch.Tensor, torch.Tensor]],
        cluster: int,
        hidden: int = 16,
        num_classes: int = 4,
        lr: float = 0.1,
        batch_size: int = 16,
        local_steps: int = 5,
        init_seed: int = 0,
        seed: int = 0,
        optimizer: str = "sgd",
    ):
        self.device = "cpu"
        self.true_cluster = cluster
        self.data = data
        dim = data["train"][0].shape[1]
        torch.manual_seed(init_seed)  # common θ⁰ for every node
        if hidden:
            self.model = nn.Sequential(nn.Linear(dim, hidden), nn.Tanh(), nn.Linear(hidden, num_classes))
        else:
            self.model = nn.Sequential(nn.Linear(dim, num_classes))
        opt = torch.optim.Adam if optimizer == "adam" else torch.optim.SGD
        self.opt = opt(self.model.parameters(), lr=lr)
        self.batch_size = batch_size
        self.local_steps = local_steps
        self._rng = np.random.default_rng(seed)
        self._lock = threading.Lock()  # guards the rng and the live model

    # --- parameters ---
    def get_params(self) -> Params:
        with self._lock:
            return {k: v.detach().clone() for k, v in self.model.named_parameters()}

    def set_params(self, params: Params) -> None:
        with self._lock, torch.no_grad():
            for k, v in self.model.named_parameters():
                v.copy_(params[k])

    def param_spec(self) -> dict[str, tuple[tuple[int, ...], str]]:
        return {k: (tuple(v.shape), str(v.dtype).replace("torch.", "")) for k, v in self.model.named_parameters()}

    def fingerprint(self) -> str:
        return hashlib.sha256(repr(self.param_spec()).encode()).hexdigest()

    # --- helpers ---
    def _batch(self, split: str, max_samples: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.data[split]
        if max_samples is None or max_samples >= len(y):
            return x, y
        with self._lock:
            idx = self._rng.choice(len(y), size=max_samples, replace=False)
        return x[idx], y[idx]

    def _logits(self, params: Params | None, x: torch.Tensor) -> torch.Tensor:
        """Forward pass with explicit parameters (never touches the live model)."""
        if params is None:
            params = self.get_params()
        h = x
        for i, mod in enumerate(self.model):
            if isinstance(mod, nn.Linear):
                h = nn.functional.linear(h, params[f"{i}.weight"], params[f"{i}.bias"])
            else:
                h = mod(h)
        return h

    # --- learning ---
    def train(self, steps: int | None = None) -> TrainResult:
        steps = self.local_steps if steps is None else steps
        losses = []
        for _ in range(steps):
            x, y = self._batch("train", self.batch_size)
            with self._lock:
                self.opt.zero_grad()
                loss = nn.functional.cross_entropy(self.model(x), y)
                loss.backward()
                self.opt.step()
            losses.append(loss.item())
        return TrainResult(
            loss=float(np.mean(losses)) if losses else float("nan"), steps=steps, samples=steps * self.batch_size
        )

    def loss(
        self,
        params: Params | None = None,
        split: str = "train",
        max_samples: int | None = None,
        reduction: Reduction = "mean",
    ) -> EvalResult:
        x, y = self._batch(split, max_samples)
        with torch.no_grad():
            out = self._logits(params, x)
            loss = nn.functional.cross_entropy(out, y, reduction=reduction)
            acc = float((out.argmax(1) == y).float().mean())
        return EvalResult(loss=loss.item(), n=len(y), accuracy=acc)

    def gradient(
        self,
        params: Params | None = None,
        split: str = "train",
        max_samples: int | None = None,
        reduction: Reduction = "mean",
    ) -> tuple[Params, EvalResult]:
        x, y = self._batch(split, max_samples)
        p = {k: v.detach().clone().requires_grad_(True) for k, v in (params or self.get_params()).items()}
        out = self._logits(p, x)
        loss = nn.functional.cross_entropy(out, y, reduction=reduction)
        grads = torch.autograd.grad(loss, list(p.values()))
        acc = float((out.argmax(1) == y).float().mean())
        return {k: g.detach() for k, g in zip(p, grads, strict=True)}, EvalResult(
            loss=loss.item(), n=len(y), accuracy=acc
        )

    def apply_gradient(self, grad: Params) -> None:
        with self._lock:
            self.opt.zero_grad()
            for k, v in self.model.named_parameters():
                v.grad = grad[k].clone().to(v.dtype)
            self.opt.step()

    def evaluate(self, split: str = "test", params: Params | None = None) -> EvalResult:
        return self.loss(params, split)

    def evaluate_mixture(self, members: list[tuple[float, Params | None]], split: str = "test") -> EvalResult:
        x, y = self.data[split]
        with torch.no_grad():
            prob = torch.stack(
                [w * torch.softmax(self._logits(self.get_params() if p is None else p, x), 1) for w, p in members]
            ).sum(0)
            loss = float(nn.functional.nll_loss(torch.log(prob.clamp_min(1e-12)), y))
            acc = float((prob.argmax(1) == y).float().mean())
        return EvalResult(loss=loss, n=len(y), accuracy=acc)

    def num_samples(self, split: str = "train") -> int:
        return len(self.data[split][1])

    def export_state(
        self, reuse: dict[str, torch.Tensor] | None = None, live: bool = False
    ) -> tuple[dict[str, torch.Tensor], dict]:
        with self._lock:  # copies even when ``live`` (allowed: a live export is an optimisation)
            return {k: v.detach().clone() for k, v in self.model.state_dict().items()}, {}

    def import_state(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        with self._lock:
            self.model.load_state_dict(tensors)


# --------------------------------------------------------------------------------------------
# Network
# --------------------------------------------------------------------------------------------


def _wire(obj: Any) -> Any:
    """msgpack round trip (ndarrays become lists), as the daemon's gossip channel would."""

    def default(o: Any) -> Any:
        if isinstance(o, np.ndarray):
            return o.tolist()
        if isinstance(o, (np.floating, np.integer)):
            return o.item()
        raise TypeError(f"not msgpack-able: {type(o).__name__}")

    return msgpack.unpackb(msgpack.packb(obj, default=default, use_bin_type=True), raw=False)


def msgpack_roundtrip_state(state: dict[str, Any]) -> dict[str, Any]:
    """state_dict values must be msgpack-able; Params dicts (tensors) are allowed: encode them as
    {name: ndarray→list} and back, to check everything else packs."""

    def default(o: Any) -> Any:
        if isinstance(o, torch.Tensor):
            return {"__t__": o.detach().cpu().numpy().tolist(), "dtype": str(o.dtype)}
        if isinstance(o, np.ndarray):
            return o.tolist()
        if isinstance(o, (np.floating, np.integer)):
            return o.item()
        raise TypeError(f"not msgpack-able: {type(o).__name__}")

    def hook(d: dict) -> Any:
        if "__t__" in d:
            return torch.tensor(d["__t__"], dtype=getattr(torch, d["dtype"].replace("torch.", "")))
        return d

    return msgpack.unpackb(
        msgpack.packb(state, default=default, use_bin_type=True), raw=False, object_hook=hook, strict_map_key=False
    )


@dataclass
class Node:
    node_id: str
    cluster: int
    learner: ToyLearner
    strategy: Strategy | None = None
    snapshot: PeerSnapshot | None = None
    inbox: list[PushedGradient] = field(default_factory=list)
    alive: bool = True

    def running(self) -> Strategy:
        """The node's strategy, which build_network sets after making the node."""
        assert self.strategy is not None, f"{self.node_id} has no strategy yet"
        return self.strategy


class Hub:
    def __init__(self, wait_s: float = 30.0) -> None:
        self.nodes: dict[str, Node] = {}
        self.calls: dict[str, int] = {}
        self.wait_s = wait_s  # default bound of a round-aligned pull (the daemon: its request timeout)
        self.noised = False  # what releases_noised() answers (the daemon: privacy on and σ > 0)
        self._published: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None

    def count(self, what: str) -> None:
        self.calls[what] = self.calls.get(what, 0) + 1

    def published(self) -> asyncio.Event:
        """An event set at the next publish by anyone (one per event loop: tests run several)."""
        loop = asyncio.get_running_loop()
        if self._published is None or self._published[0] is not loop:
            self._published = (loop, asyncio.Event())
        return self._published[1]

    def publish(self, node_id: str, rnd: int) -> None:
        n = self.nodes[node_id]
        version = 0 if n.snapshot is None else n.snapshot.version + 1
        extras = {
            k: {kk: vv.detach().clone() for kk, vv in v.items()}
            for k, v in (n.strategy.published_extras() if n.strategy else {}).items()
        }
        n.snapshot = PeerSnapshot(
            node_id=node_id, version=version, round=rnd, params=n.learner.get_params(), extras=extras
        )
        if self._published is not None:
            self._published[1].set()
            self._published = None


def _split_of(purpose: str, kind: str, split: str | None) -> str:
    """The split a purpose is answered on; a strategy naming the wrong purpose fails here as it
    would on a real node."""
    p = purpose_table(purpose)
    assert p.kind == kind, f"purpose {purpose!r} is a {p.kind}, used for a {kind}"
    assert split in (None, p.split), f"purpose {purpose!r} is answered on {p.split!r}, not {split!r}"
    return p.split


class InProcessNetwork:
    def __init__(self, hub: Hub, node_id: str):
        self.hub = hub
        self.node_id = node_id

    def _peer(self, peer: str) -> Node | None:
        n = self.hub.nodes.get(peer)
        return n if n is not None and n.alive and peer != self.node_id else None

    def peers(self) -> list[str]:
        return sorted(k for k, n in self.hub.nodes.items() if k != self.node_id and n.alive)

    def known_peers(self) -> list[str]:
        return sorted(k for k in self.hub.nodes if k != self.node_id)

    def true_cluster(self, node_id: str) -> int | None:
        n = self.hub.nodes.get(node_id)
        return None if n is None else n.cluster

    def cached(self, peer: str) -> PeerSnapshot | None:
        n = self.hub.nodes.get(peer)
        return None if n is None or n.snapshot is None else copy.deepcopy(n.snapshot)

    def release(self, peer: str) -> None:
        self.hub.count("release")  # nothing held here: every pull hands out a copy

    async def pull(
        self, peer: str, *, min_round: int | None = None, wait_s: float | None = None, lazy: bool = False
    ) -> PeerSnapshot | None:
        """As the daemon's: with ``min_round``, a snapshot of round >= min_round, waiting up to
        ``wait_s`` (default ``hub.wait_s``) for the peer to publish it; else None."""
        n = self._peer(peer)
        self.hub.count("pull")
        if n is None:
            return None
        if min_round:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + (self.hub.wait_s if wait_s is None else max(0.0, wait_s))
            while n.snapshot is None or n.snapshot.round < min_round:
                left = deadline - loop.time()
                if left <= 0:
                    return None
                try:
                    await asyncio.wait_for(self.hub.published().wait(), left)
                except asyncio.TimeoutError:
                    return None
                n = self._peer(peer)
                if n is None:
                    return None
            self.hub.count("pull_aligned")
        return None if n.snapshot is None else copy.deepcopy(n.snapshot)

    def _mine(self) -> Params:
        mine = self.hub.nodes[self.node_id].snapshot
        assert mine is not None, f"{self.node_id} pulls before it published"
        return mine.params

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
        split = _split_of(purpose, "loss", split)
        n = self._peer(peer)
        self.hub.count("cross_loss")
        if n is None:
            return None
        r = await asyncio.to_thread(
            n.learner.loss,
            params if params is not None else self._mine(),
            split,
            max_samples,
            cast(Reduction, reduction),
        )
        return r.loss, r.n

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
        split = _split_of(purpose, "gradient" if align_with is None else "alignment", split)
        n = self._peer(peer)
        self.hub.count("cross_gradient")
        if n is None:
            return None
        g, r = await asyncio.to_thread(
            n.learner.gradient,
            params if params is not None else self._mine(),
            split,
            max_samples,
            cast(Reduction, reduction),
        )
        if align_with is not None:
            ip = float(sum(torch.sum(g[k].double() * align_with[k].double()) for k in g))
            if n.strategy is not None:
                n.strategy.on_alignment(self.node_id, ip)
            return GradientReply(grad=None, loss=r.loss, n=r.n, inner_product=ip)
        return GradientReply(grad=g, loss=r.loss, n=r.n)

    async def private_gradient(
        self, peer: str, params: Params, *, purpose: str, max_samples: int | None = None
    ) -> Params | None:
        """My own gradient as sent out; exact here (the DP mechanism is tested on real nodes)."""
        assert purpose_table(purpose).kind in ("push", "alignment"), purpose
        self.hub.count("private_gradient")
        me = self.hub.nodes[self.node_id]
        g, _ = await asyncio.to_thread(me.learner.gradient, params, purpose_table(purpose).split, max_samples)
        return g

    async def push_gradient(self, peer: str, version: int, grad: Params, *, purpose: str = "federico-push") -> bool:
        assert purpose_table(purpose).kind == "push", purpose
        n = self._peer(peer)
        self.hub.count("push")
        if n is None:
            return False
        n.inbox.append(
            PushedGradient(sender=self.node_id, version=version, grad={k: v.detach().clone() for k, v in grad.items()})
        )
        return True

    def drain_pushed(self) -> list[PushedGradient]:
        me = self.hub.nodes[self.node_id]
        out, me.inbox = me.inbox, []
        return out

    def releases_noised(self) -> bool:
        return self.hub.noised  # private_gradient here is exact; a test may say it is not

    async def gossip(self, peer: str, key: str, payload: dict[str, Any]) -> dict[str, Any] | None:
        n = self._peer(peer)
        self.hub.count("gossip")
        if n is None or n.strategy is None:
            return None
        reply = n.strategy.on_gossip(self.node_id, key, _wire(payload))
        return None if reply is None else _wire(reply)


def build_network(
    strategy_cls: type[Strategy],
    params: dict[str, Any] | None = None,
    *,
    num_nodes: int = 6,
    num_clusters: int = 2,
    learner_kw: dict[str, Any] | None = None,
    data_kw: dict[str, Any] | None = None,
    seed: int = 0,
) -> Hub:
    hub = Hub()
    shards = make_partition(num_nodes, num_clusters, seed=seed, **(data_kw or {}))
    for i, sh in enumerate(shards):
        nid = f"n{i}"
        learner = ToyLearner(sh["data"], sh["cluster"], seed=seed * 1000 + i, **(learner_kw or {}))
        hub.nodes[nid] = Node(nid, sh["cluster"], learner)
    for i, (nid, node) in enumerate(hub.nodes.items()):
        node.strategy = strategy_cls(nid, node.learner, InProcessNetwork(hub, nid), params, seed=seed * 1000 + i)
        hub.publish(nid, 0)
    return hub


async def run_free(hub: Hub, rounds: int, delay_s: dict[str, float] | None = None, start: int = 1) -> dict[str, list]:
    """Every node runs its own rounds as fast as it can, as daemons do (no global round barrier),
    publishing after each; ``delay_s[node]`` slows a node down by that much per round."""

    async def node_loop(nid: str) -> list:
        out = []
        for rnd in range(start, start + rounds):
            out.append(await hub.nodes[nid].running().run_round(rnd))
            hub.publish(nid, rnd)
            if pause := (delay_s or {}).get(nid):
                await asyncio.sleep(pause)  # a slower node, not a wait for anything
        return out

    reports = await asyncio.gather(*(node_loop(nid) for nid in hub.nodes))
    return dict(zip(hub.nodes, reports, strict=True))


async def run_rounds(
    hub: Hub, rounds: int, start: int = 1, concurrent: bool = False, synchronous: bool = False
) -> list[dict]:
    """Run ``rounds`` rounds on every node; each node publishes right after its round.
    Sequential by default (deterministic); ``concurrent`` runs the nodes' rounds together;
    ``synchronous`` runs them one after another but publishes only once all are done (a global
    round barrier: every node sees everyone's previous round, nobody's current one)."""
    reports = []
    for rnd in range(start, start + rounds):
        if synchronous:
            rep = {nid: await node.running().run_round(rnd) for nid, node in hub.nodes.items()}
            for nid in hub.nodes:
                hub.publish(nid, rnd)
            reports.append(rep)
        elif concurrent:

            async def one(nid: str, rnd: int) -> Any:
                r = await hub.nodes[nid].running().run_round(rnd)
                hub.publish(nid, rnd)
                return r

            rs = await asyncio.gather(*(one(nid, rnd) for nid in hub.nodes))
            reports.append(dict(zip(hub.nodes, rs, strict=True)))
        else:
            rep = {}
            for nid, node in hub.nodes.items():
                rep[nid] = await node.running().run_round(rnd)
                hub.publish(nid, rnd)
            reports.append(rep)
    return reports


def in_cluster_mass(hub: Hub) -> tuple[float, list[float], float]:
    """Mean over nodes of Σ w on true-cluster peers / Σ w on all peers (nodes with no peer weight
    count as chance), the per-node values, and chance = (c−1)/(n−1)."""
    vals = []
    n = len(hub.nodes)
    sizes: dict[int, int] = {}
    for node in hub.nodes.values():
        sizes[node.cluster] = sizes.get(node.cluster, 0) + 1
    chance = float(np.mean([(sizes[nd.cluster] - 1) / (n - 1) for nd in hub.nodes.values()]))
    for nid, node in hub.nodes.items():
        w = node.running().weights()
        tot = sum(max(v, 0.0) for k, v in w.items() if k != nid)
        inc = sum(max(v, 0.0) for k, v in w.items() if k != nid and hub.nodes[k].cluster == node.cluster)
        vals.append(inc / tot if tot > 0 else (sizes[node.cluster] - 1) / (n - 1))
    return float(np.mean(vals)), vals, chance


def mean_test_acc(hub: Hub) -> float:
    return float(np.mean([n.running().evaluate().get("test_acc", float("nan")) for n in hub.nodes.values()]))


def assert_encoder_resumes(s: Any) -> None:
    """A strategy with a learned encoder, rebuilt from its state_dict through the daemon's on-disk
    format, holds the same encoder and the same Adam state (else lr-sized steps again)."""
    s2 = type(s)(s.node_id, s.learner, s.net, s.p, seed=3)
    s2.load_state_dict(unpack_state(pack_state(s.state_dict())))
    assert s2.public_state() == s.public_state()
    assert torch.allclose(s2.encoder.get_vector(), s.encoder.get_vector())
    assert_same_optimizer_state(s2.opt, s.opt)


def assert_same_optimizer_state(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    """Two optimizers hold the same per-parameter state (Adam moments and step counts)."""
    sa, sb = a.state_dict()["state"], b.state_dict()["state"]
    assert sa and sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].keys() == sb[k].keys()
        for n in sa[k]:
            assert torch.equal(torch.as_tensor(sa[k][n]), torch.as_tensor(sb[k][n])), (k, n)
