#!/usr/bin/env bash
# Runs the whole test suite from a fresh clone: installs (idempotent), checks the contract,
# then pytest. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-cpu.sh
PY=.venv/bin/python
echo "[test] buf lint + buf format (protos/)"
.venv/bin/buf lint protos
.venv/bin/buf format -d --exit-code protos
echo "[test] buf breaking against the recorded baseline (protos/README.md)"
.venv/bin/buf breaking protos --against protos/baseline/epd-v1.binpb
echo "[test] client SDKs: generate, then compile and type-check each (Python, TypeScript, Go)"
./scripts/gen_sdks.sh --check
echo "[test] kubectl, to render deploy/ with kustomize in tests/test_deploy.py (offline)"
if ! command -v kubectl >/dev/null; then
  SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends kubernetes-client >/dev/null
fi
echo "[test] ruff"
.venv/bin/ruff check .
echo "[test] pytest"
# -X faulthandler: a crash after the last test (interpreter exit) still prints every thread's stack.
exec "$PY" -X faulthandler -m pytest -ra "$@"
