#!/usr/bin/env bash
# Regenerates the Python code of proto/*.proto into mtc/proto/ (the only way it is
# made). tests/test_proto_current.py fails when the checked-in code is stale.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-mtc/proto}
PY=${PYTHON:-.venv/bin/python}
mkdir -p "$OUT"
"$PY" -m grpc_tools.protoc -Iproto --python_out="$OUT" --pyi_out="$OUT" \
  --grpc_python_out="$OUT" proto/*.proto
# protoc writes top-level imports; make them package-relative to mtc.proto.
sed -i -E 's/^import ([a-z_]+_pb2) as /from mtc.proto import \1 as /' "$OUT"/*_pb2_grpc.py
touch "$OUT/__init__.py"
