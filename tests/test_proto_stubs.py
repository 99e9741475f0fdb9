"""The committed stubs in proto/v1 must be what proto/generate.sh makes from the .proto today."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_generated_stubs_are_fresh(tmp_path):
    subprocess.run(["bash", str(ROOT / "proto" / "generate.sh"), str(tmp_path)], check=True)
    for name in [
        f"{proto}{suffix}" for proto in ("peer", "relay") for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
    ]:
        fresh = (tmp_path / name).read_text()
        committed = (ROOT / "proto" / "v1" / name).read_text()
        assert fresh == committed, f"proto/v1/{name} is stale: run proto/generate.sh and commit"
