#!/usr/bin/env bash
# Runs the benchmark suite: the CPU install (idempotent), the plotting extra, then
# `python -m bench` with every flag passed through (see `python -m bench --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-cpu.sh
.venv/bin/python -m pip install --disable-pip-version-check -q -e ".[dev,bench]"
exec .venv/bin/python -m bench "$@"
