#!/usr/bin/env bash
# Every GPU test and benchmark, in one go, for a session that is lent a GPU (issue 43, item 6).
#
#   bench/gpu_all.sh [OUT_DIR]          # default runs/gpu; logs and JSON records there
#   QUICK=1 bench/gpu_all.sh            # the short versions (fits a 15-minute device lease)
#   SCORER=runs/train/scorer bench/gpu_all.sh   # the learned policy in the decode benchmark too
#
# 1. the kernel tests compiled on the GPU (TRITON_INTERPRET=0: the same tests that run in the interpreter on CPU,
#    plus the GPU-only large shapes, the no-sync selection and the decode loop's kept sets with and without kernels);
# 2. bench/kernels.py: every kernel against its torch reference (do_bench, GB/s against copy bandwidth), then
#    whole decode steps;
# 3. bench/decode.py --long on CUDA in bf16: every policy at 25% and 50% of the final length against the full cache.
# A step that fails is reported and the next one still runs; the exit status is 1 if any failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUT=${1:-runs/gpu}
mkdir -p "$OUT"
status=0

run() {
    local name=$1
    shift
    echo "== $name: $*"
    local t0=$SECONDS
    if "$@" >"$OUT/$name.log" 2>&1; then
        echo "   ok ($((SECONDS - t0)) s)"
    else
        echo "   FAILED (rc $?, $((SECONDS - t0)) s): $OUT/$name.log"
        status=1
    fi
    tail -n 30 "$OUT/$name.log"
}

$PY - <<'PY' || exit 1
import torch, triton
assert torch.cuda.is_available(), "no CUDA device"
print(torch.cuda.get_device_name(), "| torch", torch.__version__, "| triton", triton.__version__)
PY

if [ -n "${QUICK:-}" ]; then
    run kernel-tests env TRITON_INTERPRET=0 "$PY" -m pytest -x -q tests/test_kernels.py tests/test_kernels_features.py \
        tests/test_kernels_state.py
    run bench-kernels "$PY" bench/kernels.py --quick
    run bench-decode-long "$PY" bench/decode.py --long --dtype bfloat16 --long-settings 8:1536 \
        --policies full,streaming,h2o,snapkv,knorm --slack 16 --repeats 2 --json "$OUT/bench-decode-long.json"
else
    run kernel-tests env TRITON_INTERPRET=0 "$PY" -m pytest -x -q tests/test_kernels.py tests/test_kernels_features.py \
        tests/test_kernels_state.py tests/test_kernel_path.py
    run bench-kernels "$PY" bench/kernels.py
    run bench-decode-long "$PY" bench/decode.py --long --dtype bfloat16 ${SCORER:+--scorer "$SCORER"} --slack 16 \
        --repeats 3 --json "$OUT/bench-decode-long.json"
fi
exit $status
