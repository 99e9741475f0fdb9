"""Who is out there: the peer table and its alive → suspect → dead life cycle.

A peer is *alive* while we heard from it within ``suspect_after_s`` (any successful call or any
call it made to us), *suspect* until ``dead_after_s``, then *dead*. Dead peers are still pinged,
so a restarted peer comes back as soon as it answers."""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

ALIVE, SUSPECT, DEAD = "alive", "suspect", "dead"


@dataclass
class PeerRecord:
    node_id: str
    address: str
    last_seen: float = field(default_factory=time.monotonic)
    state: str = ALIVE
    round: int = 0
    snapshot_version: int = 0
    rtt_s: float | None = None
    labels: dict[str, str] = field(default_factory=dict)
    admin_url: str = ""

    def age(self, now: float | None = None) -> float:
        return (now or time.monotonic()) - self.last_seen


class PeerTable:
    def __init__(self, self_id: str, suspect_after_s: float, dead_after_s: float):
        self.self_id = self_id
        self.suspect_after_s = suspect_after_s
        self.dead_after_s = max(dead_after_s, suspect_after_s)
        self.records: dict[str, PeerRecord] = {}

    def upsert(self, node_id: str, address: str, *, labels: dict[str, str] | None = None,
               admin_url: str | None = None, seen: bool = True) -> PeerRecord:
        rec = self.records.get(node_id)
        if rec is None:
            rec = PeerRecord(node_id, address, last_seen=time.monotonic() if seen else 0.0,
                             state=ALIVE if seen else DEAD)
            self.records[node_id] = rec
        rec.address = address or rec.address
        if labels is not None:
            rec.labels = dict(labels)
        if admin_url:
            rec.admin_url = admin_url
        if seen:
            self.seen(node_id)
        return rec

    def seen(self, node_id: str, *, round: int | None = None, version: int | None = None,
             rtt_s: float | None = None) -> None:
        rec = self.records.get(node_id)
        if rec is None:
            return
        rec.last_seen = time.monotonic()
        rec.state = ALIVE
        if round is not None:
            rec.round = round
        if version is not None:
            rec.snapshot_version = version
        if rtt_s is not None:
            rec.rtt_s = rtt_s

    def refresh(self) -> list[tuple[str, str, str]]:
        """Re-derive states from ages; returns the transitions (node_id, old, new)."""
        now = time.monotonic()
        changes = []
        for rec in self.records.values():
            age = rec.age(now)
            new = ALIVE if age < self.suspect_after_s else SUSPECT if age < self.dead_after_s else DEAD
            if new != rec.state:
                changes.append((rec.node_id, rec.state, new))
                rec.state = new
        return changes

    def alive(self) -> list[str]:
        return sorted(n for n, r in self.records.items() if r.state == ALIVE)

    def known(self) -> list[str]:
        return sorted(self.records)

    def counts(self) -> dict[str, int]:
        out = {ALIVE: 0, SUSPECT: 0, DEAD: 0}
        for r in self.records.values():
            out[r.state] += 1
        return out

    def by_address(self, address: str) -> PeerRecord | None:
        return next((r for r in self.records.values() if r.address == address), None)

    def to_json(self) -> list[dict[str, Any]]:
        return [{"node_id": r.node_id, "address": r.address, "labels": r.labels,
                 "admin_url": r.admin_url} for r in self.records.values()]

    def load_json(self, rows: list[dict[str, Any]]) -> None:
        """Restore known peers as dead: they must answer before they count as alive again."""
        for row in rows:
            self.upsert(row["node_id"], row["address"], labels=row.get("labels", {}),
                        admin_url=row.get("admin_url"), seen=False)

    def view(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        return [{**{k: v for k, v in asdict(r).items() if k != "last_seen"},
                 "last_seen_s": round(r.age(now), 3) if r.last_seen else None}
                for r in sorted(self.records.values(), key=lambda r: r.node_id)]
