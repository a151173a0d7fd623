#!/usr/bin/env bash
# The first GPU host EPD is lent measures, in one short run, the figures that a 2-core CPU host
# can only bound (BENCHMARKS.md, "What a GPU host changes"): the embedding handoff, the encoder's
# time to ready and throughput, and E/P/D against monolithic serving. Each runs in its quick form
# (minutes in all) into bench/results-gpu, which gets its own BENCHMARKS.md.
#
#   bench/gpu_check.sh             on a GPU host set up as README "GPU hosts" says
#   bench/gpu_check.sh --dry-run   anywhere: checks what it can and prints what it would run
#
# EPD has not yet run on CUDA: a failure here is a finding to file, not a broken script.
set -euo pipefail
cd "$(dirname "$0")/.."

DRY_RUN=0
RESULTS_DIR=bench/results-gpu
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY_RUN=1 ;;
    --results-dir=*) RESULTS_DIR="${arg#--results-dir=}" ;;
    -h | --help) sed -n '2,10p' "$0"; exit 0 ;;
    *) echo "gpu_check: unknown argument $arg (see --help)" >&2; exit 2 ;;
  esac
done
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3

# The experiments the suite's registry gives a GPU note (bench/common.py), each with what to
# measure there; the notes also close BENCHMARKS.md.
ONLY=$("$PY" -c "from bench.common import EXPERIMENTS; print(','.join(n for n, e in EXPERIMENTS.items() if e.gpu_note))")
"$PY" -c "from bench.common import EXPERIMENTS; print('\n'.join(f'[gpu_check] {n}: {e.gpu_note}' for n, e in EXPERIMENTS.items() if e.gpu_note))"

if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | sed 's/^/[gpu_check] GPU: /'
elif [ "$DRY_RUN" = 1 ]; then
  echo "[gpu_check] no nvidia-smi here (dry run: fine)"
else
  echo "[gpu_check] no nvidia-smi: this is not a GPU host (use --dry-run to check the script)" >&2
  exit 1
fi

if [ "$DRY_RUN" = 0 ]; then
  "$PY" -c "import torch, vllm, nixl; assert torch.cuda.is_available(), 'torch sees no CUDA device'; print('[gpu_check] torch', torch.__version__, 'vLLM', vllm.__version__)"
  "$PY" scripts/gen_protos.py >/dev/null
fi

command=("$PY" -m bench --quick --only "$ONLY" --results-dir "$RESULTS_DIR")
echo "[gpu_check] + ${command[*]}"
if [ "$DRY_RUN" = 1 ]; then
  echo "[gpu_check] dry run: nothing started"
  exit 0
fi
mkdir -p "$RESULTS_DIR"
"${command[@]}"
echo "[gpu_check] done: $RESULTS_DIR/BENCHMARKS.md (compare its ratios with BENCHMARKS.md's CPU ones)"
