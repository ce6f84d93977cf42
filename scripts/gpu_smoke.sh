#!/usr/bin/env bash
# GPU smoke check for a CUDA machine with no network: real CUDA metrics, two jobs on one GPU,
# the HTML report. Finishes within 5 minutes (a `timeout` enforces it).
#
#   scripts/gpu_smoke.sh [--dry-run] [--out DIR]
#
# Set-up, once, on a machine WITH network and the same Python (3.11) and CPU architecture,
# from this repository (torch from PyPI is its CUDA build):
#   pip wheel -w wheels torch==2.13.0 setuptools '.[gpu]'
# then copy the repository and wheels/ to the GPU machine and run
#   QUANTDASK_WHEELS=wheels scripts/gpu_smoke.sh
# which creates .venv from those wheels only (pip --no-index). Without QUANTDASK_WHEELS an
# existing .venv is used as it is (`make test` on the GPU machine adds dask-cuda and NVML when
# it sees CUDA). PYTHON=... picks another interpreter with quantdask installed.
# --dry-run runs the same checks on CPU slots (the test suite does, so the script stays alive).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ -n "${QUANTDASK_WHEELS:-}" ] && [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
    .venv/bin/pip install --quiet --no-index --find-links "$QUANTDASK_WHEELS" \
        torch==2.13.0 setuptools
    .venv/bin/pip install --quiet --no-index --find-links "$QUANTDASK_WHEELS" \
        --no-build-isolation -e '.[gpu]'
fi
PY="${PYTHON:-.venv/bin/python}"
if ! "$PY" -c "import quantdask" 2>/dev/null; then
    echo "gpu_smoke: $PY cannot import quantdask; run 'make test' (or set QUANTDASK_WHEELS)" >&2
    exit 2
fi
if [ "${1:-}" != "--dry-run" ] && command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
fi
exec timeout --kill-after=10 300 "$PY" scripts/gpu_smoke.py "$@"
