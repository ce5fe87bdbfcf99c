#!/usr/bin/env bash
# Regenerates the committed gRPC code from proto/tokenpipe/v1/chat.proto (needs grpcio-tools,
# in the dev extra). Output goes to src/tokenpipe/front/grpc_gen with a package-relative import.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
out=src/tokenpipe/front/grpc_gen
mkdir -p "$out"
"$PY" -m grpc_tools.protoc -I proto/tokenpipe/v1 --python_out="$out" --pyi_out="$out" \
  --grpc_python_out="$out" proto/tokenpipe/v1/chat.proto
sed -i 's/^import chat_pb2 as chat__pb2$/from tokenpipe.front.grpc_gen import chat_pb2 as chat__pb2/' \
  "$out/chat_pb2_grpc.py"
printf '"""Generated from proto/tokenpipe/v1/chat.proto by scripts/gen_proto.sh. Do not edit."""\n' \
  > "$out/__init__.py"
