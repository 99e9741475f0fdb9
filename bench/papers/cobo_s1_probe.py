"""COBO probe at S1's budget (issue 23.2 diagnostics): like cobo_s1_budget.py, but records rounds
1, 2, 3 and every 5th — accuracy, in-cluster share, raw W within/across clusters, the mean last pair
inner products within/across clusters and the share of positive cross-cluster ones. ``--oracle_w``
holds W at the true cluster matrix (pass γ = 0): the consensus term's ceiling, and the inner
products of clusters whose models drift apart. Prints one JSON line per record.

    python bench/papers/cobo_s1_probe.py --params '{"gamma": 0.0}' --oracle_w --tag oracleW
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import numpy as np
from cobo_fig3 import LEARNER
from inproc import build
from strategy_harness import run_rounds

ap = argparse.ArgumentParser()
ap.add_argument("--seed", type=int, default=0)
ap.add_argument("--rounds", type=int, default=30)
ap.add_argument("--params", default="{}")
ap.add_argument("--learner", default="{}")
ap.add_argument("--oracle_w", action="store_true")
ap.add_argument("--tag", default="")
a = ap.parse_args()
params = {"local_steps": 20, "optimizer": "sgd", **json.loads(a.params)}  # the paper's step, as the recorded probes
hub = build("cobo", params, {**LEARNER, **json.loads(a.learner)}, 12, a.seed)
ids = list(hub.nodes)
cl = {n: hub.nodes[n].cluster for n in ids}
if a.oracle_w:
    for n in ids:
        hub.nodes[n].strategy._w = {p: (1.0 if cl[p] == cl[n] else 0.0) for p in ids if p != n}
t0 = time.time()
for r in range(1, a.rounds + 1):
    asyncio.run(run_rounds(hub, 1, start=r, synchronous=True))
    if r % 5 == 0 or r in (1, 2, 3):
        acc = float(np.mean([hub.nodes[n].strategy.evaluate()["test_acc"] for n in ids]))
        win, wcr, ipi, ipc, share = [], [], [], [], []
        for n in ids:
            st = hub.nodes[n].strategy.public_state()
            for p, v in st["W"].items():
                (win if cl[p] == cl[n] else wcr).append(v)
            for p, v in st["last_inner_product"].items():
                (ipi if cl[p] == cl[n] else ipc).append(v)
            w = hub.nodes[n].strategy.weights()
            tot = sum(v for p, v in w.items() if p != n)
            share.append(sum(v for p, v in w.items() if p != n and cl[p] == cl[n]) / tot if tot else 2 / 11)
        print(
            json.dumps(
                {
                    "tag": a.tag,
                    "r": r,
                    "acc": round(acc, 4),
                    "share": round(float(np.mean(share)), 3),
                    "Win": round(float(np.mean(win)), 3),
                    "Wcr": round(float(np.mean(wcr)), 3),
                    "ipi": round(float(np.mean(ipi)), 2) if ipi else None,
                    "ipc": round(float(np.mean(ipc)), 2) if ipc else None,
                    "ipc_pos": round(float(np.mean(np.array(ipc) > 0)), 2) if ipc else None,
                    "t": round(time.time() - t0),
                }
            ),
            flush=True,
        )
