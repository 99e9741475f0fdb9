"""Collect the paper reproductions (bench/results/papers_*.json) into bench/results/papers.md.

    python bench/papers/collect.py

Each reproduction is a script in bench/papers/ with a ``--seed``; it writes its full config and
results to bench/results/papers_<name>.json and prints "paper says / we get". This renders them
in one page, with each script's own description of the setting.
"""
from __future__ import annotations

import ast
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE.parents[1] / "bench" / "results"
ORDER = ["federico_fig1", "cobo_fig3", "l2c_fig4", "scool_fig6a", "fedfomo_fig2"]


def doc(name: str) -> str:
    src = (HERE / f"{name}.py").read_text()
    text = ast.get_docstring(ast.parse(src)) or ""
    return text.split("\n\n    python")[0].strip()


def main() -> None:
    lines = ["# The papers' claims, reproduced", "",
             "One script per paper in `bench/papers/` (scaled to a 2-core CPU box; every script takes "
             "`--seed` and writes its config and results to `bench/results/papers_<name>.json`). All run "
             "in-process: real `TorchLearner`s on real partitions with the strategies' code, peer calls "
             "through the strategy test harness's network (`tests/strategy_harness.py`), not gRPC. "
             "Regenerate this page with `python bench/papers/collect.py`.", ""]
    for name in ORDER:
        path = RESULTS / f"papers_{name}.json"
        if not path.exists():
            lines += [f"## {name}", "", "_not run yet_", ""]
            continue
        r = json.loads(path.read_text())
        cfg = r["config"]
        lines += [f"## {name}", "", doc(name), "",
                  f"Run: `python bench/papers/{name}.py --seed {cfg.get('seed')}` — {r['wall_s']:.0f} s wall "
                  f"({cfg.get('harness', 'in-process')}).", "",
                  "| paper says | we get |", "|---|---|"]
        for c in r["claims"]:
            lines.append(f"| {c['paper']} | {c['we']} |")
        lines.append("")
    (RESULTS / "papers.md").write_text("\n".join(lines))
    print("wrote", RESULTS / "papers.md")


if __name__ == "__main__":
    main()
