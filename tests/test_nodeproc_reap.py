"""The test harness stops what a test launched, however the test ended (tests/conftest.py)."""

from __future__ import annotations

import subprocess
import sys

from tests.nodeproc import NodeProc


def _running(tmp_path, node_id: str) -> NodeProc:
    n = NodeProc(tmp_path, node_id, {"strategy": "local"})
    n.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # a daemon stand-in
    return n


def test_reap_stops_what_was_made_since_the_mark_and_leaves_older_ones(tmp_path):
    older = _running(tmp_path, "module-fixture")  # made before the test's mark: not the test's
    try:
        since = len(NodeProc.made)
        mine, done = _running(tmp_path, "left-running"), _running(tmp_path, "stopped")
        done.stop()
        assert NodeProc.reap(since) == ["left-running"]
        assert mine.proc.poll() is not None and older.proc.poll() is None
        assert NodeProc.made[-1] is older
    finally:
        older.stop()
