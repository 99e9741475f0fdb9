"""Shared test fixtures."""

from __future__ import annotations

import pytest

from tests.nodeproc import NodeProc


@pytest.fixture(autouse=True)
def _no_daemon_outlives_its_test():
    """Every daemon of a NodeProc a test made (in its body or its function-scoped fixtures) is
    stopped when the test ends, however it ended: a failure between starting daemons and the
    ``try`` that stops them once left two running for an hour, loading every later test. A
    module's fixtures are set up before this runs, so their daemons are not the test's."""
    since = len(NodeProc.made)
    yield
    NodeProc.reap(since)
