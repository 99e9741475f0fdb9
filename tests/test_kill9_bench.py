"""bench/kill9.py in small: real daemons killed with SIGKILL at random moments resume exactly
(the full run, 36 kills, is the benchmark; its figures are in bench/results/kill9.json)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

# the bench runs up to 600 s (its own limit, which fails with its output); the default per-test limit is 300 s
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
BENCH = Path(__file__).resolve().parent.parent / "bench" / "kill9.py"


def test_random_kills_resume_at_the_last_checkpoint_with_its_exact_weights(tmp_path):
    out = tmp_path / "kill9.json"
    r = subprocess.run(
        [
            sys.executable,
            str(BENCH),
            "--kills",
            "4",
            "--max-wait",
            "1.5",
            "--seed",
            "3",
            "--out",
            str(out),
            "--workdir",
            str(tmp_path / "work"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    result = json.loads(out.read_text())
    assert result["survivors"] == 4, r.stdout + r.stderr
    assert result["exact_continuation"] and result["rounds_compared"] >= 3, r.stdout
    assert any(t["checkpoint_round"] > 0 and t["phase"] == "running" for t in result["trials"]), r.stdout
    assert r.returncode == 0
