#!/usr/bin/env bash
# GPU smoke check, made for the lent GPU machine (the device tool): real CUDA metrics, two jobs
# packed on one GPU, NVML samples, torchao on a bfloat16 model and tests/test_gpu.py, within
# about 3 minutes (`timeout` cuts it at 4). The exact one-call command for the device tool is in
# benchmarks/RESULTS.md section 4.
#
#   scripts/gpu_smoke.sh [--dry-run] [--out DIR] [--tar FILE]
#
# With .gpu-bundle/site.tar.xz (built here by `make gpu-bundle`; carried there) it unpacks it
# into a fresh folder and runs the machine's own python3 (its CUDA torch and transformers)
# with the bundle on PYTHONPATH: no venv, nothing fetched. Without it, PYTHON=... (default:
# .venv/bin/python when there is one, else python3). Each run writes a fresh directory (--out
# must be new or empty); --tar FILE packs it as one tarball, which `quantdask report DIR/sweep`
# turns into the HTML report where the Jupyter stack is (the smoke writes none).
# --dry-run runs the same checks on CPU slots (the tests run it so that this script does not rot).
# QUANTDASK_SMOKE_TIMEOUT_S (default 240) is where `timeout` cuts it: on that SIGTERM the smoke
# still packs what finished (--tar), and `timeout` kills it 30 s later (closing a cluster
# on a loaded machine can take 10).
set -euo pipefail
cd "$(dirname "$0")/.."
# Set, it makes bitsandbytes load libbitsandbytes_cuda<that version>.so, which the bundle
# leaves out (it keeps only the CUDA 13.0 one, what the machine's torch loads).
unset BNB_CUDA_VERSION

PY="${PYTHON:-}"
if [ -z "$PY" ] && [ -f .gpu-bundle/site.tar.xz ]; then
    site=$(mktemp -d /tmp/quantdask-site.XXXXXX)
    python3 - .gpu-bundle/site.tar.xz "$site" <<'EOF'
import sys, tarfile
with tarfile.open(sys.argv[1]) as bundle:
    bundle.extractall(sys.argv[2], filter="data")
EOF
    export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
    PY=python3
    echo "gpu_smoke: python3 with the bundle unpacked in $site"
fi
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
# gpu_smoke.py checks that $PY can import what the smoke needs (exit 2 with the error if not):
# in its own process, so that torch is imported once.
if [[ " $* " != *" --dry-run "* ]] && command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
fi
exec timeout --kill-after=30 "${QUANTDASK_SMOKE_TIMEOUT_S:-240}" "$PY" scripts/gpu_smoke.py "$@"
