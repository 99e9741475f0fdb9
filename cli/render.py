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
    first = [
        "node_id",
        "health",
        "failures",
        "round",
        "model_version",
        "strategy",
        "device",
        "peers_alive",
        "uptime_s",
        "done",
        "last_eval",
    ]
    for k in first + sorted(k for k in st if k not in first and k not in ("strategy_state", "problems", "privacy")):
        if k in st:
            v = st[k]
            if k == "last_eval" and isinstance(v, dict):
                v = ", ".join(f"{a}={_fmt(b)}" for a, b in v.items())
            if k == "failures" and isinstance(v, list):
                if not v:
                    continue
                v = "; ".join(f"{f.get('component')}: {f.get('error')} ({f.get('attempts')} attempts)" for f in v)
                t.add_row(k, f"[red]{v}[/]")
                continue
            if k == "health" and v != "ok":
                t.add_row(k, f"[red]{_fmt(v)}[/]")
                continue
            t.add_row(k, _fmt(v))
    if st.get("strategy_state"):
        t.add_row("strategy_state", _fmt(st["strategy_state"]))
    problems = st.get("problems") or []
    t.add_row(
        "problems",
        "none"
        if not problems
        else "\n".join(f"[red]{p.get('peer', '?')}: {p.get('message', '')}[/]" for p in problems[-5:]),
    )
    if isinstance(st.get("privacy"), dict):
        for k, v in privacy_rows(st["privacy"]):
            t.add_row(k, v)
    return t


def _eps(v: Any) -> str:
    return "∞" if v is None or (isinstance(v, float) and v == float("inf")) else f"{float(v):.3g}"


def privacy_rows(p: dict[str, Any]) -> list[tuple[str, str]]:
    """The privacy ledger as status rows: the total against the budget, then who spent it."""
    if not p.get("enabled", True):
        head = f"[red]off[/]: exact answers, {p.get('releases', 0)} released (ε = ∞)"
    else:
        left = p.get("budget_left")
        spent = bool(p.get("refusing")) or (left is not None and left <= 0)
        head = (
            f"ε = {_eps(p.get('epsilon'))} of {_eps(p.get('budget_epsilon'))} at δ = {p.get('delta')}"
            f" ({p.get('releases', 0)} releases; σ = {p.get('noise_multiplier')}, "
            f"clip {p.get('grad_clip')}/{p.get('loss_clip')}, batch ≥ {p.get('min_batch')})"
            + (" [red]budget spent: refusing[/]" if spent else "")
        )
    rows = [("privacy", head), ("privacy serves", ", ".join(p.get("serves") or []) or "nothing")]
    peers = p.get("peers") or {}
    for peer, a in sorted(peers.items(), key=lambda kv: -(kv[1].get("epsilon") or 0)):
        what = ", ".join(f"{k} {n}" for k, n in sorted((a.get("purposes") or {}).items()))
        rows.append((f"  ε to {peer}", f"{_eps(a.get('epsilon'))} ({a.get('releases', 0)}: {what})"))
    return rows


def peers_table(peers: list[dict[str, Any]]) -> Table:
    t = Table(title=f"{len(peers)} peers")
    from coterie.node.transport.relay_address import is_relayed, reachability

    cols = ["node_id", "address", "state", "last_seen_s", "snapshot_version", "weight"]
    relayed = any(is_relayed(str(p.get("address") or "")) for p in peers)
    # past the partial-view threshold: the overlay view a peer is in, and discovery's role for it
    partial = any(p.get("view") or p.get("candidate") or p.get("collaborator") for p in peers)
    extra = (["reachability"] if relayed else []) + (["view", "discovery"] if partial else [])
    for c in cols + extra:
        t.add_column(c, justify="right" if c in ("last_seen_s", "snapshot_version", "weight") else "left")
    for p in peers:
        row = [_fmt(p.get(c)) for c in cols] + ([reachability(str(p.get("address") or ""))] if relayed else [])
        if partial:
            role = ", ".join(r for r in ("candidate", "collaborator") if p.get(r))
            row += [str(p.get("view") or "–"), role or "–"]
        row[2] = f"[{STATE_STYLE.get(str(p.get('state')), 'white')}]{row[2]}[/]"
        t.add_row(*row)
    if partial:
        active = sum(p.get("view") == "active" for p in peers)
        exploring = sum(bool(p.get("candidate")) and not p.get("collaborator") for p in peers)
        t.caption = f"partial views: {active} in the active view; {exploring} candidates being explored"
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
    peers = sorted(((p, w) for p, w in (weights or {}).items() if p != self_id and w), key=lambda kv: -kv[1])[:k]
    return ", ".join(f"{p} {w:.2f}" for p, w in peers) or "–"


def history_table(entries: list[dict[str, Any]], node_id: str | None = None) -> Table:
    """One row per round: duration, losses, accuracy, peers, traffic, strongest collaborators."""
    t = Table(title=f"{len(entries)} rounds" + (f" of {node_id}" if node_id else ""))
    for c in ("round", "s", "train loss", "test acc", "test loss", "peers", "sent", "top peers"):
        t.add_column(c, justify="left" if c == "top peers" else "right")
    for e in entries:
        ev = e.get("eval") or {}
        sent = sum((e.get("bytes_sent") or {}).values())
        t.add_row(
            _fmt(e.get("round")),
            _fmt(e.get("duration_s")),
            _fmt(e.get("train_loss")),
            _fmt(ev.get("test_acc")),
            _fmt(ev.get("test_loss")),
            _fmt(e.get("peers_alive")),
            f"{sent / 1e3:.1f} kB" if sent else "–",
            _top_peers(e.get("weights"), node_id),
        )
    return t


def history_summary_table(blocks: list[dict[str, Any]]) -> Table:
    """The older rounds, folded (node/history.py): one row per block, means with their range."""
    t = Table(title=f"{sum(b.get('count', 0) for b in blocks)} older rounds, summarised")
    for c in ("rounds", "count", "s (mean)", "train loss (mean)", "test acc (mean, min–max)", "sent (mean)"):
        t.add_column(c, justify="right")
    for b in blocks:
        first, last = (b.get("rounds") or [None, None])[:2]
        acc = b.get("eval.test_acc") or {}
        sent = (b.get("sent") or {}).get("mean")
        t.add_row(
            f"{first}–{last}",
            _fmt(b.get("count")),
            _fmt((b.get("duration_s") or {}).get("mean")),
            _fmt((b.get("train_loss") or {}).get("mean")),
            f"{_fmt(acc.get('mean'))} ({_fmt(acc.get('min'))}–{_fmt(acc.get('max'))})" if acc else "–",
            f"{sent / 1e3:.1f} kB" if sent else "–",
        )
    return t
