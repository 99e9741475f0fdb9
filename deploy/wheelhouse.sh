#!/usr/bin/env bash
# Fill deploy/wheels/ (gitignored build context) with wheels for every runtime dependency of
# the project, so the image installs offline (`pip install --no-index`) and never downloads torch:
# torch==2.13.0 comes from this host's local wheel store (pip's find-links, e.g. /opt/wheels).
# Incremental: pip reuses wheels already in the folder. Uses the host's python3/pip, which must be
# the same Python minor (3.11) and platform as the image's.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=deploy/wheels
mkdir -p "$OUT"
PY="${PYTHON:-python3}"

REQ="$(mktemp)"; trap 'rm -f "$REQ"' EXIT
"$PY" - >"$REQ" <<'EOF'
import tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
print("\n".join(deps + ["setuptools>=68", "wheel"]))
EOF

t0=$(date +%s)
# --find-links $OUT first: an already-present wheel satisfies the requirement with no network.
"$PY" -m pip wheel --quiet --wheel-dir "$OUT" --find-links "$OUT" -r "$REQ"
n=$(ls "$OUT"/*.whl | wc -l)
echo "wheelhouse: $n wheels in $OUT ($(du -sh "$OUT" | cut -f1)) in $(( $(date +%s) - t0 ))s"
if ! ls "$OUT"/torch-*+cpu-*.whl >/dev/null 2>&1; then
    echo "wheelhouse: WARNING: no CPU torch wheel in $OUT (is pip's find-links pointing at the local store?)" >&2
fi
