#!/usr/bin/env bash
# Regenerate the Python code of the gRPC contracts from protos/dspark/v1/*.proto.
#   bash scripts/gen_protos.sh             # writes dspark/protos/dspark/v1/ (checked in)
#   bash scripts/gen_protos.sh OUT_DIR     # writes OUT_DIR/dspark/v1/ instead (the CI sync test)
# Output is deterministic for a given grpcio-tools version, so it is pinned (pyproject, test
# extra) and checked here. protoc writes `from dspark.v1 import common_pb2`; the sed below
# rewrites those imports to `dspark.protos.dspark.v1` so the code imports as part of the
# package without sys.path tricks, while descriptors keep their proto names
# (dspark/v1/common.proto, package dspark.v1) for reflection and other languages.
set -euo pipefail
GRPCIO_TOOLS_VERSION="1.85.1"
root="$(cd "$(dirname "$0")/.." && pwd)"
out="$(mkdir -p "${1:-$root/dspark/protos}" && cd "${1:-$root/dspark/protos}" && pwd)"
python="${PYTHON:-python}"

have="$("$python" -c 'import importlib.metadata as m; print(m.version("grpcio-tools"))' 2>/dev/null || true)"
if [[ "$have" != "$GRPCIO_TOOLS_VERSION" ]]; then
  echo "gen_protos.sh: need grpcio-tools==$GRPCIO_TOOLS_VERSION (found '${have:-none}'): pip install -e '.[test]'" >&2
  exit 1
fi

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
cd "$root/protos"
protos=(dspark/v1/*.proto)  # glob order is sorted: deterministic
"$python" -m grpc_tools.protoc -I . \
  --python_out="$tmp" --pyi_out="$tmp" --grpc_python_out="$tmp" "${protos[@]}"
sed -i -E 's/^from dspark\.v1 import /from dspark.protos.dspark.v1 import /' "$tmp"/dspark/v1/*.py "$tmp"/dspark/v1/*.pyi
: > "$tmp/dspark/__init__.py"
: > "$tmp/dspark/v1/__init__.py"

rm -rf "$out/dspark"
mkdir -p "$out"
cp -r "$tmp/dspark" "$out/dspark"
