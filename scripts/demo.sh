#!/usr/bin/env bash
# The demo from a fresh clone: installs (idempotent), builds the tiny Qwen2.5-VL checkpoint if
# missing, starts encoder, prefill, decode and gateway on loopback, streams one request with the
# media the model takes (an image and a clip for Qwen2.5-VL) through the gateway, and stops
# everything.
# Extra arguments go to `epd up`.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-cpu.sh
exec .venv/bin/epd up --demo "$@"
