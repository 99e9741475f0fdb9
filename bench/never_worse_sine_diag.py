"""Why COBO and L2C end worse than their local-only twins on sine-adam (issue 33; helper nwsine).

Runs cells of (strategy, strategy overrides, rounds) on a sine network, seeds x repeats, one run
after another in this process (the lab inproc backend, as ``never_worse.py one``), and appends one
JSON line per run to ``--out``: the full scenario config, every node's audit gains (collaborative
and reported model against its twin, 2,000 fresh samples) and what the strategy learnt about its
peers at the end — COBO: the pair weights W and the last cross-gradient inner products, split into
same-interval and other-interval peers; L2C: α and the neighbours kept at pruning.

    python bench/never_worse_sine_diag.py --network sine-adam --seeds 0,1,2 --repeats 3 \
        --cell cobo --cell l2c --cell 'l2c:rounds=30' --cell 'l2c:prune_round=3' \
        --out bench/results/never_worse_sine_diag.jsonl

A cell is ``strategy[:key=value,...]``; ``rounds`` sets the run's rounds, every other key is a
strategy parameter (JSON values), except ``ref.KEY``: the node's ``reference`` setting KEY
(e.g. ``ref.settle_after=0``), and ``probe.adam_reset=true`` (``adam_reset_after_merge``). ``python bench/never_worse_sine_diag.py report FILE``: the table.
``--network`` takes several networks (comma-separated), interleaved with the seeds.
``python bench/never_worse_sine_diag.py paired FILE BASE_CELL NEW_CELL``: the two cells' run-by-run
differences (e.g. ``cobo:total_steps=40000`` = main's pinned warm phase against ``cobo``).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import never_worse as nw  # noqa: E402


def parse_cell(text: str) -> tuple[str, dict[str, Any], int, dict[str, Any]]:
    strategy, _, rest = text.partition(":")
    params: dict[str, Any] = {}
    ref: dict[str, Any] = {}
    rounds = nw.ROUNDS
    for kv in filter(None, rest.split(",")):
        k, sep, v = kv.partition("=")
        if not sep:
            raise SystemExit(f"cell {text!r}: {kv!r} is not key=value")
        val = json.loads(v)
        if k == "rounds":
            rounds = int(val)
        elif k.startswith("ref."):
            ref[k[4:]] = val
        elif k == "probe.adam_reset":
            ref["_adam_reset"] = bool(val)
        else:
            params[k] = val
    return strategy, params, rounds, ref


def _mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def peer_summary(strategy: str, ps: dict[str, Any], me: str, cluster: dict[str, int]) -> dict[str, Any]:
    """Same-interval against other-interval peers in what the strategy learnt."""
    same = [p for p in cluster if p != me and cluster[p] == cluster[me]]
    other = [p for p in cluster if cluster[p] != cluster[me]]
    out: dict[str, Any] = {}
    if strategy == "cobo":
        w, ip = ps.get("W", {}), ps.get("last_inner_product", {})
        out["W_same"] = _mean([w[p] for p in same if p in w])
        out["W_other"] = _mean([w[p] for p in other if p in w])
        out["ip_same"] = _mean([ip[p] for p in same if p in ip])
        out["ip_other"] = _mean([ip[p] for p in other if p in ip])
        out["total_steps"] = ps.get("total_steps")  # the run its warm phase was a share of
    elif strategy in ("l2c", "meta-l2c"):
        a = ps.get("alpha") or {}
        out["alpha_self"] = a.get(me)
        out["alpha_same"] = _mean([a[p] for p in same if p in a])
        out["alpha_other"] = _mean([a[p] for p in other if p in a])
        kept = ps.get("kept")
        out["kept_same"] = None if kept is None else sum(1 for p in kept if p in same)
        out["kept_other"] = None if kept is None else sum(1 for p in kept if p in other)
    return out


@contextlib.contextmanager
def adam_reset_after_merge(on: bool) -> Iterator[None]:
    """Probe (this process only): L2C's learner forgets its Adam moments right after each merge
    (θ ← θ − Σ w Δθ), so the moments of its own last steps do not steer the steps from the
    merged model — issue 33's "Adam moments carried across a merge" suspect."""
    if not on:
        yield
        return
    from coterie.node.strategies.l2c import L2C

    orig = L2C._weights_and_learn

    async def patched(self: Any, *a: Any, **kw: Any) -> Any:
        w = await orig(self, *a, **kw)
        self.learner.drop_optimizer_state()
        return w

    L2C._weights_and_learn = patched  # type: ignore[method-assign]
    try:
        yield
    finally:
        L2C._weights_and_learn = orig  # type: ignore[method-assign]


def one_run(
    network: str, strategy: str, params: dict[str, Any], rounds: int, seed: int, ref: dict[str, Any]
) -> dict[str, Any]:
    from coterie.lab.audit import audit_sets
    from coterie.lab.launch import run_scenario

    nw.ROUNDS = rounds  # _made and scenario read it at call time
    ref = dict(ref)
    adam_reset = ref.pop("_adam_reset", False)
    sc = nw.scenario(network, strategy, seed, reference=ref)
    sc.strategy_params.setdefault(strategy, {}).update(params)
    sets = audit_sets(nw.network_learner(sc), nw.AUDIT_SIZE)
    audit: dict[str, dict[str, Any]] = {}
    public: dict[str, dict[str, Any]] = {}

    def done(nodes: list[Any]) -> None:
        audit.update(nw.audit_figures(nodes, sets))
        public.update({n.node_id: n.strategy.public_state() for n in nodes})

    t0 = time.time()
    with adam_reset_after_merge(adam_reset), tempfile.TemporaryDirectory(prefix="nwdiag-") as out:
        res = run_scenario(sc, Path(out), backend="inproc", check=False, on_done=done)
    nodes = res["strategies"][strategy]["nodes"]
    cluster = {nid: int(n["true_cluster"]) for nid, n in nodes.items()}
    per_node = {}
    for nid, n in nodes.items():
        fig = nw.node_figures(n)
        fig.update(audit.get(nid, {}))
        fig.update(peer_summary(strategy, public.get(nid, {}), nid, cluster))
        fig.pop("helping_rounds", None)
        per_node[nid] = fig
    collab = [f["audit_collab_gain"] for f in per_node.values() if f.get("audit_collab_gain") is not None]
    rep = [f["audit_reported_gain"] for f in per_node.values() if f.get("audit_reported_gain") is not None]
    return {
        "network": network,
        "strategy": strategy,
        "params": params,
        "reference": ref,
        "rounds": rounds,
        "seed": seed,
        "wall_s": round(time.time() - t0, 1),
        "collab_worst": min(collab) if collab else None,
        "collab_mean": _mean(collab),
        "reported_worst": min(rep) if rep else None,
        "reported_mean": _mean(rep),
        "nodes": per_node,
        "config": nw.NETWORKS[network][0](),
    }


def _cell(xs: list[float]) -> str:
    xs = [x for x in xs if x is not None]
    if not xs:
        return "–"
    return f"{statistics.median(xs):+.1f} [{min(xs):+.1f}, {max(xs):+.1f}]"


def report(path: Path) -> None:
    """Per (network, cell): medians [min, max] over the runs of the worst node's and the mean
    node's audit gains; what the strategy learnt about its peers (medians over nodes and runs);
    and, of the nodes whose collaborative model is > 20 % worse on the audit set, how many the
    back-off caught (predicting with the twin at the end)."""
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for r in rows:  # one invocation's cells side by side: the tag tells invocations apart
        groups.setdefault((r["network"], r["cell"], r.get("tag", "")), []).append(r)
    print(
        "| network | cell | tag | runs | collab worst | collab mean | reported worst | reported mean "
        "| peers learnt (median) | collab < -20 %: backed off |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (net, cell, tag), rs in groups.items():
        nodes = [n for r in rs for n in r["nodes"].values()]
        learnt = []
        for k in ("W_same", "W_other", "ip_same", "ip_other", "alpha_self", "alpha_same", "alpha_other", "kept_other"):
            vals = [n[k] for n in nodes if n.get(k) is not None]
            if vals:
                learnt.append(f"{k} {statistics.median(vals):+.2f}")
        bad = [n for n in nodes if (n.get("audit_collab_gain") or 0) < -20]
        caught = sum(1 for n in bad if n.get("helping") is False)
        print(
            f"| {net} | `{cell}` | {tag} | {len(rs)} | {_cell([r['collab_worst'] for r in rs])} "
            f"| {_cell([r['collab_mean'] for r in rs])} | {_cell([r['reported_worst'] for r in rs])} "
            f"| {_cell([r['reported_mean'] for r in rs])} | {', '.join(learnt) or '–'} | {caught} of {len(bad)} |"
        )
    print("\nNot caught (collaborative model > 20 % worse on the audit set, still collaborating at the end):")
    for (net, cell, _), rs in groups.items():
        for r in rs:
            for nid, n in sorted(r["nodes"].items()):
                if (n.get("audit_collab_gain") or 0) < -20 and n.get("helping") is not False and n.get("val_twin"):
                    rel = 100 * (n["val_collab"] - n["val_twin"]) / n["val_twin"]
                    print(
                        f"- {net} `{cell}` seed {r['seed']} rep {r['repeat']} {nid}: audit "
                        f"{n['audit_collab_gain']:+.1f} ± {n['audit_collab_se']:.1f}; last validation check "
                        f"{rel:+.1f} % MSE vs the twin (n = {n['val_n']})"
                    )


def paired(path: Path, base: str, new: str) -> None:
    """``new`` minus ``base`` run by run: the two cells' runs of one invocation matched on
    (network, tag, seed, repeat), ran one after the other; median [min, max] of the differences
    and on how many runs ``new`` was better (+ = ``new`` better, in the audit gain's units)."""
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    by = {(r["network"], r.get("tag", ""), r["seed"], r["repeat"], r["cell"]): r for r in rows}
    keys = ("collab_worst", "collab_mean", "reported_worst", "reported_mean")
    diffs: dict[str, dict[str, list[float]]] = {}
    for (net, tag, seed, rep, cell), r in by.items():
        other = by.get((net, tag, seed, rep, base))
        if cell != new or other is None:
            continue
        for k in keys:
            if r[k] is not None and other[k] is not None:
                diffs.setdefault(net, {}).setdefault(k, []).append(r[k] - other[k])
    print(f"`{new}` − `{base}`, run by run (+ = `{new}` better): median [min, max] (better in / runs)\n")
    print("| network | runs | " + " | ".join(keys) + " |")
    print("|---|---|" + "---|" * len(keys))
    for net, d in diffs.items():
        cells = [f"{_cell(d[k])} ({sum(x > 0 for x in d[k])}/{len(d[k])})" for k in keys]
        print(f"| {net} | {len(d[keys[0]])} | " + " | ".join(cells) + " |")


def main() -> None:
    if sys.argv[1:2] == ["report"]:
        report(Path(sys.argv[2]))
        return
    if sys.argv[1:2] == ["paired"]:
        paired(Path(sys.argv[2]), sys.argv[3], sys.argv[4])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--network", default="sine-adam", help=f"one or more (comma-separated) of {sorted(nw.NETWORKS)}")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cell", action="append", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tag", default="", help="written into every line (e.g. the checkout)")
    a = ap.parse_args()
    cells = [parse_cell(c) for c in a.cell]
    networks = a.network.split(",")
    if unknown := sorted(set(networks) - set(nw.NETWORKS)):
        raise SystemExit(f"--network: unknown {unknown}; known: {sorted(nw.NETWORKS)}")
    out = Path(a.out)
    # repeat-major, cells interleaved: a drift in the machine's load hits every cell alike
    for rep, seed, network in itertools.product(range(a.repeats), (int(s) for s in a.seeds.split(",")), networks):
        for (strategy, params, rounds, ref), text in zip(cells, a.cell, strict=True):
            line = one_run(network, strategy, params, rounds, seed, ref)
            line.update({"cell": text, "repeat": rep, "tag": a.tag})
            with out.open("a") as f:
                f.write(json.dumps(line, default=str) + "\n")
            print(
                f"{network} {text} seed {seed} rep {rep}: collab worst {line['collab_worst']:+.1f} "
                f"mean {line['collab_mean']:+.1f} | reported worst {line['reported_worst']:+.1f} "
                f"mean {line['reported_mean']:+.1f} ({line['wall_s']} s)",
                flush=True,
            )


if __name__ == "__main__":
    main()
