#!/usr/bin/env bash
# Regenerate the committed Python stubs from proto/coterie/v1/*.proto (needs grpcio-tools).
# Stubs land in proto/v1/ with package-relative imports, importable as coterie.proto.v1.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-$here/v1}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python -m grpc_tools.protoc -I "$here" --python_out="$tmp" --pyi_out="$tmp" --grpc_python_out="$tmp" \
  "$here"/coterie/v1/*.proto
mkdir -p "$out"
for f in "$tmp"/coterie/v1/*; do
  # protoc writes absolute imports (from coterie.v1 import x); make them package-relative
  sed -E 's/^from coterie\.v1 import /from . import /' "$f" > "$out/$(basename "$f")"
done
[ -f "$out/__init__.py" ] || touch "$out/__init__.py"
