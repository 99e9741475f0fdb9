"""deploy/grafana/coterie.json queries only metrics a real node exports (names drift otherwise)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from coterie.node.config import validate_config
from coterie.node.daemon import Node

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "coterie.json"
SUFFIXES = {
    "counter": ["_total"],
    "histogram": ["_bucket", "_sum", "_count"],
    "info": ["_info"],
    "gauge": [""],
    "summary": ["_sum", "_count", ""],
}
PROMQL_WORDS = {
    "sum",
    "by",
    "rate",
    "increase",
    "avg",
    "min",
    "max",
    "count",
    "histogram_quantile",
    "le",
    "kind",
    "side",
    "state",
    "instance",
    "job",
    "up",
    "label_values",
}


def exported_samples(tmp_path) -> set[str]:
    cfg = validate_config(
        {
            "node_id": "g",
            "security": {"insecure": True},
            "state_dir": str(tmp_path / "g"),
            "learner": {
                "dataset": "mnist1d",
                "dataset_params": {"num_samples": 600},
                "partition": "iid",
                "model": "linear",
            },
        }
    )
    node = Node(cfg)
    names = set()
    for family in node.metrics.registry.collect():
        names.update(family.name + s for s in SUFFIXES[family.type])
    return names


def test_every_panel_queries_exported_metrics(tmp_path):
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 15
    used = {m for e in exprs for m in re.findall(r"\b([a-z_][a-z0-9_]*)\s*[{\[]", e)} - PROMQL_WORDS
    exported = exported_samples(tmp_path)
    assert used and used <= exported, f"not exported by a node: {sorted(used - exported)}"
    assert {
        "coterie_test_accuracy_ratio",
        "coterie_sent_bytes_total",
        "coterie_round_duration_seconds_bucket",
        "process_resident_memory_bytes",
    } <= used
