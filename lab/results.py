"""results.json assembly, the terminal summary table and heatmap, and the PNG figures.

results.json (``"format": "coterie-results/1"``)::

    scenario            the resolved scenario (after command-line overrides)
    node_ids            ["n0", ...]: the order of every per-node list and matrix
    true_clusters       ground-truth cluster per node (from the partitioner), or null
    true_mixture        partition "mixture": each node's true component weights π_i (a row per
                        node), to score weight matrices against; else absent
    strategies.<name>:
      wall_time_s       launch to last node done
      node_configs      {node_id: full NodeConfig}
      nodes.<node_id>:  rounds, t, train_loss, test_acc, test_loss (lists, one per round),
                        eval (full eval dict per round), info (strategy info per round),
                        final_test_acc, final_test_loss, true_cluster, address, admin_url, pid,
                        bytes_sent / bytes_received ({kind: total bytes}: its rounds' and after),
                        bytes_sent_per_round / bytes_received_per_round (as the node logged them),
                        bytes_sent_after_rounds / bytes_received_after_rounds ({kind: bytes} in no
                        round record: served after its last round, from its final status),
                        collaboration (its final status's: peer answers vs privacy refusals;
                        helping and reason: the local-only reference's verdict),
                        mixed_nothing (no round gave a peer any weight),
                        membership (its final status's SWIM counters: suspected, declared_dead,
                        deaths_recent ...) and discovery (its final status's discovery view)
      weights           {"rounds": [1..R], "matrices": [W_r]}: W_r[i][j] = weight node i gave
                        node j in its round r (self included); a row is null if i has no round r
      final_weights     each node's last weight row, as a matrix
      mean_weights      each node's weight row averaged over its rounds (the heatmaps show this)
      summary           mean/min final accuracy, mean accuracy per true cluster, byte totals
      notes             per strategy: nodes that mixed nothing because their peers released
                        nothing (privacy refusals), with the reason
      placement         (ray backend) groups: [{group, host, ip, pid, ray_node, nodes}] and
                        routes: {node_id: {calls, bytes_sent, bytes_received} by memory / grpc}
    notes               anything odd (substituted strategies, short histories)

A node's ``bytes_sent`` in history.jsonl is read as the bytes of that round (totals are sums). A
node keeps serving after its last round — peers that started later pull its model — so the totals
add the bytes its final status lists as ``traffic_since_last_round``: without them a network whose
nodes start over minutes (1,000 in one process) showed twice the bytes received as sent.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from coterie.node.fsutil import atomic_write_bytes, json_safe

if TYPE_CHECKING:  # pragma: no cover
    from .scenario import Scenario, StrategyRun

FORMAT = "coterie-results/1"


def _num(v: Any) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def _sum_kinds(entries: list[dict[str, Any]], key: str) -> dict[str, int]:
    tot: dict[str, int] = {}
    for e in entries:
        for kind, n in (e.get(key) or {}).items():
            tot[kind] = tot.get(kind, 0) + int(n or 0)
    return dict(sorted(tot.items()))


def true_clusters_of(run: StrategyRun) -> tuple[list[int] | None, str | None]:
    if any(s.config.learner.data is not None for s in run.specs):  # own files: only what labels say
        labels = [s.config.labels.get("cluster") or "" for s in run.specs]
        if all(labels):
            try:
                return [int(v) for v in labels], None
            except ValueError:
                pass
        return None, "true clusters unavailable: the nodes learn from their own files (learner.data)"
    try:
        from coterie.node.learning.partition import true_clusters

        return [int(c) for c in true_clusters(run.specs[0].config.learner)], None
    except Exception as e:  # partitioner missing or the spec has no clusters
        return None, f"true clusters unavailable: {type(e).__name__}: {e}"


def true_mixture_of(run: StrategyRun) -> list[list[float]] | None:
    from coterie.node.learning.partition import true_mixture

    mix = true_mixture(run.specs[0].config.learner)
    return None if mix is None else mix.tolist()


def _add_kinds(a: dict[str, int], b: Any) -> dict[str, int]:
    out = dict(a)
    for k, v in (b or {}).items() if isinstance(b, dict) else ():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[str(k)] = out.get(str(k), 0) + int(v)
    return out


def node_results(history: list[dict[str, Any]], status: dict[str, Any] | None = None) -> dict[str, Any]:
    """One node's entry; ``status`` its final status, whose ``traffic_since_last_round`` are the
    bytes after its last round record."""
    after = (status or {}).get("traffic_since_last_round")
    after = after if isinstance(after, dict) else {}
    sent_after, received_after = _add_kinds({}, after.get("sent")), _add_kinds({}, after.get("received"))
    ev = [e.get("eval") or {} for e in history]
    acc = [_num(x.get("test_acc")) for x in ev]
    loss = [_num(x.get("test_loss")) for x in ev]
    return {
        "rounds": [e["round"] for e in history],
        "t": [_num(e.get("t")) for e in history],
        "train_loss": [_num(e.get("train_loss")) for e in history],
        "test_acc": acc,
        "test_loss": loss,
        "eval": ev,
        "info": [e.get("info") or {} for e in history],
        "final_test_acc": acc[-1] if acc else None,
        "final_test_loss": loss[-1] if loss else None,
        "bytes_sent": _add_kinds(_sum_kinds(history, "bytes_sent"), sent_after),
        "bytes_received": _add_kinds(_sum_kinds(history, "bytes_received"), received_after),
        "bytes_sent_per_round": [e.get("bytes_sent") or {} for e in history],
        "bytes_received_per_round": [e.get("bytes_received") or {} for e in history],
        "bytes_sent_after_rounds": sent_after,
        "bytes_received_after_rounds": received_after,
        "collaboration": (status or {}).get("collaboration"),
        **_peer_plane(status),
    }


def _peer_plane(status: dict[str, Any] | None) -> dict[str, Any]:
    """From the final status: membership's counters (suspicions, deaths declared and whose) and
    discovery's state (candidates, collaborators, view sizes): what bench/daemons_discovery.py
    reads after the daemons are gone."""
    m, d = (status or {}).get("membership"), (status or {}).get("discovery")
    out: dict[str, Any] = {}
    if isinstance(m, dict):
        keep = ("suspected", "refuted", "declared_dead", "deaths_recent", "probes", "indirect", "inconclusive")
        out["membership"] = {k: m[k] for k in keep if k in m}
    if isinstance(d, dict):
        out["discovery"] = d
    return out


def mixed_nothing(history: list[dict[str, Any]], node_id: str) -> bool | None:
    """True when no logged round gave any peer weight (None: no weights logged)."""
    rows = [e["weights"] for e in history if isinstance(e.get("weights"), dict)]
    if not rows:
        return None
    return not any(float(v or 0.0) > 0 for w in rows for k, v in w.items() if k != node_id)


def collaboration_notes(strategy: str, nodes: dict[str, dict[str, Any]]) -> list[str]:
    """Nodes that mixed nothing all run while their peers refused to release on privacy grounds,
    and nodes that ended backed off to their local-only reference (node/local_reference.py)."""
    out = []
    for nid, r in nodes.items():
        note = (r.get("collaboration") or {}).get("note")
        if r.get("mixed_nothing") and note:
            out.append(f"{strategy} {nid}: mixed nothing for the whole run: {note}")
        if (r.get("collaboration") or {}).get("helping") is False:  # backed off to its local model
            out.append(f"{strategy} {nid}: {r['collaboration'].get('reason')}")
    return out


def weight_matrices(node_ids: list[str], histories: dict[str, list[dict[str, Any]]], rounds: int) -> dict[str, Any]:
    by = {n: {e["round"]: e for e in histories.get(n, [])} for n in node_ids}
    last = max([rounds] + [r for n in node_ids for r in by[n]])
    rs = list(range(1, last + 1))
    mats = []
    for r in rs:
        rows = []
        for n in node_ids:
            e = by[n].get(r)
            w = (e or {}).get("weights")
            rows.append(None if not isinstance(w, dict) else [float(w.get(m, 0.0) or 0.0) for m in node_ids])
        mats.append(rows)
    return {"rounds": rs, "matrices": mats}


def final_weights(node_ids: list[str], histories: dict[str, list[dict[str, Any]]]) -> list[list[float] | None]:
    out = []
    for n in node_ids:
        h = [e for e in histories.get(n, []) if isinstance(e.get("weights"), dict)]
        out.append([float(h[-1]["weights"].get(m, 0.0) or 0.0) for m in node_ids] if h else None)
    return out


def mean_weights(matrices: list[list[list[float] | None]]) -> list[list[float] | None]:
    """Each node's weight row averaged over the rounds it logged: steadier than the last round
    for strategies that resample peers every round (FedFomo, FedeRiCo)."""
    if not matrices:
        return []
    n = len(matrices[0])
    out: list[list[float] | None] = []
    for i in range(n):
        rows = [r for m in matrices if (r := m[i]) is not None]
        out.append([sum(r[j] for r in rows) / len(rows) for j in range(n)] if rows else None)
    return out


def strategy_results(sc: Scenario, run: StrategyRun, clusters: list[int] | None) -> dict[str, Any]:
    ids = [s.node_id for s in run.specs]
    nodes = {}
    for i, s in enumerate(run.specs):
        r = node_results(run.histories.get(s.node_id, []), run.final_status.get(s.node_id))
        r["mixed_nothing"] = mixed_nothing(run.histories.get(s.node_id, []), s.node_id)
        info = run.node_info.get(s.node_id) or {}
        r.update(
            {
                "index": i,
                "true_cluster": clusters[i] if clusters else None,
                "address": info.get("address"),
                "admin_url": info.get("admin_url", s.admin_url),
                "pid": info.get("pid"),
            }
        )
        nodes[s.node_id] = r
    finals = [nodes[n]["final_test_acc"] for n in ids]
    have = [a for a in finals if a is not None]
    by_cluster: dict[str, float] = {}
    if clusters:
        for c in sorted(set(clusters)):
            accs = [a for a, k in zip(finals, clusters, strict=True) if k == c and a is not None]
            if accs:
                by_cluster[str(c)] = sum(accs) / len(accs)
    sent = sum(sum(nodes[n]["bytes_sent"].values()) for n in ids)
    recv = sum(sum(nodes[n]["bytes_received"].values()) for n in ids)
    return {
        "wall_time_s": round(run.wall_time_s, 3),
        "node_configs": {s.node_id: s.config.model_dump(mode="json") for s in run.specs},
        "nodes": nodes,
        "weights": (wm := weight_matrices(ids, run.histories, sc.rounds)),
        "final_weights": final_weights(ids, run.histories),
        "mean_weights": mean_weights(wm["matrices"]),
        "summary": {
            "mean_test_acc": sum(have) / len(have) if have else None,
            "min_test_acc": min(have) if have else None,
            "mean_test_acc_by_cluster": by_cluster,
            "bytes_sent_total": sent,
            "bytes_received_total": recv,
        },
        "notes": list(run.notes) + collaboration_notes(run.strategy, nodes),
        **({"placement": run.placement} if run.placement is not None else {}),
    }


def build_results(sc: Scenario, runs: list[StrategyRun], notes: list[str] | None = None) -> dict[str, Any]:
    notes = list(notes or [])
    clusters, why = true_clusters_of(runs[0]) if runs else (None, None)
    if why:
        notes.append(why)
    return json_safe(
        {
            "format": FORMAT,
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "scenario": sc.model_dump(mode="json"),
            "node_ids": [s.node_id for s in runs[0].specs] if runs else [],
            "true_clusters": clusters,
            **({"true_mixture": mix} if runs and (mix := true_mixture_of(runs[0])) is not None else {}),
            "strategies": {r.strategy: strategy_results(sc, r, clusters) for r in runs},
            "notes": notes,
        }
    )


def write_results(path: str | Path, results: dict[str, Any]) -> None:
    atomic_write_bytes(path, json.dumps(results, indent=1, allow_nan=False).encode())


# ------------------------------------------------------------------------------------ terminal
def _pct(v: float | None) -> str:
    return "–" if v is None else f"{100 * v:.1f}%"


def summary_table(results: dict[str, Any]):
    """Per-node final test accuracy, one column per strategy, means in the footer."""
    from rich.table import Table

    strategies = list(results["strategies"])
    ids = results["node_ids"]
    clusters = results.get("true_clusters")
    t = Table(title=f"{results['scenario'].get('name', 'scenario')}: final test accuracy per node", show_footer=True)
    t.add_column("node", footer="mean")
    t.add_column("cluster", justify="right", footer="")
    best_name = None
    means = {s: results["strategies"][s]["summary"]["mean_test_acc"] for s in strategies}
    if any(v is not None for v in means.values()):
        best_name = max((s for s in strategies if means[s] is not None), key=lambda s: means[s])
    for s in strategies:
        foot = _pct(means[s])
        t.add_column(s, justify="right", footer=f"[bold]{foot}[/]" if s == best_name else foot)
    for i, n in enumerate(ids):
        row = [n, "–" if not clusters else str(clusters[i])]
        for s in strategies:
            row.append(_pct(results["strategies"][s]["nodes"].get(n, {}).get("final_test_acc")))
        t.add_row(*row)
    return t


def run_table(results: dict[str, Any]):
    """One row per strategy: wall time, traffic, mean and worst accuracy."""
    from rich.table import Table

    t = Table(title="runs")
    for c in ("strategy", "wall time", "sent", "received", "mean acc", "min acc"):
        t.add_column(c, justify="left" if c == "strategy" else "right")
    for s, r in results["strategies"].items():
        sm = r["summary"]
        t.add_row(
            s,
            f"{r['wall_time_s']:.1f}s",
            _mb(sm["bytes_sent_total"]),
            _mb(sm["bytes_received_total"]),
            _pct(sm["mean_test_acc"]),
            _pct(sm["min_test_acc"]),
        )
    return t


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"


def _blue(w: float) -> str:
    w = min(1.0, max(0.0, w))
    r = int(245 - w * (245 - 8))
    g = int(245 - w * (245 - 69))
    b = int(245 - w * (245 - 148))
    return f"rgb({r},{g},{b})"


SHADES = " ░▒▓█"


def _matrix_and_order(results: dict[str, Any], strategy: str):
    from coterie.node import clusters as cl

    r = results["strategies"][strategy]
    mat = r.get("mean_weights") or r["final_weights"]
    return mat, cl.block_order(mat)


def heatmap(results: dict[str, Any], strategy: str):
    """The clusters the nodes found, at a glance: the peer-weight matrix of ``strategy`` (mean over
    rounds, row i = node i's weights) without its diagonal, rows and columns in block order
    (node/clusters.py), shaded on the peers' own scale (readable without colour); each node's
    self-weight in a column apart; and the true clusters in the same order next to it."""
    from rich.text import Text

    from coterie.node import clusters as cl

    ids = results["node_ids"]
    truth = results.get("true_clusters")
    mat, order = _matrix_and_order(results, strategy)
    off = cl.off_diagonal(mat)
    selfs = cl.diagonal(mat)
    finite = off[~np.isnan(off)] if off.size else off
    vmax = float(finite.max()) if finite.size and finite.max() > 0 else 1e-12
    label = lambda i: f"{ids[i]}" + (f" c{truth[i]}" if truth else "")  # noqa: E731
    width = max(len(label(i)) for i in range(len(ids)))
    txt = Text()
    mass = cl.in_block_mass(mat, truth) if truth else None
    txt.append(
        f"clusters found by {strategy}: peer weights, mean over rounds (row: node, column: "
        f"the peer it weights; diagonal apart; full block = {vmax:.2f})"
        + (f"; {100 * mass:.0f}% of the peer weight stays in the true cluster" if mass is not None else "")
        + "\n",
        style="bold",
    )
    head = "".join(f"{ids[j][-3:]:>3}" for j in order)
    txt.append(" " * (width + 1) + head + "   self" + ("   true clusters\n" if truth else "\n"))
    for i in order:
        txt.append(f"{label(i):>{width}} ")
        for j in order:
            v = off[i, j]
            if i == j:
                txt.append("  ·", style="dim")
            elif np.isnan(v):
                txt.append("  ?")
            else:
                x = max(0.0, min(1.0, v / vmax))
                txt.append(" ")
                txt.append(SHADES[round(x * (len(SHADES) - 1))] * 2, style=_blue(max(x, 0.15)))
        sv = selfs[i]
        txt.append(f"   {'  ?' if sv is None else f'{sv:.2f}'} ")
        if truth:
            txt.append("  ")
            for j in order:
                same = truth[i] == truth[j]
                txt.append(" ")
                txt.append("██" if same and i != j else ("··" if i == j else "  "), style="grey50" if same else "")
        txt.append("\n")
    return txt


# ----------------------------------------------------------------------------------------- PNG
def save_figures(results: dict[str, Any], out_dir: str | Path) -> list[Path]:
    """weights.png (per strategy: peer weights, mean over rounds, diagonal apart and in block order,
    next to the true clusters in the same order) and accuracy.png (test accuracy per round, one
    line per node, coloured by true cluster)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    ids = results["node_ids"]
    clusters = results.get("true_clusters") or [0] * len(ids)
    strategies = list(results["strategies"])
    paths = []

    from coterie.node import clusters as cl

    # per strategy: the learned peer weights (diagonal apart, block order), then the true clusters
    # in the same order: where the blocks match, the nodes found their clusters
    fig, axes = plt.subplots(
        1,
        2 * len(strategies),
        figsize=(4.0 * 2 * len(strategies), 4.2),
        squeeze=False,
        gridspec_kw={"width_ratios": [1.25, 1] * len(strategies)},
    )
    truth = results.get("true_clusters")
    for k, s in enumerate(strategies):
        mat, order = _matrix_and_order(results, s)
        ax = axes[0][2 * k]
        off = cl.off_diagonal(mat)[np.ix_(order, order)]
        # grey: the diagonal (self-weights) and nodes that reported nothing
        cmap = plt.get_cmap("Blues").with_extremes(bad="#e6e6e6")
        finite = off[np.isfinite(off)]
        vmax = float(finite.max()) if finite.size and finite.max() > 0 else 1.0
        im = ax.imshow(np.ma.masked_invalid(off), cmap=cmap, vmin=0, vmax=vmax, interpolation="nearest")
        ax.set_title(f"{s}: peer weights (no diagonal)", fontsize=9)
        labels = [f"{ids[i]} (c{clusters[i]})" for i in order]
        ax.set_xticks(range(len(ids)), [ids[i] for i in order], rotation=90, fontsize=7)
        ax.set_yticks(range(len(ids)), labels, fontsize=7)
        ax.set_xlabel("peer j")
        ax.set_ylabel("node i")
        fig.colorbar(im, ax=ax, fraction=0.046)
        ax = axes[0][2 * k + 1]
        if truth:
            same = np.array([[float(truth[i] == truth[j]) for j in order] for i in order])
            ax.imshow(same, cmap="Greys", vmin=0, vmax=1.6, interpolation="nearest")
            ax.set_title("true clusters (same order)", fontsize=9)
        else:
            ax.text(0.5, 0.5, "true clusters unknown", ha="center", va="center", transform=ax.transAxes)
        ax.set_xticks(range(len(ids)), [ids[i] for i in order], rotation=90, fontsize=7)
        ax.set_yticks([])
    fig.tight_layout()
    p = out / "weights.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)

    fig, axes = plt.subplots(1, len(strategies), figsize=(4.2 * len(strategies), 3.4), squeeze=False, sharey=True)
    cmap = plt.get_cmap("tab10")
    for ax, s in zip(axes[0], strategies, strict=True):
        for n, c in zip(ids, clusters, strict=True):
            r = results["strategies"][s]["nodes"].get(n) or {}
            xs = [x for x, a in zip(r.get("rounds", []), r.get("test_acc", []), strict=True) if a is not None]
            ys = [a for a in r.get("test_acc", []) if a is not None]
            ax.plot(xs, ys, color=cmap(c % 10), lw=1, alpha=0.8)
        ax.set_title(s)
        ax.set_xlabel("round")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("test accuracy")
    fig.tight_layout()
    p = out / "accuracy.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)
    return paths
