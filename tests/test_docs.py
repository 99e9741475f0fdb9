"""The README stays a front page and CI runs what it says; the documentation site builds."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def _setup_block() -> list[str]:
    """The commands (not comments) of the README's first code block."""
    block = re.search(r"```bash\n(.*?)```", README.read_text(), re.S)
    assert block, "README.md has no bash block"
    return [ln for ln in block.group(1).splitlines() if ln.strip() and not ln.lstrip().startswith("#")]


def test_readme_is_short_and_opens_with_exactly_two_setup_commands():
    text = README.read_text()
    assert len(text.splitlines()) <= 300
    first_screen = "\n".join(text.splitlines()[:40])
    assert "```bash" in first_screen, "the set-up commands are not on the first screen"
    demo, tests = _setup_block()
    assert demo.startswith("python3 -m pip install ") and demo.endswith("&& coterie demo"), demo
    assert tests.startswith("python3 -m pip install ") and "&& python3 -m pytest" in tests, tests
    assert "## Your own data" in text


def test_ci_runs_the_readme_test_command_verbatim():
    """.ci/run reads its test command out of the README: run that line of .ci/run and compare."""
    ci = (ROOT / ".ci" / "run").read_text()
    line = next(ln for ln in ci.splitlines() if ln.startswith("test_cmd=$("))
    got = subprocess.run(
        ["bash", "-c", f'{line}; printf %s "$test_cmd"'], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    assert got == _setup_block()[1]
    assert 'bash -c "$test_cmd"' in ci


def test_the_docs_site_builds_in_strict_mode(tmp_path):
    pytest.importorskip("mkdocs", reason="the docs extra is not installed: pip install -e '.[docs]'")
    r = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "site" / "index.html").exists() and (tmp_path / "site" / "dashboard.png").exists()
