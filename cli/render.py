"""Rich tables for the admin endpoints (``coterie status|peers|weights|history``)."""
from __future__ import annotations

import json
from typing import Any

from rich.table import Table
from rich.text import Text


def _fmt(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (dict, list)):
        return json.dumps(v, default=str)
    return str(v)


STATE_STYLE = {"alive": "green", "suspect": "yellow", "dead": "red"}


def status_table(st: dict[str, Any]) -> Table:
    t = Table(title=f"node {st.get('node_id', '?')}", show_header=False)
    t.add_column("field", style="bold")
    t.add_column("value")
    first = ["node_id", "round", "model_version", "strategy", "device", "peers_alive", "uptime_s",
             "done", "last_eval"]
    for k in first + sorted(k for k in st if k not in first and k not in ("strategy_state", "problems")):
        if k in st:
            v = st[k]
            if k == "last_eval" and isinstance(v, dict):
                v = ", ".join(f"{a}={_fmt(b)}" for a, b in v.items())
            t.add_row(k, _fmt(v))
    if st.get("strategy_state"):
        t.add_row("strategy_state", _fmt(st["strategy_state"]))
    problems = st.get("problems") or []
    t.add_row("problems", "none" if not problems else "\n".join(
        f"[red]{p.get('peer', '?')}: {p.get('message', '')}[/]" for p in problems[-5:]))
    return t


def peers_table(peers: list[dict[str, Any]]) -> Table:
    t = Table(title=f"{len(peers)} peers")
    cols = ["node_id", "address", "state", "last_seen_s", "snapshot_version", "weight"]
    for c in cols:
        t.add_column(c, justify="right" if c in ("last_seen_s", "snapshot_version", "weight") else "left")
    for p in peers:
        row = [_fmt(p.get(c)) for c in cols]
        row[2] = f"[{STATE_STYLE.get(str(p.get('state')), 'white')}]{row[2]}[/]"
        t.add_row(*row)
    return t


def weights_table(w: dict[str, Any]) -> Table:
    t = Table(title=f"collaborator weights of {w.get('node_id', '?')} (round {_fmt(w.get('round'))})")
    t.add_column("peer")
    t.add_column("weight", justify="right")
    t.add_column("")
    weights = w.get("weights") or {}
    for peer, v in sorted(weights.items(), key=lambda kv: -(kv[1] or 0)):
        bar = Text("█" * int(round(max(0.0, min(1.0, float(v or 0))) * 30)), style="blue")
        t.add_row(str(peer), _fmt(v), bar)
    return t


def _top_peers(weights: dict[str, float] | None, self_id: str | None, k: int = 2) -> str:
    peers = sorted(((p, w) for p, w in (weights or {}).items() if p != self_id and w),
                   key=lambda kv: -kv[1])[:k]
    return ", ".join(f"{p} {w:.2f}" for p, w in peers) or "–"


def history_table(entries: list[dict[str, Any]], node_id: str | None = None) -> Table:
    """One row per round: duration, losses, accuracy, peers, traffic, strongest collaborators."""
    t = Table(title=f"{len(entries)} rounds" + (f" of {node_id}" if node_id else ""))
    for c in ("round", "s", "train loss", "test acc", "test loss", "peers", "sent", "top peers"):
        t.add_column(c, justify="left" if c == "top peers" else "right")
    for e in entries:
        ev = e.get("eval") or {}
        sent = sum((e.get("bytes_sent") or {}).values())
        t.add_row(_fmt(e.get("round")), _fmt(e.get("duration_s")), _fmt(e.get("train_loss")),
                  _fmt(ev.get("test_acc")), _fmt(ev.get("test_loss")), _fmt(e.get("peers_alive")),
                  f"{sent / 1e3:.1f} kB" if sent else "–", _top_peers(e.get("weights"), node_id))
    return t
