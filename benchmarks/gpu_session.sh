#!/usr/bin/env bash
# Everything that needs a GPU, in one run: the kernels checked against their torch references
# and timed, then the whole engine on CUDA (sizing, parity, swap, throughput). Tables are
# printed; JSON reports land in $OUT (or ./gpu-results). From the repository root, with torch's
# CUDA build and `pip install -e '.[dev,cuda]'` (docs/benchmarks.md, "On a GPU"):
#     bash benchmarks/gpu_session.sh
# Wheels in .whl/, if any, are installed first and offline: for a machine without a package index.
set -uo pipefail
out="${OUT:-gpu-results}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1

if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
# the package itself, editable (offline, no deps), for the benchmarks and the test below
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

status=0
python3 benchmarks/gpu_kernels.py --json-out "$out/kernels.json" || status=1
python3 benchmarks/cuda_engine.py --json-out "$out/cuda_engine.json" || status=1
# the suite's one CUDA-only test (skipped in CI): sizing from a real profiled forward
python3 -m pytest -q -p no:cacheprovider tests/ops/test_kv_sizing.py -k cuda || status=1
exit $status
