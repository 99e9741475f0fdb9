"""Peak memory over a call, in a fresh interpreter: what a test of a round's transients reads.

``run_peak_probe(body, *args)`` runs ``body`` after a prologue that defines ``peak_over(fn)``: the
bytes the peak RSS (``VmHWM``, reset through ``/proc/self/clear_refs``) rose over ``fn()`` above
the RSS before it, ``fn``'s result still alive at the reading. Tensors of the sizes these tests
use are mapped and given back when freed, so the peak is what was alive at once. Skips where the
kernel offers no ``clear_refs``."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

PROLOGUE = r"""
import re


def rss_and_peak():
    status = open("/proc/self/status").read()
    return [int(re.search(k + r":\s+(\d+) kB", status).group(1)) * 1024 for k in ("VmRSS", "VmHWM")]


def peak_over(fn):
    open("/proc/self/clear_refs", "w").write("5")  # the peak RSS starts again from here
    rss, _ = rss_and_peak()
    out = fn()
    _, peak = rss_and_peak()
    del out
    return peak - rss
"""


def run_peak_probe(body: str, *args: str) -> str:
    """``body``'s standard output (stripped), run under the prologue with ``args`` as ``sys.argv[1:]``."""
    try:
        open("/proc/self/clear_refs", "w").close()
    except OSError:
        pytest.skip("no /proc/self/clear_refs to reset the peak RSS")
    script = PROLOGUE + textwrap.dedent(body)
    r = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()
