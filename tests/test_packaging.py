"""The `coterie` package as a regular wheel installs it (not only the editable install the tests
run on): sdk/ becomes `coterie` with load_model, node/ cli/ proto/ its subpackages."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_installs_the_coterie_package(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", str(REPO), "-w", str(wheels)],
        check=True,
        timeout=600,
        cwd=tmp_path,
    )
    (wheel,) = wheels.glob("coterie-*.whl")
    venv = tmp_path / "venv"  # the dependencies (torch, ...) come from this interpreter's site-packages
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", str(wheel)], check=True, timeout=300)
    out = subprocess.run(
        [
            str(py),
            "-c",
            "import sys, coterie, coterie.node, coterie.cli.main, coterie.proto.v1.peer_pb2\n"
            "assert 'torch' not in sys.modules, 'import coterie must stay cheap'\n"
            "print(coterie.__file__); print(coterie.node.__file__); print(coterie.load_model.__module__)",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    pkg, node, module = out.stdout.split()
    site = str(venv)
    assert pkg.startswith(site) and node.startswith(site), out.stdout  # the wheel's, not the checkout's
    assert module == "coterie.node.modelfile"
